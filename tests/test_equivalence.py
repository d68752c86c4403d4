"""Issue 45, item 1 ("equivalence first"): before the BERT-specific classes are folded into the backbone-generic ones,
each pair is shown to compute the same thing on the same weights (a key map from one state dict to the other), to
1e-6, in evaluation (last hidden states, each task's logits and loss) and in a training step (loss, per-task losses
and every mapped parameter's gradient; dropout 0), on a padded batch that mixes three tasks.

- `BertForTaskMoE` vs `TaskMoEForMultiTask` on BERT: MT-TaG (task gates) and MT-Switch (shared gate), both expert
  dispatches, top-1 and top-2, both expert weightings, router losses, MoE in some layers only, MT-Dense
  (`num_experts=1`, where the generic model keeps BERT's own FFN); also the routing outputs.
- `CAMTLModel` vs `CAMTLForMultiTask` on BERT: BASE and LARGE bottlenecks, with and without conditional attention,
  alignment and layer norm, frozen or trainable bottom layers. Where they differ (the BASE bottleneck relative to the
  FFN's dropout) the test is a strict xfail that says so.
- `BertWithPALs` vs `PALsForMultiTask`: the training step (the evaluation is in `test_backbones_pals.py`).
- `BartTaskRouted` (no generic BART routed class exists yet): with hard routes, a row of task `t` computes what the
  dense BART made of task `t`'s chosen experts computes -- logits, losses and, in a training step with
  straight-through Gumbel routes, the gradient of every expert and shared weight. The reference a generic BART
  routed class must also match.
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from transformers import BartForConditionalGeneration

from hf_taskmoe import (
    BertPALsConfig,
    BertTaskMoEConfig,
    BertWithPALs,
    CAMTLBackboneConfig,
    CAMTLConfig,
    CAMTLForMultiTask,
    CAMTLModel,
    PALsConfig,
    PALsForMultiTask,
    TaskMoEConfig,
    TaskMoEForMultiTask,
    TaskSpec,
)

from .backbone_matrix import labelled_batch
from .equivalence import PALS_KEYS, assert_same_eval, assert_same_training_step, close, load_mapped, perturb
from .test_bart_routed import TASKS as SEQ2SEQ_TASKS
from .test_bart_routed import batch as seq2seq_batch
from .test_bart_routed import routed

TASKS = [TaskSpec(name="a", num_labels=3), TaskSpec(name="b", problem_type="regression"),
         TaskSpec(name="c", num_labels=2)]
# hidden and intermediate sizes divisible by 8: `expert_dispatch="grouped_mm"` needs them
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
#: `BertForTaskMoE` -> `TaskMoEForMultiTask`: BERT's modules under `backbone.`; the MoE (`mlp`) in the place of
#: `intermediate`, whose output projection is an identity, so `ffn_norm` is `output.LayerNorm`; a dense layer (one
#: expert) keeps BERT's own `intermediate.dense` / `output.dense` in the generic model
MOE_KEYS = [
    (r"\.mlp\.experts\.0\.w_in\.", ".intermediate.dense."),
    (r"\.mlp\.experts\.0\.w_out\.", ".output.dense."),
    (r"^bert\.", "backbone."),
    (r"\.mlp\.", ".intermediate."),
    (r"\.ffn_norm\.", ".output.LayerNorm."),
]
MOE_CASES = {
    "mt-tag-top1-sorted": dict(num_experts=4),
    "mt-tag-top1-grouped": dict(num_experts=4, expert_dispatch="grouped_mm"),
    "mt-switch-top1-sorted": dict(num_experts=4, gating="shared"),
    "mt-switch-top1-grouped": dict(num_experts=4, gating="shared", expert_dispatch="grouped_mm"),
    "mt-tag-top2-sorted": dict(num_experts=4, top_k=2),
    "mt-tag-top2-grouped-gate": dict(num_experts=4, top_k=2, expert_dispatch="grouped_mm", expert_weighting="gate"),
    "mt-tag-router-losses": dict(num_experts=3, router_aux_loss_coef=0.05, router_z_loss_coef=0.01),
    "mt-tag-moe-layer-1-only-cls": dict(num_experts=4, moe_layers=[1], pooling="cls"),
    "mt-dense-mean": dict(num_experts=1, pooling="mean"),
    "mt-dense-grouped": dict(num_experts=1, expert_dispatch="grouped_mm"),
}
ROUTING_FIELDS = ("router_logits", "expert_indices", "routing_counts")


def moe_pair(kwargs):
    from hf_taskmoe import BertForTaskMoE

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
#: `CAMTLModel` -> `CAMTLForMultiTask`: the task embeddings, the alignment and LARGE's skip connection move out of
#: the encoder to the model; BERT's layers (with their CLNs, attention bias and BASE bottleneck, attached under the
#: same names) under `backbone.`
CAMTL_KEYS = [
    (r"^bert\.task_embeddings\.", "task_embeddings."),
    (r"^bert\.alignment\.", "alignment."),
    (r"^bert\.encoder\.skip\.", "skip."),
    (r"^bert\.", "backbone."),
]
CAMTL_CASES = {
    "base": {},
    "large": dict(conditional_bottleneck="large"),
    "base-no-conditional-attention": dict(conditional_attention=False),
    "no-alignment-no-bottleneck-cls": dict(conditional_alignment=False, conditional_bottleneck="none",
                                           pooling="cls"),
    "plain-layer-norms-mean": dict(conditional_layer_norm=False, pooling="mean"),
    "nothing-frozen-every-layer-conditional": dict(num_frozen_layers=0, freeze_embeddings=False,
                                                   conditional_layers=[0, 1], bottleneck_layers=[0, 1]),
}


def camtl_pair(kwargs):
    return pair(CAMTLModel, CAMTLConfig, CAMTLForMultiTask, CAMTLBackboneConfig, CAMTL_KEYS,
                conditional_attention_max_length=16, **kwargs)


@pytest.mark.parametrize("kwargs", list(CAMTL_CASES.values()), ids=list(CAMTL_CASES))
def test_camtl_for_multi_task_on_bert_computes_camtl_model(kwargs):
    reference, model, names = camtl_pair(kwargs)
    assert_same_training_step(reference, model, labelled_batch(model, MIXED), names)
    assert_same_eval(reference, model, labelled_batch(model, MIXED))


def test_the_comparison_sees_a_conditional_weight_that_differs():
    """The control: one FiLM row moved in the generic model (a conditional layer norm of the top layer), and the
    comparison fails -- the perturbed conditional modules are live, not at their neutral start."""
    reference, model, _ = camtl_pair({})
    with torch.no_grad():
        model.backbone.encoder.layer[1].output.LayerNorm.film.bias[0] += 0.05
    with pytest.raises(AssertionError, match="hidden states"):
        assert_same_eval(reference, model, labelled_batch(model, MIXED))


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "BASE bottleneck vs the FFN's dropout: CAMTLModel adds the bottleneck to the residual, "
    "LN(dropout(FFN(a)) + a + CFF(a)) (CAMTLLayer.forward); CAMTLForMultiTask adds it to the FFN's output projection "
    "(TaskBottleneck.add_to_projection, a hook on output.dense), LN(dropout(FFN(a) + CFF(a)) + a): the bottleneck "
    "goes through BertOutput's dropout. Equal with dropout 0 (the tests above); in training with "
    "hidden_dropout_prob > 0 the two drop different things."))
def test_camtl_base_bottleneck_sits_outside_the_ffn_dropout_in_both():
    """Made deterministic: the top layer's FFN output dropout at p=1 drops the whole FFN output, so what is left
    shows where each implementation adds the bottleneck."""
    reference, model, _ = camtl_pair({})
    reference.bert.encoder.layer[1].output.dropout.p = 1.0
    model.backbone.encoder.layer[1].output.dropout.p = 1.0
    reference.train(), model.train()
    batch = labelled_batch(model, MIXED)
    close(model(**batch).loss, reference(**batch).loss, "training loss with the FFN output dropped")


# ---------------------------------------------------------------------- PALs
def test_pals_for_multi_task_on_bert_takes_the_training_step_of_bert_with_pals():
    sizes = dict(pal_size=8, pal_num_heads=2)
    torch.manual_seed(0)
    reference = perturb(BertWithPALs(BertPALsConfig(**DENSE, tasks=[t.to_dict() for t in TASKS],
                                                    classifier_pooling="cls", **sizes)))
    model = PALsForMultiTask(PALsConfig(dense_config=bert_config(), tasks=TASKS, **sizes))
    names = load_mapped(model, reference, PALS_KEYS, may_miss=r"^backbone\..*position")
    batch = labelled_batch(model, MIXED)
    assert_same_training_step(reference, model, batch, names)
    assert_same_eval(reference, model, batch)


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
