"""Export beyond the BERT families (issues 33 and 34): the backbone-generic encoder families on RoBERTa, DistilBERT
(no segment ids) and ModernBERT (local and global attention), MMoE (tabular) and BartTaskRouted (its encoder and one
decoding step), through `hf_taskmoe.onnx_export`. Each program is traced on one batch and run on a batch of another
size (and length, and task mix), and gives what the eager model gives within 1e-4, in torch (`export_program`) and
in onnxruntime (`export_onnx`). Weights are moved off their neutral start so that gates, PALs, task conditioning and
routes change the outputs.

ONNX costs a few seconds per program: the default run exports each family to ONNX on one encoder (each encoder once:
MT-TaG on ModernBERT, PALs on DistilBERT, CA-MTL on RoBERTa); `-m slow` runs the rest of the matrix."""

from __future__ import annotations

import pytest
import torch

from hf_taskmoe import CAMTLForMultiTask, MMoEModel, PALsForMultiTask, TaskMoEForMultiTask
from hf_taskmoe.onnx_export import export_onnx, export_program, task_widths

from .backbone_matrix import TASKS, VOCAB, dense_model

ARCHS = ["roberta", "distilbert", "modernbert"]
FAMILIES = {
    "mt-tag": (TaskMoEForMultiTask, {"num_experts": 4, "top_k": 2}),
    "pals": (PALsForMultiTask, {"pal_size": 8, "pal_num_heads": 2}),
    "ca-mtl": (CAMTLForMultiTask, {"conditional_attention_max_length": 16}),
}
#: ONNX cases of the default run (the others are marked slow): each family once, each encoder once
ONNX_DEFAULT = {("mt-tag", "modernbert"), ("pals", "distilbert"), ("ca-mtl", "roberta")}
CASES = [(family, arch) for family in FAMILIES for arch in ARCHS]


def _perturbed(model, scale: float = 0.3):
    """Move every weight: gates (N(0, 0.001)), PAL decoders and FiLMs start neutral and would hide a wrong route."""
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * scale)
    return model.eval()


def _encoder_model(family: str, arch: str):
    cls, kwargs = FAMILIES[family]
    return _perturbed(cls.from_dense(dense_model(arch), tasks=TASKS, **kwargs))


