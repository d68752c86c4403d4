"""The architectures declared after the first fourteen (issue 57): a tiny random model of each, built from transformers'
own config class (`backbone_matrix.NEW_CONFIGS`), through every method that applies to it.

The default run takes each (architecture, method) pair through a smoke path -- `from_dense` computes the dense model
(where the method promises it), one training step's loss is finite and reaches the method's new weights, save / load
through the Auto classes gives the same outputs, and a decoder's or encoder-decoder's greedy `generate` is the dense
model's -- and checks that each refused pair is refused naming the architecture, the method and the reason. The full
family contract (`family_tester.FamilyContract`) on every pair runs under `-m slow` (a step of `.ci/run`). The table of
docs/backbones.md must be what `support_table()` generates from the declarations now."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM

from hf_taskmoe import (
    CAMTLBackboneConfig,
    CAMTLForMultiTask,
    PALsConfig,
    PALsForMultiTask,
    TaskMoEConfig,
    TaskMoEForMultiTask,
    TaskSpec,
)
from hf_taskmoe.backbones import (
    DECODER_BACKBONE,
    ENCODER_BACKBONE,
    ENCODER_DECODER_BACKBONE,
    METHODS,
    backbone_names,
    get_backbone,
)
from hf_taskmoe.backbones.table import TABLE_END, TABLE_START, support_table
from hf_taskmoe.models import family_of
from hf_taskmoe.models.task_routing import TaskRoutedForCausalLM, TaskRoutedForSeq2SeqLM

from .backbone_matrix import (
    ENCODER_ARCHS,
    NEW_ARCHS,
    NEW_CONFIGS,
    SPECIAL,
    TASKS,
    VOCAB,
    labelled_batch,
    method_cases,
)
from .family_tester import FamilyCase, FamilyContract

#: the encoder methods, as the smoke path and the contract build them (sizes as in test_backbones*.py)
ENCODER_METHODS = {
    "mt-tag": (TaskMoEForMultiTask, TaskMoEConfig, {"num_experts": 2}),
    "pals": (PALsForMultiTask, PALsConfig, {"pal_size": 8, "pal_num_heads": 2}),
    # 0-std attention blocks make `from_dense` exact (tests/test_backbones_camtl.py)
    "ca-mtl": (CAMTLForMultiTask, CAMTLBackboneConfig,
               {"conditional_attention_max_length": 16, "conditional_attention_init_std": 0.0}),
}
ROUTED = {DECODER_BACKBONE: (TaskRoutedForCausalLM, AutoModelForCausalLM),
          ENCODER_DECODER_BACKBONE: (TaskRoutedForSeq2SeqLM, AutoModelForSeq2SeqLM)}
S2S_TASKS = [TaskSpec(name=n, problem_type="seq2seq") for n in ("x", "y")]
#: every (architecture, method) pair the declarations allow, and every one they refuse
PAIRS = [(a, m) for a in NEW_ARCHS for m in METHODS if get_backbone(a).supports(m)]
REFUSED = [(a, m) for a in NEW_ARCHS for m in get_backbone(a).unsupported]


def new_dense(arch: str):
    """The tiny dense model of `arch`, seeded: an encoder's base model, a decoder's / encoder-decoder's LM."""
    torch.manual_seed(0)
    kind = get_backbone(arch).kind
    auto = AutoModel if kind == ENCODER_BACKBONE else ROUTED[kind][1]
    return auto.from_config(NEW_CONFIGS[arch]()).eval()


def text_batch(model, task_ids: torch.Tensor, rows: torch.Tensor | None = None, seed: int = 0) -> dict:
    """Rows of tasks `task_ids` for a routed model: tokens in [4, VOCAB), the first row padded (left for a decoder,
    which generates from the batch, right for an encoder-decoder's inputs); labels the next tokens (a decoder: its
    own ids, the prompt's first 3 and the padding -100) or a target ending in eos (an encoder-decoder: the layout its
    tokenizer makes, which mBART's own label shift reads its decoder start from)."""
    g = torch.Generator().manual_seed(seed)
    n = len(task_ids)
    ids = torch.randint(4, VOCAB, (n, 8), generator=g)
    mask = torch.ones_like(ids)
    decoder = model.config.dense_config.model_type in backbone_names(DECODER_BACKBONE)
    if decoder:
        mask[0, :2] = 0
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :3] = -100
    else:
        mask[0, -2:] = 0
        labels = torch.randint(4, VOCAB, (n, 5), generator=g)
        labels[:, -1] = SPECIAL["eos_token_id"]
    batch = dict(input_ids=ids.masked_fill(mask == 0, SPECIAL["pad_token_id"]), attention_mask=mask, labels=labels,
                 task_ids=torch.as_tensor(task_ids))
    return batch if rows is None else {k: v[rows] for k, v in batch.items()}


