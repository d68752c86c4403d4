"""Every encoder family exports (issue 34): `torch.export` of the model's own forward and ONNX through
`hf_taskmoe.export_onnx`, with a dynamic batch size and sequence length, one program for every task mix. Traced on a
batch of 3 rows x 8 tokens holding both tasks, each program is run on 5 rows x 11 tokens with another mix (4 + 1,
padding) and gives what the eager model gives, within 1e-4; `torch.jit.trace` of a task model, which would bake in
the example's task mix, is refused with a pointer here, and a traced encoder answers another mix rightly."""

from __future__ import annotations

import pytest
import torch

from hf_taskmoe import (
    BertForTaskMoE,
    BertPALsConfig,
    BertTaskMoEConfig,
    BertWithPALs,
    CAMTLConfig,
    CAMTLModel,
    TaskSpec,
)
from hf_taskmoe.onnx_export import export_onnx, task_widths

SIZES = dict(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
# two tasks of different widths: the exported logits are padded to the wider one
TASKS = [TaskSpec(name="a", num_labels=3), TaskSpec(name="b", problem_type="regression")]
FAMILIES = {
    "mt_tag_sorted_loop": lambda: BertForTaskMoE(BertTaskMoEConfig(tasks=TASKS, num_experts=4, top_k=1, **SIZES)),
    "mt_tag_grouped_mm": lambda: BertForTaskMoE(BertTaskMoEConfig(
        tasks=TASKS, num_experts=4, top_k=2, experts_implementation="taskmoe_sorted_grouped", **SIZES)),
    "pals": lambda: BertWithPALs(BertPALsConfig(tasks=TASKS, pal_size=8, pal_num_heads=2, **SIZES)),
    "camtl": lambda: CAMTLModel(CAMTLConfig(tasks=TASKS, conditional_attention_max_length=16, **SIZES)),
}


def _model(family: str):
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    with torch.no_grad():  # routes, PALs (zero decoders) and task conditioning (zero FiLMs) start neutral: move them
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.3)
    return model


def _batch(rows: int, length: int, task_ids: list[int], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[1, -4:] = 0
    return {"input_ids": torch.randint(3, 60, (rows, length), generator=g), "attention_mask": mask,
            "token_type_ids": (torch.arange(length) >= length // 2).long().expand(rows, -1).contiguous(),
            "task_ids": torch.tensor(task_ids)}


TRACED = _batch(3, 8, [0, 1, 0], seed=0)
SERVED = _batch(5, 11, [1, 1, 0, 1, 1], seed=1)  # another size, length and task mix


def _assert_matches_eager(model, batch, padded_logits):
    with torch.no_grad():
        eager = model(**batch)  # the checked eager forward: per-task rows and heads
    widths = task_widths(model)
    for task, name in enumerate(model.config.task_names):
        rows = (batch["task_ids"] == task).nonzero()[:, 0]
        got = torch.as_tensor(padded_logits)[rows]
        torch.testing.assert_close(got[:, : widths[task]], eager.task_logits[name], atol=1e-4, rtol=1e-4)
        assert not got[:, widths[task]:].any()  # zeros beyond the task's width


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_torch_export_of_the_model_matches_eager_on_another_batch(family):
    model = _model(family)
    batch, seq = torch.export.Dim("batch", min=1), torch.export.Dim("seq", min=1, max=model.max_input_length())
    per_token = {0: batch, 1: seq}
    program = torch.export.export(
        model, (), {**TRACED, "values_checked": True},
        dynamic_shapes={"input_ids": per_token, "attention_mask": per_token, "token_type_ids": per_token,
                        "task_ids": {0: batch}, "values_checked": None},
    )
    out = program.module()(**SERVED, values_checked=True)
    assert out.logits.shape == (5, max(task_widths(model)))
    _assert_matches_eager(model, SERVED, out.logits)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_onnx_export_runs_in_onnxruntime_and_matches_eager(family, tmp_path):
    onnxruntime = pytest.importorskip("onnxruntime")
    model = _model(family)
    attention = model.config._attn_implementation
    path = export_onnx(model, tmp_path / f"{family}.onnx")
    assert model.config._attn_implementation == attention and not model.training  # left as it was
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask", "task_ids", "token_type_ids"]
    (logits,) = session.run(["logits"], {name: tensor.numpy() for name, tensor in SERVED.items()})
    _assert_matches_eager(model, SERVED, logits)


def test_export_takes_checked_values_and_no_labels():
    model = _model("pals")
    with pytest.raises(ValueError, match="values_checked=True"):
        torch.export.export(model, (), dict(TRACED))
    with pytest.raises(ValueError, match="labels"):
        torch.export.export(model, (), {**TRACED, "labels": torch.tensor([0.0, 1.0, 2.0]), "values_checked": True})


@pytest.mark.parametrize("family", ["mt_tag_sorted_loop", "pals"])
def test_jit_trace_is_refused_and_points_to_export(family):
    model = _model(family)
    with pytest.raises(ValueError, match="export_onnx"):
        torch.jit.trace(model, example_kwarg_inputs=dict(TRACED), strict=False)


class _Encoder(torch.nn.Module):
    """A task model's encoder (`encode`: its output, the heads not run) as a module to trace."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids, task_ids):
        return self.model.encode(input_ids, attention_mask, token_type_ids, None, None, task_ids)


@pytest.mark.parametrize("family", ["mt_tag_sorted_loop", "pals", "camtl"])
def test_jit_trace_of_the_encoder_answers_another_task_mix(family):
    """The encoders have no data-dependent shape while traced (masked dense experts, PALs batched across groups), so a
    traced encoder gives the eager hidden states on a batch of another size, length and task mix."""
    encoder = _Encoder(_model(family)).eval()
    names = ("input_ids", "attention_mask", "token_type_ids", "task_ids")
    traced = torch.jit.trace(encoder, example_kwarg_inputs={n: TRACED[n] for n in names}, strict=False)
    with torch.no_grad():
        expected = encoder(**{n: SERVED[n] for n in names}).last_hidden_state
    torch.testing.assert_close(traced(**{n: SERVED[n] for n in names})["last_hidden_state"], expected,
                               atol=1e-4, rtol=1e-4)


def test_a_successful_onnx_export_is_quiet(tmp_path, capfd):
    """None of what torch's exporter says on every export of these models reaches the user (training-mode wrapper,
    torchvision ops, pytree deprecation, shared axis names): no warning, nothing on stderr."""
    import warnings

    pytest.importorskip("onnxscript")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_onnx(_model("mt_tag_sorted_loop"), tmp_path / "quiet.onnx")
    assert [str(w.message) for w in caught] == []
    assert capfd.readouterr().err == ""