def _served_batch(model) -> dict[str, torch.Tensor]:
    """5 rows x 11 tokens, tasks 4 + 1 (traced: 3 rows x 8 tokens, 2 + 1), one row padded; segment ids where the
    model has a segment table."""
    g = torch.Generator().manual_seed(1)
    rows, length = 5, 11
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[1, -4:] = 0
    batch = {"input_ids": torch.randint(4, VOCAB, (rows, length), generator=g), "attention_mask": mask,
             "task_ids": torch.tensor([1, 1, 0, 1, 1])}
    if model.config.type_vocab_size:
        batch["token_type_ids"] = (torch.arange(length) >= length // 2).long().expand(rows, -1).contiguous()
    return batch


def _max_difference_to_eager(model, batch, padded_logits) -> float:
    """Each row's program logits against the eager model's (its checked forward) for the row's task; the padding
    beyond a task's width is zero."""
    with torch.no_grad():
        eager = model(**batch)
    padded_logits = torch.as_tensor(padded_logits)
    widths, worst = task_widths(model), 0.0
    for task, name in enumerate(model.config.task_names):
        got = padded_logits[batch["task_ids"] == task]
        torch.testing.assert_close(got[:, : widths[task]], eager.task_logits[name], atol=1e-4, rtol=1e-4)
        assert not got[:, widths[task]:].any()
        worst = max(worst, (got[:, : widths[task]] - eager.task_logits[name]).abs().max().item())
    return worst


@pytest.mark.parametrize("family, arch", CASES, ids=[f"{f}-{a}" for f, a in CASES])
def test_torch_export_of_an_encoder_family_matches_eager(family, arch):
    model = _encoder_model(family, arch)
    program = export_program(model)
    batch = _served_batch(model)
    names = [spec.arg.name for spec in program.graph_signature.input_specs if spec.kind.name == "USER_INPUT"]
    assert names == ["input_ids", "attention_mask", "task_ids", "token_type_ids"][: len(batch)]
    out = program.module()(*(batch[name] for name in names))
    assert out.shape == (5, max(task_widths(model)))
    _max_difference_to_eager(model, batch, out)


@pytest.mark.parametrize(
    "family, arch",
    [pytest.param(f, a, marks=pytest.mark.ci if (f, a) in ONNX_DEFAULT else pytest.mark.slow, id=f"{f}-{a}")
     for f, a in CASES],
)
def test_onnx_of_an_encoder_family_runs_in_onnxruntime_and_matches_eager(family, arch, tmp_path):
    onnxruntime = pytest.importorskip("onnxruntime")
    model = _encoder_model(family, arch)
    attention = model.config._attn_implementation
    path = export_onnx(model, tmp_path / "model.onnx")
    assert model.config._attn_implementation == attention and not model.training  # left as it was
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    batch = _served_batch(model)
    names = [i.name for i in session.get_inputs()]
    # segment ids only where the architecture has a table: not DistilBERT's nor ModernBERT's
    assert names == ["input_ids", "attention_mask", "task_ids"] + (["token_type_ids"] if arch == "roberta" else [])
    (logits,) = session.run(["logits"], {name: batch[name].numpy() for name in names})
    _max_difference_to_eager(model, batch, logits)


def test_segment_ids_are_refused_for_a_model_without_a_segment_table(tmp_path):
    model = _encoder_model("pals", "distilbert")
    assert model.config.type_vocab_size is None
    with pytest.raises(ValueError, match="no segment table"):
        export_onnx(model, tmp_path / "model.onnx", token_type_ids=True)
    with pytest.raises(ValueError, match="no segment table"):
        export_program(model, token_type_ids=True)


# ------------------------------------------------------------------------------------------------------------ MMoE
def _mmoe(architecture: str = "mmoe", **overrides):
    from .test_mmoe import config

    torch.manual_seed(0)
    return _perturbed(MMoEModel(config(architecture=architecture, **overrides)), scale=0.1)


def _features(model, rows: int, seed: int) -> dict[str, torch.Tensor]:
    config, g = model.config, torch.Generator().manual_seed(seed)
    features = {}
    if config.numeric_features:
        features["numeric_features"] = torch.randn(rows, len(config.numeric_features), generator=g)
    if config.categorical_features:
        features["categorical_features"] = torch.stack(
            [torch.randint(0, card, (rows,), generator=g) for card in config.categorical_cardinalities], dim=1
        )
    return features


@pytest.mark.parametrize(
    "architecture, overrides",
    [("mmoe", {}), ("omoe", {}), ("shared_bottom", {}),
     ("mmoe", {"categorical_features": [], "categorical_cardinalities": []})],
    ids=["mmoe", "omoe", "shared_bottom", "numeric_only"],
)
def test_torch_export_of_mmoe_matches_eager_on_another_batch_size(architecture, overrides):
    model = _mmoe(architecture, **overrides)
    program = export_program(model)  # traced on 3 rows
    served = _features(model, 7, seed=1)
    with torch.no_grad():
        eager = model(**served).logits
    got = program.module()(*served.values())
    assert got.shape == (7, sum(task_widths(model)))
    torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4)


def test_onnx_of_mmoe_runs_in_onnxruntime_and_matches_eager(tmp_path):
    onnxruntime = pytest.importorskip("onnxruntime")
    model = _mmoe()
    session = onnxruntime.InferenceSession(str(export_onnx(model, tmp_path / "mmoe.onnx")),
                                           providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["numeric_features", "categorical_features"]
    served = _features(model, 7, seed=1)
    (logits,) = session.run(["logits"], {name: t.numpy() for name, t in served.items()})
    with torch.no_grad():
        eager = model(**served)
    start = 0
    for name, width in zip(model.config.task_names, task_widths(model)):  # each task's columns, side by side
        torch.testing.assert_close(torch.as_tensor(logits[:, start: start + width]), eager.task_logits[name],
                                   atol=1e-4, rtol=1e-4)
        start += width


def test_mmoe_export_refuses_text_arguments():
    model = _mmoe()
    with pytest.raises(ValueError, match="token_type_ids"):
        export_program(model, token_type_ids=True)
    with pytest.raises(ValueError, match="max_length"):
        export_program(model, max_length=8)


# ------------------------------------------------------------------------------------------------------------ BART
def _bart_batch(rows: int, length: int, seed: int, task_ids: list[int]):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 60, (rows, length), generator=g)
    input_ids[1, -3:] = 1  # padding
    decoder_input_ids = torch.randint(3, 60, (rows, 4), generator=g)
    decoder_input_ids[:, 0] = 2  # the decoder start token
    return {"input_ids": input_ids, "attention_mask": (input_ids != 1).long(), "task_ids": torch.tensor(task_ids),
            "decoder_input_ids": decoder_input_ids}


