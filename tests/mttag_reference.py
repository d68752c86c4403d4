"""The tiny MT-TaG models, batch and deterministic weights of `tests/test_mttag_equivalence.py`, shared with the
script that recorded their outputs (`tests/fixtures/make_mttag_reference.py`).

Weights are drawn per parameter from a generator seeded by the parameter's name (its current name: the experts'
stacked weights are `up_proj`, `up_proj_bias`, `down_proj`, `down_proj_bias`), so they do not depend on the order in
which a model builds its modules, nor on the random draws of its `__init__`."""

from __future__ import annotations

import zlib

import torch
import transformers

from hf_taskmoe import TaskMoEConfig, TaskMoEForMultiTask, TaskSpec

TASKS = [TaskSpec(name="a", num_labels=3), TaskSpec(name="b", problem_type="regression"),
         TaskSpec(name="c", num_labels=2)]
# widths divisible by 8 (grouped GEMMs take 16-byte aligned strides); dropout off: a training step is deterministic
DENSE = dict(vocab_size=40, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16,
             max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
#: MT-TaG (task gates), MT-Switch (one shared gate) and MT-Dense, top-1 and top-2, both expert weightings
CASES = {
    "task-top1-straight_through": dict(num_experts=4),
    "task-top1-gate": dict(num_experts=4, expert_weighting="gate"),
    "task-top2-straight_through-losses": dict(num_experts=4, top_k=2, router_aux_loss_coef=0.05,
                                              router_z_loss_coef=0.01),
    "task-top2-gate": dict(num_experts=4, top_k=2, expert_weighting="gate"),
    "shared-top1-straight_through-layer1": dict(num_experts=3, gating="shared", moe_layers=[1]),
    "shared-top1-gate": dict(num_experts=3, gating="shared", expert_weighting="gate"),
    "shared-top2-gate": dict(num_experts=3, gating="shared", top_k=2, expert_weighting="gate"),
    "shared-top2-straight_through": dict(num_experts=3, gating="shared", top_k=2),
    "dense": dict(num_experts=1),
}
TASK_IDS = torch.tensor([0, 1, 2, 1, 0, 2])  # a batch mixing the three tasks
SEQ = 7


def draw(name: str, shape, g: torch.Generator) -> torch.Tensor:
    """A parameter's values: layer norms near the identity (so the tokens, not the norms' biases, steer the gates),
    everything else N(0, 0.5)."""
    noise = torch.randn(shape, generator=g)
    if "LayerNorm" in name:
        return (1.0 if name.endswith("weight") else 0.0) + 0.1 * noise
    return 0.5 * noise


def model(case: str, **kwargs) -> TaskMoEForMultiTask:
    config = TaskMoEConfig(dense_config=transformers.BertConfig(**DENSE), tasks=TASKS, **CASES[case], **kwargs)
    model = TaskMoEForMultiTask(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            parameter.copy_(draw(name, parameter.shape, g))
    return model


def batch() -> dict:
    g = torch.Generator().manual_seed(0)
    rows = len(TASK_IDS)
    input_ids = torch.randint(1, DENSE["vocab_size"], (rows, SEQ), generator=g)
    attention_mask = torch.ones(rows, SEQ, dtype=torch.long)
    attention_mask[0, -3:] = 0  # a padded row
    labels = torch.tensor([float(torch.randint(0, TASKS[t].num_labels, (1,), generator=g))
                           if TASKS[t].problem_type != "regression" else float(torch.randn(1, generator=g))
                           for t in TASK_IDS.tolist()])
    return dict(input_ids=input_ids, attention_mask=attention_mask, task_ids=TASK_IDS, labels=labels)


def training_step(model: TaskMoEForMultiTask) -> dict[str, torch.Tensor]:
    """One forward and backward: the loss, each task's logits, every parameter's gradient (by name)."""
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(**batch())
    out.loss.backward()
    results = {"loss": out.loss.detach()}
    results |= {f"logits.{task}": logits.detach() for task, logits in out.task_logits.items()}
    results |= {f"grad.{name}": p.grad for name, p in model.named_parameters() if p.grad is not None}
    return results