def build(arch: str, method: str, **kwargs):
    """The method's model of `arch` by `from_dense` (eval mode), and the dense model it was built from."""
    dense = new_dense(arch)
    kind = get_backbone(arch).kind
    if kind == ENCODER_BACKBONE:
        model_cls, _, defaults = ENCODER_METHODS[method]
        return model_cls.from_dense(dense, TASKS, **{**defaults, **kwargs}).eval(), dense
    kwargs = {"selection": "softmax", "expert_noise_variance": 0.0, **kwargs}
    return ROUTED[kind][0].from_dense(dense, S2S_TASKS, **kwargs).eval(), dense


def dense_outputs(model, dense, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The method's and the dense model's outputs on the batch: an encoder's last hidden states on the real tokens,
    an LM's logits."""
    plain = {k: v for k, v in batch.items() if k != "task_ids"}
    with torch.no_grad():
        if model.config.dense_config.model_type in backbone_names(ENCODER_BACKBONE):
            mask = batch["attention_mask"].bool()
            return (model(**batch, output_hidden_states=True).hidden_states[-1][mask],
                    dense(**plain).last_hidden_state[mask])
        return model(**batch).logits, dense(**plain).logits


def smoke_batch(model, arch: str) -> dict:
    ids = torch.tensor([0, 1, 0, 1])
    if get_backbone(arch).kind == ENCODER_BACKBONE:
        return labelled_batch(model, ids)
    return text_batch(model, ids)


# ---------------------------------------------------------------------------------------------- declarations
def test_every_declared_architecture_has_a_tiny_config_in_the_matrix():
    """Each declared architecture is tested: the first fourteen by their own files, every later one here."""
    first = {*ENCODER_ARCHS, "gpt2", "llama", "qwen2", "mistral", "t5", "mt5", "bart"}
    assert sorted(first | set(NEW_ARCHS)) == backbone_names()
    assert not first & set(NEW_ARCHS)


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_declared_paths_are_the_architectures_modules(arch):
    declared = get_backbone(arch)
    config = NEW_CONFIGS[arch]()
    assert config.model_type == arch
    torch.manual_seed(0)
    base = AutoModel.from_config(config)
    layers = base.get_submodule(declared.layers)
    assert isinstance(layers, nn.ModuleList)
    if "albert" not in arch:  # ALBERT runs one shared layer at every depth (why its methods are refused)
        assert len(layers) == declared.config_value(config, "num_hidden_layers")
    stacks = [layers] + ([base.get_submodule(declared.decoder_layers)] if declared.decoder_layers else [])
    for stack in stacks[:1]:  # the paths are an (encoder) layer's; a T5 decoder block's FFN is one sub-layer later
        layer = stack[-1]
        ffn = layer.get_submodule(declared.ffn.module)
        assert isinstance(ffn, nn.Module) and not isinstance(ffn, nn.Identity)
        if declared.ffn.split:
            assert isinstance(layer.get_submodule(declared.ffn.w_in), nn.Linear)
            assert isinstance(layer.get_submodule(declared.ffn.w_out), nn.Linear)
        assert isinstance(layer.get_submodule(declared.attention_output), nn.Linear)
        for norm in declared.norms:
            assert type(layer.get_submodule(norm)).__name__.endswith("Norm"), norm
        layer.get_submodule(declared.attention)
    if declared.supports("task-routing"):  # a decoder layer's attention: its `layer_idx` names its cache slot
        assert isinstance(stacks[-1][-1].get_submodule(declared.attention).layer_idx, int)
    if declared.cross_attention:
        assert isinstance(stacks[-1][-1].get_submodule(declared.cross_attention).layer_idx, int)
    base.get_submodule(declared.embeddings)
    if declared.pooler:
        base.get_submodule(declared.pooler)
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads"):
        assert isinstance(declared.config_value(config, name), int), name


def test_a_refusal_names_only_methods_that_exist():
    from hf_taskmoe.backbones import Backbone, FFNSite, register_backbone

    with pytest.raises(ValueError, match=r"`unsupported` of backbone 'toy' names no method: \['moe'\]"):
        register_backbone(Backbone("toy", ENCODER_BACKBONE, "layers", FFNSite("mlp"), unsupported={"moe": "no"}))
    assert "toy" not in backbone_names()


@pytest.mark.parametrize(("arch", "method"), REFUSED, ids=[f"{a}-{m}" for a, m in REFUSED])
def test_a_refused_pair_is_refused_naming_the_architecture_the_method_and_the_reason(arch, method):
    declared = get_backbone(arch)
    reason = declared.unsupported[method]
    message = rf"{METHODS[method][0]} \(\w+\) cannot run on a '{arch}' backbone: {re.escape(reason)}"
    dense = new_dense(arch)
    if declared.kind == ENCODER_BACKBONE:
        model_cls, config_cls, kwargs = ENCODER_METHODS[method]
        with pytest.raises(ValueError, match=message):
            model_cls.from_dense(dense, TASKS, **kwargs)
        with pytest.raises(ValueError, match=message):  # the config alone, as `from_pretrained` builds it
            config_cls(dense_config=NEW_CONFIGS[arch](), tasks=TASKS)
    else:
        with pytest.raises(ValueError, match=message):
            ROUTED[declared.kind][0].from_dense(dense, S2S_TASKS)
    assert not declared.supports(method)


def test_an_unknown_architecture_is_pointed_to_the_backbones_the_method_takes_not_those_it_refuses():
    from transformers import BertConfig

    with pytest.raises(ValueError, match="does not support model_type 'bert'") as info:
        TaskRoutedForCausalLM.config_class(dense_config=BertConfig(), tasks=S2S_TASKS)
    listed = str(info.value)
    assert "'llama'" in listed and "'gemma2'" in listed and "'falcon'" not in listed


# ---------------------------------------------------------------------------------------------- the smoke path
@pytest.mark.parametrize(("arch", "method"), PAIRS, ids=[f"{a}-{m}" for a, m in PAIRS])
def test_smoke(arch, method, tmp_path):
    """`from_dense` computes the dense model; a training step; save / load; greedy generation (an LM)."""
    model, dense = build(arch, method)
    batch = smoke_batch(model, arch)
    got, expected = dense_outputs(model, dense, batch)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    kind = get_backbone(arch).kind
    if kind != ENCODER_BACKBONE:  # greedy decoding with the routed cache: the dense model's tokens
        ids, mask = batch["input_ids"], batch["attention_mask"]
        new = model.generate(ids, attention_mask=mask, task_ids=batch["task_ids"], max_new_tokens=3, do_sample=False)
        assert torch.equal(new, dense.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False))

    model.train()
    loss = model(**batch).loss
    assert torch.isfinite(loss)
    loss.backward()
    new_weights = [p for n, p in model.named_parameters() if n.startswith(("heads.", "router.")) and p.requires_grad]
    assert new_weights and any(p.grad is not None and p.grad.abs().sum() > 0 for p in new_weights)

    model.eval().save_pretrained(tmp_path)
    auto = AutoModel if kind == ENCODER_BACKBONE else ROUTED[kind][1]
    loaded = auto.from_pretrained(tmp_path).eval()
    assert type(loaded) is family_of(model.config.model_type).model_class  # what the model_type loads as
    with torch.no_grad():
        key = "logits" if kind != ENCODER_BACKBONE else "task_logits"
        a, b = getattr(loaded(**batch), key), getattr(model(**batch), key)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------- the generated table
