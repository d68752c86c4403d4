"""No host sync in the training forward: every read of a device tensor's value by the host (`.tolist()`,
`.item()`, `.cpu()`, `bool(t)`, `nonzero`, `unique`, boolean-mask indexing) stalls a GPU stream. For a batch marked
`values_checked=True` (the Trainer's: its collator checked the batch on the CPU) the library's own code reads back
one thing per eager forward of an encoder family: the per-task row counts that split the batch among the heads (so
an absent task's head gets no gradient rather than a zero one, which AdamW would still act on). PALs run batched
across their groups, the routes of BART's straight-through training are not planned on the host, per-task losses
stay on the device. The sort-and-loop expert dispatch adds one read per MoE layer (its slice sizes); the
grouped-GEMM dispatch none. Under capture (torch.export, ONNX, compile) every head runs on every row: no read.

On CPU nothing stalls, so these tests count the calls that would, wherever they come from in `hf_taskmoe`."""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import hf_taskmoe
from hf_taskmoe import (
    BertForTaskMoE,
    BertPALsConfig,
    BertTaskMoEConfig,
    BertWithPALs,
    CAMTLConfig,
    CAMTLModel,
    TaskSpec,
)
from hf_taskmoe.modeling_utils import BatchChecker

PACKAGE = str(Path(hf_taskmoe.__file__).parent)
SIZES = dict(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
TASKS = [
    TaskSpec(name="a", num_labels=2),
    TaskSpec(name="b", num_labels=3),
    TaskSpec(name="c", problem_type="regression"),
]
FAMILIES = {
    "mt_tag_grouped_mm": (
        lambda: BertForTaskMoE(BertTaskMoEConfig(tasks=TASKS, num_experts=4, expert_dispatch="grouped_mm", **SIZES)),
        1,
    ),
    # the heads' split, and one read per MoE layer (2 layers)
    "mt_tag_sorted_loop": (lambda: BertForTaskMoE(BertTaskMoEConfig(tasks=TASKS, num_experts=4, **SIZES)), 3),
    "pals": (lambda: BertWithPALs(BertPALsConfig(tasks=TASKS, pal_size=8, pal_num_heads=2, **SIZES)), 1),
    "camtl": (lambda: CAMTLModel(CAMTLConfig(tasks=TASKS, conditional_attention_max_length=8, **SIZES)), 1),
}


@contextlib.contextmanager
def host_reads():
    """Record `(file:line)` of every host read of a tensor value made by code of this library."""
    calls: list[str] = []
    patched = []

    def wrap(owner, name):
        original = getattr(owner, name)

        def reading(*args, **kwargs):
            if name == "__getitem__":
                index = args[1] if isinstance(args[1], tuple) else (args[1],)
                if not any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                    return original(*args, **kwargs)
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(PACKAGE):
                calls.append(f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno} {name}")
            return original(*args, **kwargs)

        patched.append((owner, name, original))
        setattr(owner, name, reading)

    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero", "__getitem__",
                 "masked_select"):
        wrap(torch.Tensor, name)
    for name in ("nonzero", "unique", "masked_select"):
        wrap(torch, name)
    try:
        yield calls
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)


def _mixed_batch(padded: bool):
    g = torch.Generator().manual_seed(0)
    task_ids = torch.tensor([0, 1, 2, 0, 1, 2])
    mask = torch.ones(6, 8, dtype=torch.long)
    if padded:
        mask[0, -3:] = 0
    return {"input_ids": torch.randint(3, 60, (6, 8), generator=g), "attention_mask": mask, "task_ids": task_ids,
            "labels": torch.tensor([1.0, 2.0, 0.5, 0.0, 1.0, -1.5])}


def assert_checked_step_reads(model, batch: dict, expected: int) -> None:
    """A training step on `batch`, checked on the host as the Trainer's collator does, reads back `expected` values;
    the same batch not marked as checked (a user calling the model) gets the value checks, more reads."""
    assert BatchChecker.for_model(model)(batch)  # what the Trainer's collator does, on the CPU
    with host_reads() as calls:
        model(**batch, values_checked=True).loss.backward()
    assert len(calls) == expected, Counter(calls)
    with host_reads() as checked_calls:
        model(**batch)
    assert len(checked_calls) > expected


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("padded", [False, True])
def test_training_forward_and_backward_read_nothing_back(family, padded):
    build, expected = FAMILIES[family]
    torch.manual_seed(0)
    assert_checked_step_reads(build().train(), _mixed_batch(padded), expected)


def _seq2seq_family():
    from .test_bart_routed import batch, routed

    return routed("gumbel_softmax_st").train(), batch()


def _tabular_family():
    from hf_taskmoe import MMoEModel

    from .test_mmoe import batch, config

    return MMoEModel(config()).train(), batch()


