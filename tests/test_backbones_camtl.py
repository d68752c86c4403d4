"""CA-MTL on every declared encoder (`CAMTLForMultiTask`): the family contract over the backbone matrix (dense
equivalence at initialisation, save / load through the Auto classes, mixed-task batches, learning a few examples,
bf16), conditional attention refused where an architecture or attention implementation has no additive-bias seam,
and the task bias really reaching the attention scores, composed with padding and ModernBERT's sliding windows."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_taskmoe
from hf_taskmoe import CAMTLBackboneConfig, CAMTLForMultiTask
from hf_taskmoe.compat import CHECKPOINTING_ENABLE
from hf_taskmoe.layers.conditional import FiLM
from hf_taskmoe.models import family_for

from .backbone_matrix import ENCODER_ARCHS, TASKS, VOCAB, dense_config, dense_model, method_cases, token_batch
from .family_tester import FamilyContract

#: conditional attention over 16 tokens (the batches have 9); 0-std blocks make `from_dense` exact
SMALL = {"conditional_attention_max_length": 16}
EXACT = dict(SMALL, conditional_attention_init_std=0.0)
NO_BIAS = {"deberta-v2": {"conditional_attention": False}}  # no seam for an additive bias (`Backbone.why_no_bias`)
#: the contract's "learns a few examples" in fewer, larger steps (the file stays near a minute on two shared cores)
FAST = {"learns_steps": 30, "learns_lr": 1e-2}
WITH_BIAS = [arch for arch in ENCODER_ARCHS if arch not in NO_BIAS]

CASES = {
    **method_cases("ca-mtl", CAMTLForMultiTask, CAMTLBackboneConfig, archs=WITH_BIAS, config_kwargs=SMALL, **FAST,
                   from_dense_kwargs=EXACT),
    **{
        name: case
        for arch, extra in NO_BIAS.items()
        for name, case in method_cases("ca-mtl", CAMTLForMultiTask, CAMTLBackboneConfig, archs=[arch],
                                       config_kwargs={**SMALL, **extra}, from_dense_kwargs={**EXACT, **extra},
                                       **FAST).items()
    },
}


@pytest.fixture(params=list(CASES), ids=list(CASES))
def case(request):
    return CASES[request.param]


class TestCAMTLOnEveryEncoder(FamilyContract):
    @pytest.fixture(autouse=True)
    def _case(self, case):
        self.case = case


def test_the_family_is_registered_for_every_encoder():
    family = hf_taskmoe.FAMILIES["camtl"]
    assert family.model_class is CAMTLForMultiTask and family.method == "ca-mtl"
    assert family_for("ca-mtl", "roberta") is family and family_for("camtl_any", "modernbert") is family
    assert family_for("camtl", "bert").model_class.__name__ == "CAMTLModel"  # BERT keeps CAMTLModel


def test_conditional_attention_is_refused_on_deberta_v2_naming_the_alternative():
    with pytest.raises(ValueError, match=r"deberta-v2 model: .*conditional_attention=False"):
        CAMTLBackboneConfig(dense_config=dense_config("deberta-v2"), tasks=TASKS, **SMALL)
    with pytest.raises(ValueError, match=r"conditional_attention=False"):
        CAMTLForMultiTask.from_dense(dense_model("deberta-v2"), TASKS, **SMALL)
    # the layers chosen for conditioning decide: no conditional layer, nothing refused
    CAMTLBackboneConfig(dense_config=dense_config("deberta-v2"), tasks=TASKS, conditional_layers=[], **SMALL)


def test_an_attention_implementation_without_an_additive_mask_is_refused_by_name():
    flash = {"dense_config": dense_config("roberta"), "tasks": TASKS, "attn_implementation": "flash_attention_2"}
    with pytest.raises(ValueError, match=r"'flash_attention_2' attention implementation .*='sdpa' or 'eager'"):
        CAMTLBackboneConfig(**flash, **SMALL)
    CAMTLBackboneConfig(**flash, conditional_attention=False, **SMALL)
    model = CAMTLForMultiTask.from_dense(dense_model("roberta"), TASKS, **SMALL).eval()
    model.backbone.config._attn_implementation_internal = "flex_attention"  # switched after construction
    with pytest.raises(ValueError, match=r"'flex_attention' attention implementation of this roberta model"):
        model(**token_batch("roberta", VOCAB, torch.tensor([0, 1])))
    model.backbone.config._attn_implementation_internal = "sdpa"
    model.task_context.begin(torch.tensor([0, 1]))  # a hook refuses it too, should the dense model be called alone
    model.backbone.get_submodule("encoder.layer.1.attention.self").config._attn_implementation_internal = "flex"
    with pytest.raises(ValueError, match=r"'flex' attention implementation of this roberta model"):
        model(**token_batch("roberta", VOCAB, torch.tensor([0, 1])))


def _task_dependent(arch: str, **kwargs) -> CAMTLForMultiTask:
    """A model whose only conditional module is the attention bias, with a task-dependent M(z) (FiLM moved off
    zero) in every layer."""
    model = CAMTLForMultiTask.from_dense(
        dense_model(arch), TASKS, conditional_alignment=False, conditional_layer_norm=False,
        conditional_bottleneck="none", conditional_layers=[0, 1], conditional_attention_init_std=0.5, **SMALL,
        **kwargs,
    ).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        model.task_embeddings.weight.normal_(0.0, 1.0)
        for module in model.modules():
            if isinstance(module, FiLM):
                module.weight.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", WITH_BIAS)
def test_the_task_bias_changes_attention_and_respects_padding(arch, implementation):
    model = _task_dependent(arch)
    model.set_attn_implementation(implementation)
    batch = token_batch(arch, VOCAB, torch.tensor([0, 0]))  # row 0: 3 padded tokens at the end
    with torch.no_grad():
        first = model(**batch, output_hidden_states=True).hidden_states[-1]
        other = model(**{**batch, "task_ids": torch.tensor([1, 1])}, output_hidden_states=True).hidden_states[-1]
        real = int(batch["attention_mask"][0].sum())
        alone = {k: v[:1, :real] if v.dim() == 2 else v[:1] for k, v in batch.items()}  # row 0 unpadded, no mask
        alone["attention_mask"] = torch.ones_like(alone["attention_mask"])
        unpadded = model(**alone, output_hidden_states=True).hidden_states[-1]
    # the same tokens under another task's M(z): different states (every position of the unpadded row)
    assert (first[1] - other[1]).abs().amax(-1).min() > 1e-4
    # a padded row's real tokens equal the row without padding (padded keys stay masked under the bias)
    torch.testing.assert_close(first[0, :real], unpadded[0], atol=1e-5, rtol=1e-5)


def test_the_bias_composes_with_modernbert_sliding_windows():
    """ModernBERT's local layer attends within a window (`local_attention=4`): with the bias added, a token far
    outside every window of the first position still cannot reach it through the local layer alone."""
    model = _task_dependent("modernbert", conditional_attention=True)
    model.set_attn_implementation("eager")
    batch = token_batch("modernbert", VOCAB, torch.tensor([0, 1]))
    batch["attention_mask"][:] = 1
    seen = {}

    def keep(module, args, kwargs):
        seen[module.layer_idx] = kwargs["attention_mask"]

    layers = model.backbone.layers
    handles = [layer.attn.register_forward_pre_hook(keep, with_kwargs=True) for layer in layers]
    try:
        with torch.no_grad():
            out = model(**batch, output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    local = [i for i, layer in enumerate(layers) if layer.attention_type == "sliding_attention"]
    assert local and seen[local[0]] is not None
    probabilities = out.attentions[local[0]]  # (batch, heads, seq, seq)
    window = model.backbone.config.local_attention // 2
    far = (torch.arange(9)[:, None] - torch.arange(9)[None, :]).abs() > window
    assert probabilities[..., far].abs().max() == 0  # outside the window: no attention despite M(z)
    assert not torch.equal(seen[local[0]][0], seen[local[0]][1])  # each row its own task's M(z)


def test_upcycling_copies_the_dense_norms_into_the_conditional_layer_norms():
    model, report = CAMTLForMultiTask.from_dense(dense_model("modernbert"), TASKS, output_loading_info=True,
                                                 **SMALL)
    norm = model.backbone.layers[1].mlp_norm
    assert type(norm).__name__ == "TaskLayerNorm" and norm.bias is None  # ModernBERT's norms carry no bias
    assert report.copied["backbone.layers.1.mlp_norm.weight"] == "layers.1.mlp_norm.weight"
    new_parts = (".film.", ".attention_bias.", ".bottleneck.", "alignment.", "task_embeddings.", "heads.")
    assert report.new and all(any(p in name for p in new_parts) for name in report.new)


@pytest.mark.parametrize("arch", ["electra", "distilbert"])
def test_bottom_half_and_embeddings_are_frozen_and_stay_frozen_after_loading(arch, tmp_path):
    model = CAMTLForMultiTask.from_dense(dense_model(arch), TASKS, conditional_layers=[0, 1], **SMALL)

    def frozen(m):
        return {n for n, p in m.named_parameters() if not p.requires_grad}

    names = frozen(model)
    assert names and all(".embeddings." in n or ".layer.0." in n for n in names)
    assert not any(part in n for n in names for part in (".film.", "attention_bias.", "bottleneck."))
    assert any(".layer.0." in n for n in names) and not any(".layer.1." in n for n in names)
    model.save_pretrained(tmp_path)
    assert frozen(type(model).from_pretrained(tmp_path)) == names


@pytest.mark.parametrize("arch", ["modernbert"])  # the contract runs BASE on every architecture
def test_large_bottleneck_starts_at_the_dense_model_and_trains(arch):
    dense = dense_model(arch)
    model = CAMTLForMultiTask.from_dense(dense, TASKS, conditional_bottleneck="large", **EXACT)
    assert len(model.skip) == 2
    batch = token_batch(arch, VOCAB, torch.tensor([0, 1, 0]))
    plain = {k: v for k, v in batch.items() if k != "task_ids"}
    with torch.no_grad():
        got = model.eval()(**batch, output_hidden_states=True).hidden_states[-1]
        expected = dense(**plain).last_hidden_state
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-5, rtol=1e-5)
    batch["labels"] = torch.tensor([1.0, 0.5, 2.0])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):  # s_j reaches the loss through the zero-initialised up-projections of the later steps
        optimizer.zero_grad()
        model.train()(**batch).loss.backward()
        optimizer.step()
    assert all(step.up.weight.grad.abs().sum() > 0 for step in model.skip)


def test_a_deep_copy_keeps_its_hooks_on_its_own_modules():
    model = _task_dependent("roberta")
    twin = copy.deepcopy(model)
    batch = token_batch("roberta", VOCAB, torch.tensor([0, 1]))
    with torch.no_grad():
        for module in twin.modules():
            if isinstance(module, FiLM):
                module.weight.zero_()
        assert not torch.allclose(model(**batch).task_logits["a"], twin(**batch).task_logits["a"])


def test_the_script_builds_ca_mtl_on_a_saved_modernbert_with_uncertainty_sampling(tmp_path, minilm):
    """`run_multitask.py --model_family camtl` on a ModernBERT checkpoint (with a WordPiece tokenizer beside it):
    CAMTLForMultiTask, MT-Uncertainty sampling, two steps, evaluation, saved, loaded by AutoModel."""
    import shutil
    import sys
    from pathlib import Path

    from transformers import AutoModel, ModernBertConfig, ModernBertModel

    examples = str(Path(__file__).resolve().parents[1] / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import run_multitask

    dense = tmp_path / "dense"
    torch.manual_seed(0)
    ModernBertModel(ModernBertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                                     global_attn_every_n_layers=2, local_attention=8)).save_pretrained(dense)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm / name, dense / name)
    out = tmp_path / "out"
    run_multitask.main([
        "--model_name_or_path", str(dense), "--output_dir", str(out), "--model_family", "camtl", "--do_train",
        "--do_eval", "--max_steps", "2", "--per_device_train_batch_size", "4", "--max_train_samples", "8",
        "--max_eval_samples", "4", "--max_seq_length", "32", "--use_cpu", "--report_to", "none", "--save_strategy",
        "no", "--disable_tqdm", "true", "--task_sampling", "uncertainty",
    ])
    model = AutoModel.from_pretrained(out)
    assert isinstance(model, CAMTLForMultiTask) and model.config.dense_config.model_type == "modernbert"
    assert model.config.conditional_attention_max_length == 32  # follows --max_seq_length


@pytest.mark.parametrize("bottleneck", ["base", "large"])
def test_activation_checkpointing_gives_the_same_gradients(bottleneck):
    """Checkpointed layers are recomputed in the backward pass: their hooks must find the same task ids (the base's
    context_fn) and LARGE's skip state of that layer (a new flags dict per layer), so the gradients do not change."""
    model = CAMTLForMultiTask.from_dense(dense_model("roberta"), TASKS, conditional_layers=[0, 1],
                                         conditional_bottleneck=bottleneck, num_frozen_layers=0, **SMALL).train()
    with torch.no_grad():  # every conditional module off its neutral start
        for name, param in model.named_parameters():
            if any(part in name for part in ("film", "up", "skip", "task_embeddings")):
                param.normal_(0.0, 0.3)
    batch = {**token_batch("roberta", VOCAB, torch.tensor([0, 1, 0])), "labels": torch.tensor([1.0, 0.3, 2.0])}

    def gradients():
        model.zero_grad()
        model(**batch).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    getattr(model, CHECKPOINTING_ENABLE)()  # the installed release's name (hf_taskmoe.compat)
    checkpointed = gradients()
    assert sorted(plain) == sorted(checkpointed)
    torch.testing.assert_close(checkpointed, plain, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("arch", ["roberta", "modernbert"])
def test_covariance_inputs_are_what_the_first_layer_reads_after_the_conditional_alignment(arch):
    """`first_layer_inputs` (CA-MTL eq. 7's inputs) on a backbone-generic model: the embeddings after the task's
    conditional alignment, so two tasks' views of the same rows differ once the alignment has learnt; without an
    alignment, the dense model's embeddings."""
    from hf_taskmoe.analysis import first_layer_inputs

    torch.manual_seed(0)
    model = CAMTLForMultiTask.from_dense(dense_model(arch), tasks=TASKS, **SMALL).eval()
    with torch.no_grad():
        for param in model.alignment.parameters():
            param.add_(torch.randn_like(param) * 0.3)
    rows = token_batch(arch, VOCAB, torch.zeros(3, dtype=torch.long))
    rows = {k: v for k, v in rows.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    names = model.config.task_names
    seen = first_layer_inputs(model, {names[0]: rows})[names[0]]
    other = first_layer_inputs(model, {names[1]: rows})[names[1]]
    assert seen.shape == (int(rows["attention_mask"].sum()), model.config.hidden_size)
    assert not torch.allclose(seen, other)
    plain = CAMTLForMultiTask.from_dense(dense_model(arch), tasks=TASKS, conditional_alignment=False, **SMALL).eval()
    embedded = plain.backbone.embeddings(input_ids=rows["input_ids"])  # (batch, seq, hidden)
    got = plain.first_layer_inputs(rows["input_ids"], rows["attention_mask"],
                                   task_ids=torch.zeros(3, dtype=torch.long))
    torch.testing.assert_close(got, embedded)