def test_the_table_in_the_docs_is_the_one_the_declarations_generate():
    page = (Path(__file__).parents[1] / "docs" / "backbones.md").read_text()
    start, end = page.index(TABLE_START), page.index(TABLE_END) + len(TABLE_END)
    assert page[start:end] == support_table(), (
        "docs/backbones.md's architecture table differs from the declarations: paste "
        "`python -c 'from hf_taskmoe.backbones.table import support_table; print(support_table())'` over it"
    )


def test_the_table_says_what_the_declarations_say():
    table = support_table()
    for arch in backbone_names():
        declared = get_backbone(arch)
        row = next(line for line in table.splitlines() if line.startswith(f"| `{arch}` |"))
        cells = [c.strip() for c in row.strip("|").split("|")][2:]
        for method, cell in zip(METHODS, cells):
            if declared.supports(method):
                assert cell == "yes", (arch, method)
            elif method in declared.unsupported:
                assert cell.startswith("refused") and declared.unsupported[method] in table
            else:
                assert cell == "-"


# ---------------------------------------------------------------------------------------------- the contract (slow)
def _routed_case(arch: str) -> FamilyCase:
    kind = get_backbone(arch).kind
    model_cls = ROUTED[kind][0]

    def equivalence():
        fresh, dense = build(arch, "task-routing")
        batch = text_batch(fresh, torch.arange(6) % 2)
        return fresh, lambda model: dense_outputs(model, dense, batch)

    return FamilyCase(
        f"task-routing-{arch}", S2S_TASKS,
        lambda tasks: model_cls.from_dense(new_dense(arch), tasks, selection="gumbel_softmax_st"),
        text_batch, TaskSpec(name="w", problem_type="seq2seq"), learns_steps=40, learns_lr=1e-2,
        dense_equivalent=equivalence,
    )


def _contract_cases() -> dict[str, FamilyCase]:
    cases = {}
    for method, (model_cls, config_cls, kwargs) in ENCODER_METHODS.items():
        archs = [a for a, m in PAIRS if m == method]
        config_kwargs = {k: v for k, v in kwargs.items() if k != "conditional_attention_init_std"}
        cases.update(method_cases(method, model_cls, config_cls, archs=archs, config_kwargs=config_kwargs,
                                  from_dense_kwargs=kwargs, learns_steps=30, learns_lr=1e-2))
    cases.update({f"task-routing-{a}": _routed_case(a) for a, m in PAIRS if m == "task-routing"})
    return cases


CASES = _contract_cases()


@pytest.fixture(params=list(CASES), ids=list(CASES))
def case(request):
    return CASES[request.param]


@pytest.mark.slow
class TestEveryNewPair(FamilyContract):
    @pytest.fixture(autouse=True)
    def _case(self, case):
        self.case = case
