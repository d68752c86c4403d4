"""Issue 45, item 1 ("equivalence first"): before the BERT-specific classes are folded into the backbone-generic ones,
each pair is shown to compute the same thing on the same weights (a key map from one state dict to the other), to
1e-6, in evaluation (last hidden states, each task's logits and loss) and in a training step (loss, per-task losses
and every mapped parameter's gradient; dropout 0), on a padded batch that mixes three tasks.

- `BertForTaskMoE` vs `TaskMoEForMultiTask` on BERT: MT-TaG (task gates) and MT-Switch (shared gate), both expert
  dispatches, top-1 and top-2, both expert weightings, router losses, MoE in some layers only, MT-Dense
  (`num_experts=1`, where the generic model keeps BERT's own FFN); also the routing outputs. `BertForTaskMoE` is now
  the generic class under its old name, configured by flat BERT fields: these cases check that translation (sizes,
  pooling, every MoE option); what the BERT-only implementation computed is kept by its saved outputs
  (`test_mttag_equivalence.py`).
- CA-MTL: `CAMTLModel` (now a thin name over `CAMTLForMultiTask`) against what the BERT-layer `CAMTLModel` computed
  before it was deleted (`tests/fixtures/camtl_reference/`):
  BASE and LARGE bottlenecks, with and without conditional attention, alignment and layer norm, frozen or trainable
  bottom layers, and BASE with the FFN's output dropout at p=1 (both add the bottleneck outside that dropout).
- `BertWithPALs` vs `PALsForMultiTask`: every pooling, both PAL dispatches, shared PAL groups, PALs in some layers
  only, with every task in the batch and with one absent. These passed against the BERT-specific `BertWithPALs`
  before it was folded into `PALsForMultiTask` (commit b859d0a); the class is now `PALsForMultiTask` with a BERT
  default, so they check that its flat BERT config builds the same model, and the old implementation's own numbers
  are kept in `tests/fixtures/pals_reference/`: logits and a training step's gradients (`test_pals_equivalence.py`).
- `BartTaskRouted` (no generic BART routed class exists yet): with hard routes, a row of task `t` computes what the
  dense BART made of task `t`'s chosen experts computes -- logits, losses and, in a training step with
  straight-through Gumbel routes, the gradient of every expert and shared weight. The reference a generic BART
  routed class must also match.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import BartForConditionalGeneration

from hf_taskmoe import (
    BertForTaskMoE,
    BertPALsConfig,
    BertTaskMoEConfig,
    BertWithPALs,
    CAMTLConfig,
    CAMTLModel,
    PALsConfig,
    PALsForMultiTask,
    TaskMoEConfig,
    TaskMoEForMultiTask,
    TaskSpec,
)

from .backbone_matrix import labelled_batch
from .equivalence import (
    PALS_KEYS,
    assert_same_eval,
    assert_same_training_step,
    close,
    load_mapped,
    perturb,
    renamed,
)
from .test_bart_routed import TASKS as SEQ2SEQ_TASKS
from .test_bart_routed import batch as seq2seq_batch
from .test_bart_routed import routed

TASKS = [TaskSpec(name="a", num_labels=3), TaskSpec(name="b", problem_type="regression"),
         TaskSpec(name="c", num_labels=2)]
# hidden and intermediate sizes divisible by 8: `experts_implementation="grouped_mm"` needs them
DENSE = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
MIXED = torch.tensor([0, 1, 2, 1, 0, 2])  # the first row is padded (`labelled_batch`)


def bert_config():
    return transformers.BertConfig(**DENSE)


def pair(reference_cls, reference_config_cls, model_cls, config_cls, keys, pooling="pooler", may_miss=None,
         **kwargs):
    """A perturbed BERT-specific model and the generic one carrying its weights (`keys`), plus the name map."""
    torch.manual_seed(0)
    reference = reference_cls(reference_config_cls(**DENSE, tasks=[t.to_dict() for t in TASKS],
                                                   classifier_pooling=pooling, **kwargs))
    perturb(reference)
    model = model_cls(config_cls(dense_config=bert_config(), tasks=TASKS, classifier_pooling=pooling, **kwargs))
    return reference, model, load_mapped(model, reference, keys, may_miss)


# ---------------------------------------------------------------------- MT-TaG
#: `BertForTaskMoE` and `TaskMoEForMultiTask` have the same names: no renaming
MOE_KEYS = []
MOE_CASES = {
    "mt-tag-top1-sorted": dict(num_experts=4),
    "mt-tag-top1-grouped": dict(num_experts=4, experts_implementation="grouped_mm"),
    "mt-switch-top1-sorted": dict(num_experts=4, gating="shared"),
    "mt-switch-top1-grouped": dict(num_experts=4, gating="shared", experts_implementation="grouped_mm"),
    "mt-tag-top2-sorted": dict(num_experts=4, top_k=2),
    "mt-tag-top2-grouped-gate": dict(num_experts=4, top_k=2, experts_implementation="grouped_mm",
                                     expert_weighting="gate"),
    "mt-tag-router-losses": dict(num_experts=3, router_aux_loss_coef=0.05, router_z_loss_coef=0.01),
    "mt-tag-moe-layer-1-only-cls": dict(num_experts=4, moe_layers=[1], pooling="cls"),
    "mt-dense-mean": dict(num_experts=1, pooling="mean"),
    "mt-dense-grouped": dict(num_experts=1, experts_implementation="grouped_mm"),
}
ROUTING_FIELDS = ("router_logits", "expert_indices", "routing_counts")


def moe_pair(kwargs):
    return pair(BertForTaskMoE, BertTaskMoEConfig, TaskMoEForMultiTask, TaskMoEConfig, MOE_KEYS, **kwargs)


@pytest.mark.parametrize("kwargs", list(MOE_CASES.values()), ids=list(MOE_CASES))
def test_task_moe_for_multi_task_on_bert_computes_bert_for_task_moe(kwargs):
    reference, model, names = moe_pair(kwargs)
    batch = labelled_batch(model, MIXED)
    routes = kwargs["num_experts"] > 1
    fields = ROUTING_FIELDS if routes else ()
    if kwargs.get("router_aux_loss_coef"):
        fields += ("aux_loss", "z_loss")
    assert_same_eval(reference, model, {**batch, "output_router_logits": routes}, fields)
    assert_same_training_step(reference, model, batch, names)
    if routes:  # the gates route tokens of one batch to more than one expert: the experts' differences count
        with torch.no_grad():
            chosen = model.eval()(**batch, output_router_logits=True).expert_indices
        assert all(len(layer.unique()) > 1 for layer in chosen)


# ---------------------------------------------------------------------- CA-MTL
#: what the BERT-layer `CAMTLModel` computed before it became a thin name over `CAMTLForMultiTask`
#: (`tests/fixtures/make_camtl_reference.py`, not rerun here): per case its weights (its own names), a batch, its
#: evaluation outputs and one training step
CAMTL_REFERENCE = Path(__file__).parent / "fixtures" / "camtl_reference"
CAMTL_CASES = sorted(p.stem for p in CAMTL_REFERENCE.glob("*.safetensors"))
#: the BERT-layer class's weight names -> today's (regex -> replacement, applied in turn): its encoder was `bert.`, with
#: the task embeddings, the alignment and LARGE's skip connection inside it
CAMTL_KEYS = {
    r"^bert\.task_embeddings\.": "task_embeddings.",
    r"^bert\.alignment\.": "alignment.",
    r"^bert\.encoder\.skip\.": "skip.",
    r"^bert\.": "backbone.",
}


def camtl_reference(case: str):
    """`CAMTLModel` built from the config the BERT-layer class had (flat BERT fields, and the block count
    `N = max(1, d // L)` it was built with) and carrying its weights (renamed by `CAMTL_KEYS`); the reference
    tensors; the name map; the frozen names."""
    path = CAMTL_REFERENCE / f"{case}.safetensors"
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    tensors = load_file(path)
    config = json.loads(meta["config"])
    config.setdefault("conditional_attention_blocks",
                      max(1, config["hidden_size"] // config["conditional_attention_max_length"]))
    model = CAMTLModel(CAMTLConfig.from_dict(config))
    keys = list(CAMTL_KEYS.items())
    weights = {k[len("weight."):]: v for k, v in tensors.items() if k.startswith("weight.")}
    names = {name: renamed(name, keys) for name in weights}
    missing, unexpected = model.load_state_dict({names[k]: v for k, v in weights.items()}, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    if float(meta["ffn_dropout"]):
        model.backbone.encoder.layer[-1].output.dropout.p = 1.0
    batch = {k[len("input."):]: v for k, v in tensors.items() if k.startswith("input.")}
    return model, batch, tensors, names, set(json.loads(meta["frozen"]))


def assert_computes_the_reference(model, batch, tensors, names, frozen) -> None:
    """Evaluation (last hidden states, each task's logits and loss, the loss) and one training step (the loss, each
    task's loss, every parameter's `requires_grad` and gradient) as the reference, to 1e-6."""
    model.eval()
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
    close(out.hidden_states[-1], tensors["eval.last_hidden_state"], "last hidden states")
    assert set(out.task_logits) == {k[len("eval.logits."):] for k in tensors if k.startswith("eval.logits.")}
    for task, logits in out.task_logits.items():
        close(logits, tensors[f"eval.logits.{task}"], f"logits of {task!r}")
        close(out.task_losses[task], tensors[f"eval.loss.{task}"], f"loss of {task!r}")
    close(out.loss, tensors["eval.loss"], "loss")
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    close(out.loss, tensors["train.loss"], "training loss")
    for task, loss in out.task_losses.items():
        close(loss, tensors[f"train.loss.{task}"], f"training loss of {task!r}")
    out.loss.backward()
    params = dict(model.named_parameters())
    assert len(set(names.values())) == len(names), "two reference weights land on one weight of the model"
    assert {n for n in names.values() if n in params} == set(params), "parameters not one to one"
    moved = 0
    for name, new_name in names.items():
        if new_name not in params:  # a buffer
            continue
        param = params[new_name]
        assert param.requires_grad == (name not in frozen), f"{name}: requires_grad differs"
        expected = tensors.get(f"grad.{name}")
        if expected is None or param.grad is None:  # frozen, or a head without rows in this batch
            assert _zero(expected) and _zero(param.grad), name
            continue
        close(param.grad, expected, f"gradient of {name}")
        moved += bool(expected.abs().sum() > 0)
    assert moved, "no gradient reached any parameter"


def _zero(grad) -> bool:
    return grad is None or not grad.abs().sum()


@pytest.mark.parametrize("case", CAMTL_CASES)
def test_camtl_computes_what_the_bert_layer_implementation_computed(case):
    """BASE (also with the FFN's output dropout at p=1: the bottleneck is added outside that dropout,
    `LN(dropout(FFN(a)) + a + CFF(a))`, as in the authors' code) and LARGE bottlenecks, components switched off,
    the three poolings, nothing frozen."""
    assert_computes_the_reference(*camtl_reference(case))


def test_the_reference_cases_are_there():
    assert len(CAMTL_CASES) == 6 and "base-ffn-dropout-1" in CAMTL_CASES


def test_the_comparison_sees_a_conditional_weight_that_differs():
    """The control: one FiLM row moved (a conditional layer norm of the top layer), and the comparison fails -- the
    perturbed conditional modules are live, not at their neutral start."""
    model, batch, tensors, names, frozen = camtl_reference("base")
    with torch.no_grad():
        model.backbone.encoder.layer[1].output.LayerNorm.film.bias[0] += 0.05
    with pytest.raises(AssertionError, match="hidden states"):
        assert_computes_the_reference(model, batch, tensors, names, frozen)


# ---------------------------------------------------------------------- PALs
PALS_CASES = {
    "cls": {},
    "pooler-per-group": dict(pooling="pooler", pal_dispatch="per_group"),
    "mean-batched": dict(pooling="mean", pal_dispatch="batched"),
    "shared-group-layer-1-only": dict(pal_task_groups=[["a", "c"]], pal_layers=[1]),
    "decoder-init-normal-pal-dropout-0": dict(pal_decoder_init="normal", pal_attention_dropout=0.0),
}


@pytest.mark.parametrize("kwargs", list(PALS_CASES.values()), ids=list(PALS_CASES))
@pytest.mark.parametrize("rows", ["mixed", "task-b-absent"])
def test_pals_for_multi_task_on_bert_computes_bert_with_pals(kwargs, rows):
    """Evaluation and one training step; with task `b` absent its head and (but where it shares them) its PALs
    get no gradient in either."""
    kwargs = {"pooling": "cls", **kwargs}
    reference, model, names = pair(BertWithPALs, BertPALsConfig, PALsForMultiTask, PALsConfig, PALS_KEYS,
                                   may_miss=r"^backbone\..*position", pal_size=8, pal_num_heads=2, **kwargs)
    ids = MIXED if rows == "mixed" else torch.tensor([0, 2, 2, 0])
    batch = labelled_batch(model, ids)
    assert_same_eval(reference, model, batch)
    assert_same_training_step(reference, model, batch, names)


# ---------------------------------------------------------------------- BART, task-level routing
_EXPERT = re.compile(r"^backbone\.model\.(encoder|decoder)\.layers\.(\d+)\.experts\.(\d+)\.(.+)$")


def chosen_experts(model, route: torch.Tensor) -> dict[tuple[str, int], int]:
    """`(stack, layer) -> expert` of one task's hard route `(routed layers, experts)` (a plain layer: expert 0)."""
    out = {}
    for stack in ("encoder", "decoder"):
        for i, layer in enumerate(getattr(model.backbone.model, stack).layers):
            out[stack, i] = 0 if layer.route_index is None else int(route[layer.route_index].argmax())
    return out


def dense_of_route(model, route: torch.Tensor) -> tuple[BartForConditionalGeneration, dict[str, str]]:
    """The dense BART whose every layer is the expert `route` chooses there, and the map routed parameter name ->
    its name in that BART (the other experts and the router have none)."""
    choice = chosen_experts(model, route)
    names = {}
    for name, _ in model.named_parameters():
        match = _EXPERT.match(name)
        if match is None:
            if not name.startswith("router."):
                names[name] = name.removeprefix("backbone.")
        elif choice[match[1], int(match[2])] == int(match[3]):
            names[name] = f"model.{match[1]}.layers.{match[2]}.{match[4]}"
    state = model.state_dict()
    config = transformers.BartConfig.from_dict(model.config.dense_config.to_dict())
    torch.manual_seed(0)
    dense = BartForConditionalGeneration(config)
    wanted = {**{target: state[source] for source, target in names.items()},
              "final_logits_bias": state["backbone.final_logits_bias"]}
    missing, unexpected = dense.load_state_dict(wanted, strict=False)
    tied = {"model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight"}
    assert not unexpected and set(missing) <= tied, (missing, unexpected)
    return dense, names


def _rows(batch, rows):
    return {k: batch[k][rows] for k in ("input_ids", "attention_mask", "labels")}


def test_bart_task_routed_hard_routes_compute_the_dense_bart_of_each_tasks_experts():
    """Evaluation (arg-max routes): each task's rows of a mixed, padded batch get the logits and loss of the dense
    BART made of that task's experts; the tasks take different routes, so the experts' differences count."""
    model = routed("gumbel_softmax_st")  # distinct experts (moved apart), dropout 0
    routes = model.task_routing()  # (tasks, routed layers, experts), one-hot
    assert len({tuple(r.argmax(-1).tolist()) for r in routes}) == len(SEQ2SEQ_TASKS)
    b = seq2seq_batch()
    with torch.no_grad():
        out = model(**b)
        for t, spec in enumerate(SEQ2SEQ_TASKS):
            rows = b["task_ids"] == t
            dense, _ = dense_of_route(model, routes[t])
            expected = dense.eval()(**_rows(b, rows))
            close(out.logits[rows], expected.logits, f"logits of {spec.name!r}")
            close(out.task_losses[spec.name], expected.loss, f"loss of {spec.name!r}")


def test_bart_task_routed_training_step_with_hard_routes_is_the_dense_barts_step():
    """Training (straight-through Gumbel: hard 0/1 values, sampled per task): the loss is the token-weighted sum of
    the per-task dense BARTs' losses, and every expert's gradient is the sum of the gradients its layer receives in
    the dense BARTs of the tasks that chose it (zero for an expert no task chose); shared weights likewise."""
    model = routed("gumbel_softmax_st").train()
    b = seq2seq_batch()
    torch.manual_seed(3)
    out = model(**b, output_router_logits=True)
    decisions = out.routing_decisions.detach()  # (batch, routed layers, experts)
    close(decisions, torch.nn.functional.one_hot(decisions.argmax(-1), decisions.shape[-1]).float(), "hard routes")
    tokens = (b["labels"] != -100).sum()
    total = 0.0
    grads: dict[str, torch.Tensor] = {}
    for t, spec in enumerate(SEQ2SEQ_TASKS):
        rows = b["task_ids"] == t
        dense, names = dense_of_route(model, decisions[rows][0])
        expected = dense.train()(**_rows(b, rows))
        close(out.task_losses[spec.name], expected.loss, f"training loss of {spec.name!r}")
        weighted = expected.loss * (b["labels"][rows] != -100).sum() / tokens
        weighted.backward()
        total = total + weighted.detach()
        params = dict(dense.named_parameters())
        for source, target in names.items():
            grad = params[target].grad
            grads[source] = grads.get(source, 0) + (grad if grad is not None else 0)
    close(out.loss, total, "training loss")
    out.loss.backward()
    for name, param in model.named_parameters():
        if name.startswith("router."):
            assert param.grad is not None and param.grad.abs().sum() > 0, name  # straight-through reaches it
        elif name in grads and torch.is_tensor(grads[name]):
            close(param.grad, grads[name], f"gradient of {name}")
        else:  # an expert no task of the batch chose
            assert param.grad is None or not param.grad.abs().sum(), name