@pytest.mark.parametrize("selection", ["gumbel_softmax_st", pytest.param("softmax", marks=pytest.mark.slow)])
def test_bart_encoder_and_decoding_step_export_and_match_eager(selection):
    """The encoder with its task routes, then one decoding step from its states (no cache): traced on 3 rows of 8
    tokens, run on 5 rows of 11 tokens and 4 decoder tokens of another task mix. Eager runs the experts each row's
    route uses (planned on the host); the programs run every expert, weighted by the row's decisions (a hard route:
    the chosen expert's output, exactly)."""
    from .test_bart_routed import routed

    model = routed(selection)
    encoder = export_program(model, part="encoder").module()
    step = export_program(model, part="decoder_step").module()
    batch = _bart_batch(5, 11, seed=1, task_ids=[2, 2, 0, 2, 1])
    states = encoder(batch["input_ids"], batch["attention_mask"], batch["task_ids"])
    with torch.no_grad():
        eager_states = model.get_encoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                           task_ids=batch["task_ids"]).last_hidden_state
        eager = model(**batch, use_cache=False).logits  # encoder and decoder, eager
    torch.testing.assert_close(states, eager_states, atol=1e-4, rtol=1e-4)
    for steps in (1, 4):  # the first step and a later one: each reads the whole prefix
        logits = step(batch["decoder_input_ids"][:, :steps], states, batch["attention_mask"], batch["task_ids"])
        torch.testing.assert_close(logits, eager[:, steps - 1], atol=1e-4, rtol=1e-4)


@pytest.mark.ci
def test_t5_encoder_and_decoding_step_export_and_match_eager():
    """The encoder-decoder class exports the same two programs for T5 as for BART (one class serves both)."""
    from .test_task_routed_t5 import routed, s2s_batch

    model = routed("t5", selection="gumbel_softmax_st", expert_noise_variance=1e-2)
    encoder = export_program(model, part="encoder").module()
    step = export_program(model, part="decoder_step").module()
    batch = s2s_batch(model, torch.tensor([2, 2, 0, 1, 1]), seed=1)
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(batch["labels"])
    states = encoder(batch["input_ids"], batch["attention_mask"], batch["task_ids"])
    with torch.no_grad():
        eager = model(**batch, use_cache=False)
    torch.testing.assert_close(states, eager.encoder_last_hidden_state, atol=1e-4, rtol=1e-4)
    for steps in (1, 4):
        logits = step(decoder_input_ids[:, :steps], states, batch["attention_mask"], batch["task_ids"])
        torch.testing.assert_close(logits, eager.logits[:, steps - 1], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_bart_programs_run_in_onnxruntime(tmp_path):
    onnxruntime = pytest.importorskip("onnxruntime")
    from .test_bart_routed import routed

    model = routed("gumbel_softmax_st")
    sessions = {part: onnxruntime.InferenceSession(str(export_onnx(model, tmp_path / f"{part}.onnx", part=part)),
                                                   providers=["CPUExecutionProvider"])
                for part in ("encoder", "decoder_step")}
    batch = _bart_batch(5, 11, seed=1, task_ids=[2, 2, 0, 2, 1])
    feed = {name: batch[name].numpy() for name in ("input_ids", "attention_mask", "task_ids")}
    (states,) = sessions["encoder"].run(["encoder_hidden_states"], feed)
    (logits,) = sessions["decoder_step"].run(["logits"], {
        "decoder_input_ids": batch["decoder_input_ids"].numpy(), "encoder_hidden_states": states,
        "attention_mask": feed["attention_mask"], "task_ids": feed["task_ids"]})
    with torch.no_grad():
        eager = model(**batch, use_cache=False).logits[:, -1]
    torch.testing.assert_close(torch.as_tensor(logits), eager, atol=1e-4, rtol=1e-4)


def test_bart_export_needs_checked_values_and_a_part():
    from .test_bart_routed import routed

    model = routed("gumbel_softmax_st")
    batch = _bart_batch(3, 8, seed=0, task_ids=[0, 1, 2])
    with pytest.raises(ValueError, match="values_checked=True"):
        torch.export.export(model, (), {k: batch[k] for k in ("input_ids", "attention_mask", "task_ids")})
    with pytest.raises(ValueError, match="part='encoder'"):
        export_program(model)
    with pytest.raises(ValueError, match="part"):
        export_program(_encoder_model("pals", "distilbert"), part="encoder")


def test_a_task_routed_causal_lm_is_pointed_to_export_task(tmp_path):
    """Task routing on a causal LM serves a task as a plain dense model (`export_task`): `export_onnx` says so."""
    from .test_task_routed_lm import routed

    with pytest.raises(ValueError, match=r"TaskRoutedForCausalLM\. Export one task's route .*export_task"):
        export_onnx(routed("gpt2"), tmp_path / "lm.onnx")