@pytest.mark.parametrize("family", [_seq2seq_family, _tabular_family], ids=["bart_routed_st", "mmoe"])
def test_seq2seq_and_tabular_training_forward_and_backward_read_nothing_back(family):
    """BartTaskRouted (straight-through training: every expert runs, so its routes are not planned on the host; the
    router routes every task of its table; per-task losses are summed by task on the device) and MMoE."""
    torch.manual_seed(0)
    model, batch = family()
    with host_reads() as calls:
        out = model(**batch, values_checked=True)
        out.loss.backward()
    assert not calls, Counter(calls)
    checked = model(**batch)  # the per-task losses read back the tasks present only when looked at
    assert set(out.task_losses) == set(checked.task_losses)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("task_ids", [[0, 1, 2, 0, 1, 2], [1, 1, 1, 1, 1, 1], [2, 0, 0, 2, 2, 0]],
                         ids=["three_tasks", "one_task", "one_task_absent"])
def test_skipping_the_value_checks_changes_no_number(family, task_ids):
    """A checked batch (no value read back) gives the unchecked forward's loss, per-task losses, logits and
    gradients: an eager forward splits the batch by task either way (every head on every row is for capture)."""
    build, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = build().eval()
    batch = {**_mixed_batch(padded=True), "task_ids": torch.tensor(task_ids)}
    batch["labels"] = torch.where(torch.tensor(task_ids) == 1, batch["labels"].round().clamp(0, 2), batch["labels"])
    batch["labels"] = torch.where(torch.tensor(task_ids) == 0, batch["labels"].round().clamp(0, 1), batch["labels"])
    assert BatchChecker.for_model(model)(batch)
    checked = model(**batch)
    checked.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    unchecked = model(**batch, values_checked=True)
    unchecked.loss.backward()
    torch.testing.assert_close(unchecked.loss, checked.loss)
    assert set(unchecked.task_logits) == set(checked.task_logits) == set(unchecked.task_losses)
    for name, logits in checked.task_logits.items():
        torch.testing.assert_close(unchecked.task_logits[name], logits)
        torch.testing.assert_close(unchecked.task_losses[name], checked.task_losses[name])
    assert (unchecked.logits is None) == (checked.logits is None)
    # the same parameters get a gradient (an absent task's head none: AdamW leaves it alone) and the same values
    assert {n for n, p in model.named_parameters() if p.grad is not None} == set(grads)
    for name, param in model.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(param.grad, grads[name], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("bad, message", [
    ({"task_ids": torch.tensor([0, 1, 2, 0, 1, 7])}, "task id = 7"),
    ({"labels": torch.tensor([1.0, 2.0, 0.5, 0.0, 9.0, -1.5])}, "out-of-range"),
    ({"labels": torch.tensor([1.0, 2.0, float("nan"), 0.0, 1.0, -1.5])}, "finite"),
])
def test_the_host_check_raises_what_forward_would(bad, message):
    model = FAMILIES["pals"][0]()
    batch = {**_mixed_batch(padded=False), **bad}
    with pytest.raises(ValueError, match=message):
        model(**batch)
    with pytest.raises(ValueError, match=message):
        BatchChecker.for_model(model)(batch)


def test_trainer_checks_batches_in_its_collator(tmp_path):
    """A bad label stops the run when its batch is made, with the forward's message, before the model sees it."""
    from datasets import Dataset

    from hf_taskmoe.training import MultiTaskTrainer, MultiTaskTrainingArguments

    model = FAMILIES["camtl"][0]()
    rows = {"input_ids": [[5, 6, 7, 8]] * 4, "attention_mask": [[1, 1, 1, 1]] * 4}
    train = {
        "a": Dataset.from_dict({**rows, "labels": [0, 1, 0, 5]}),
        "b": Dataset.from_dict({**rows, "labels": [0, 1, 2, 1]}),
        "c": Dataset.from_dict({**rows, "labels": [0.5, 1.0, 1.5, 2.0]}),
    }
    args = MultiTaskTrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        task_sampling="round_robin",
    )
    trainer = MultiTaskTrainer(model=model, args=args, train_dataset=train)
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(1))
    with pytest.raises(ValueError, match=r"task 'a'.*out-of-range"):
        trainer.train()
    assert not seen  # the task-a batch was refused before its forward


def test_the_checked_collator_reads_and_writes_through_and_pickles():
    import pickle

    from hf_taskmoe.modeling_utils import HostCheckedCollator
    from hf_taskmoe.training.data import MultiTaskCollator

    inner = MultiTaskCollator(pad_token_id=0)
    checked = HostCheckedCollator(inner, BatchChecker.for_model(FAMILIES["pals"][0]()))
    checked.pad_to_multiple_of = 8
    assert inner.pad_to_multiple_of == 8 and checked.pad_to_multiple_of == 8
    copy = pickle.loads(pickle.dumps(checked))  # a DataLoader worker's copy
    batch = copy(
        [{"input_ids": [5, 6, 7], "task_ids": 0, "labels": 1}, {"input_ids": [5, 6], "task_ids": 2, "labels": 0.5}]
    )
    assert batch["input_ids"].shape == (2, 8)
    with pytest.raises(ValueError, match="out-of-range"):
        copy([{"input_ids": [5, 6, 7], "task_ids": 0, "labels": 4}])
