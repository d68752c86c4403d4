"""Issue 58, item 1 ("equivalence first"): MT-TaG's experts moved onto transformers' experts interface keep the numbers
they had. `tests/fixtures/mttag_reference.safetensors` holds what the code before that change computed (its
sorted-loop dispatch, `tests/fixtures/make_mttag_reference.py`, not rerun here) for tiny MT-TaG (task gates),
MT-Switch (one shared gate) and MT-Dense models, top-1 and top-2, both expert weightings, on a batch mixing three
tasks: the loss, each task's logits and the gradient of every parameter after one backward. The same numbers must
come out, in fp32, to 1e-6."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from . import mttag_reference as ref

SAVED = load_file(Path(__file__).parent / "fixtures" / "mttag_reference.safetensors")


def saved(case: str) -> dict[str, torch.Tensor]:
    return {key.split("/", 1)[1]: value for key, value in SAVED.items() if key.startswith(f"{case}/")}


def assert_same_step(results: dict, expected: dict, atol: float = 1e-6) -> None:
    assert sorted(results) == sorted(expected)  # the same parameters took a gradient, the same tasks gave logits
    for key, value in expected.items():
        torch.testing.assert_close(results[key], value, atol=atol, rtol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("case", list(ref.CASES))
def test_a_training_step_computes_what_it_computed_before_the_experts_interface(case):
    model = ref.model(case)
    assert_same_step(ref.training_step(model), saved(case))


@pytest.mark.parametrize("case", [case for case, kwargs in ref.CASES.items() if kwargs["num_experts"] > 1])
def test_the_recorded_batch_routes_tokens_to_several_experts(case):
    """The experts differ and the gates send the batch's tokens to more than one of them in every MoE layer (an
    expert left without tokens too), so a dispatch that mixed up experts or tokens would change the recorded
    numbers."""
    model = ref.model(case).eval()
    with torch.no_grad():
        chosen = model(**{k: v for k, v in ref.batch().items() if k != "labels"}, output_router_logits=True)
    assert all(len(layer.unique()) > 1 for layer in chosen.expert_indices)


#: transformers' implementations multiply the weights in and sum in other orders: equal within fp32 rounding
TRANSFORMERS_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


@pytest.mark.parametrize("implementation", ["taskmoe_sorted", *TRANSFORMERS_IMPLEMENTATIONS])
@pytest.mark.parametrize("case", [case for case, kwargs in ref.CASES.items() if kwargs["num_experts"] > 1])
def test_every_registered_implementation_computes_the_recorded_step(case, implementation):
    """`experts_implementation` picks any implementation of transformers' registry: MT-TaG's own to 1e-6, transformers'
    `eager`, `batched_mm` and `grouped_mm` within fp32 rounding (straight-through weights of 1.0 multiplied in)."""
    model = ref.model(case, experts_implementation=implementation)
    assert model.config._experts_implementation == implementation
    rtol = 1e-6 if implementation == "taskmoe_sorted" else 1e-5
    results, expected = ref.training_step(model), saved(case)
    assert sorted(results) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(results[key], value, atol=1e-6, rtol=rtol, msg=lambda m, key=key: f"{key}: {m}")


def test_set_experts_implementation_and_from_pretrained_switch_the_implementation(tmp_path, monkeypatch):
    """transformers' own switches: `model.set_experts_implementation(...)` and `from_pretrained(...,
    experts_implementation=...)`; the choice is not saved in config.json, and a reloaded model takes the default."""
    from hf_taskmoe import TaskMoEForMultiTask
    from hf_taskmoe.layers import moe as moe_module

    case = "task-top2-gate"
    model = ref.model(case)
    assert model.config._experts_implementation == "taskmoe_auto"
    called = []
    grouped = moe_module.ALL_EXPERTS_FUNCTIONS["grouped_mm"]
    monkeypatch.setitem(moe_module.ALL_EXPERTS_FUNCTIONS._global_mapping, "grouped_mm",
                        lambda *args, **kwargs: called.append(1) or grouped(*args, **kwargs))
    model.set_experts_implementation("grouped_mm")
    assert model.config._experts_implementation == "grouped_mm"
    assert model.backbone.config._experts_implementation != "grouped_mm"  # the dense model has no experts
    assert_same_step(ref.training_step(model), saved(case), atol=1e-6)
    assert len(called) == 2  # one call per MoE layer
    model.save_pretrained(tmp_path)
    assert "experts_implementation" not in (tmp_path / "config.json").read_text()
    loaded = TaskMoEForMultiTask.from_pretrained(tmp_path, experts_implementation="batched_mm")
    assert loaded.config._experts_implementation == "batched_mm"
    assert TaskMoEForMultiTask.from_pretrained(tmp_path).config._experts_implementation == "taskmoe_auto"
    with pytest.raises(ValueError, match="experts_implementation"):
        model.set_experts_implementation("no_such_kernel")
