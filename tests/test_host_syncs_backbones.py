"""No host sync in the training forward of the backbone-generic families (issue 34 item 2, for the families of
issue 33): MT-TaG (grouped GEMM and sorted loop), PALs and CA-MTL on RoBERTa, DistilBERT and ModernBERT, and task
routing on a causal LM and on T5. A batch the Trainer's collator checked and counted (`values_checked=True`,
`task_counts`) reads back what the BERT classes read (`tests/test_host_syncs.py`): nothing, but one slice count per MoE
layer for the sorted loop; the task-routed models nothing either. An unchecked batch gets the value checks."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from hf_taskmoe import (
    CAMTLBackboneConfig,
    CAMTLForMultiTask,
    PALsConfig,
    PALsForMultiTask,
    TaskMoEConfig,
    TaskMoEForMultiTask,
)

from .backbone_matrix import TASKS, dense_config, labelled_batch
from .test_host_syncs import assert_checked_step_reads, host_reads

ARCHS = ["roberta", "distilbert", "modernbert"]
DENSE_LAYERS = 2  # every tiny dense model of the matrix has two layers, each an MoE layer
METHODS = {
    # (build, host reads of a checked and counted training step): one per MoE layer for the sorted loop, else none
    "mt_tag_grouped_mm": (lambda arch: TaskMoEForMultiTask(TaskMoEConfig(
        dense_config=dense_config(arch), tasks=TASKS, num_experts=4,
        experts_implementation="taskmoe_sorted_grouped")), 0),
    "mt_tag_sorted_loop": (lambda arch: TaskMoEForMultiTask(TaskMoEConfig(
        dense_config=dense_config(arch), tasks=TASKS, num_experts=4)), DENSE_LAYERS),
    "pals": (lambda arch: PALsForMultiTask(PALsConfig(
        dense_config=dense_config(arch), tasks=TASKS, pal_size=8, pal_num_heads=2)), 0),
    "camtl": (lambda arch: CAMTLForMultiTask(CAMTLBackboneConfig(
        dense_config=dense_config(arch), tasks=TASKS, conditional_attention_max_length=16)), 0),
}
#: grouped GEMM stacks two plain projections: DistilBERT and ModernBERT keep whole FFN modules (refused by name)
CASES = [(m, a) for m in METHODS for a in ARCHS if not (m == "mt_tag_grouped_mm" and a != "roberta")]


@pytest.mark.parametrize("method, arch", CASES, ids=[f"{m}-{a}" for m, a in CASES])
def test_encoder_training_step_reads_back_nothing_but_the_loops_slices(method, arch):
    build, expected = METHODS[method]
    torch.manual_seed(0)
    model = build(arch).train()
    assert_checked_step_reads(model, labelled_batch(model, torch.tensor([0, 1, 0, 1, 1, 0])), expected)


def _causal_lm():
    from .test_task_routed_lm import MIXED, lm_batch, routed

    model = routed("llama", selection="gumbel_softmax_st")
    return model, lm_batch(model, MIXED)


def _t5():
    from hf_taskmoe.compat import T5_BLOCK_RETURNS_BIASES

    if not T5_BLOCK_RETURNS_BIASES:
        pytest.skip("this transformers' T5 block is refused by TaskRoutedForSeq2SeqLM (compat.T5_BLOCK_RETURNS_BIASES)")
    from .test_task_routed_t5 import MIXED, routed, s2s_batch

    model = routed("t5", selection="gumbel_softmax_st")
    return model, s2s_batch(model, MIXED)


@pytest.mark.parametrize("family", [_causal_lm, _t5], ids=["task_routed_llama", "task_routed_t5"])
def test_task_routed_training_step_reads_nothing_back(family):
    """Every expert runs on every row and the decisions mix them: nothing about the routes is read back."""
    torch.manual_seed(0)
    model, batch = family()
    model.train()
    with host_reads() as calls:
        model(**batch, values_checked=True).loss.backward()
    assert not calls, Counter(calls)
