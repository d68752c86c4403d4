"""No host sync in the training forward: every read of a device tensor's value by the host (`.tolist()`,
`.item()`, `.cpu()`, `bool(t)`, `nonzero`, `unique`, boolean-mask indexing) stalls a GPU stream. A batch the Trainer's
collator checked on the CPU (`BatchChecker.check`) carries `values_checked=True` and its rows per task,
`task_counts`: the forward of every family then reads nothing back. The heads split the batch by the host's counts
(so an absent task's head gets no gradient rather than a zero one, which AdamW would still act on), PALs run batched
across their groups, the routes of BART's straight-through training are not planned on the host, per-task losses
stay on the device. Only the sort-and-loop expert dispatch reads one value per MoE layer (its slice sizes); the
grouped-GEMM dispatch none. A checked batch without `task_counts` reads the per-task row counts back once. Under
capture (torch.export, ONNX, compile) every head runs on every row: no read.

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
from hf_taskmoe.training.batches import BatchChecker

PACKAGE = str(Path(hf_taskmoe.__file__).parent)
SIZES = dict(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
TASKS = [
    TaskSpec(name="a", num_labels=2),
    TaskSpec(name="b", num_labels=3),
    TaskSpec(name="c", problem_type="regression"),
]
FAMILIES = {  # (build, host reads of a training step on a batch the collator checked and counted)
    "mt_tag_grouped_mm": (
        lambda: BertForTaskMoE(BertTaskMoEConfig(tasks=TASKS, num_experts=4,
                                                 experts_implementation="taskmoe_sorted_grouped", **SIZES)),
        0,
    ),
    # one read per MoE layer (2 layers): the sizes of the experts' slices
    "mt_tag_sorted_loop": (lambda: BertForTaskMoE(BertTaskMoEConfig(tasks=TASKS, num_experts=4, **SIZES)), 2),
    "pals": (lambda: BertWithPALs(BertPALsConfig(tasks=TASKS, pal_size=8, pal_num_heads=2, **SIZES)), 0),
    "camtl": (lambda: CAMTLModel(CAMTLConfig(tasks=TASKS, conditional_attention_max_length=8, **SIZES)), 0),
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
    """A training step on `batch`, checked and counted on the host as the Trainer's collator does, reads back
    `expected` values. Without the host's `task_counts` the step reads the heads' split back (one more); the same
    batch not marked as checked (a user calling the model) gets the value checks too, more reads."""
    marks = BatchChecker.for_model(model).check(batch)  # what the Trainer's collator does, on the CPU
    assert marks is not None and set(marks) == {"values_checked", "task_counts"}
    with host_reads() as calls:
        model(**batch, **marks).loss.backward()
    assert len(calls) == expected, Counter(calls)
    with host_reads() as uncounted_calls:
        model(**batch, values_checked=True)
    assert len(uncounted_calls) == expected + 1, Counter(uncounted_calls)
    with host_reads() as checked_calls:
        model(**batch)
    assert len(checked_calls) > expected + 1


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
    marks = BatchChecker.for_model(model).check(batch)
    assert marks["task_counts"] == tuple(torch.bincount(torch.tensor(task_ids), minlength=3).tolist())
    checked = model(**batch)
    checked.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for skipped in (marks, {"values_checked": True}):  # split by the host's counts, or by counts read back
        model.zero_grad(set_to_none=True)
        unchecked = model(**batch, **skipped)
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


@pytest.mark.parametrize("counts, message", [
    ((2, 2, 1), "summing to the batch's 6 rows"),
    ((2, 2), "one row count per task"),
    ((2, 2, 2, 0), "one row count per task"),
    ((3, -1, 4), "non-negative ints"),
    ((2.0, 2, 2), "non-negative ints"),
    (torch.tensor([2, 2, 2]), "tuple of Python ints counted on the host"),
    ("222", "one row count per task"),
])
@pytest.mark.parametrize("values_checked", [True, False])
def test_task_counts_that_cannot_be_the_batchs_are_refused(counts, message, values_checked):
    model = FAMILIES["mt_tag_grouped_mm"][0]()
    with pytest.raises(ValueError, match=message):
        model(**_mixed_batch(padded=False), task_counts=counts, values_checked=values_checked)


def test_task_counts_of_another_batch_are_refused_when_the_forward_counts_itself():
    """Counts of the right size but another mix: a forward that checks the values compares them with `task_ids` (a
    forward of a batch marked `values_checked` trusts them, as it trusts the rest of the host's checks)."""
    model = FAMILIES["camtl"][0]()
    with pytest.raises(ValueError, match=r"`task_counts` says .*'a': 3.* hold .*'a': 2"):
        model(**_mixed_batch(padded=False), task_counts=(3, 2, 1))
    model(**_mixed_batch(padded=False), task_counts=(2, 2, 2))  # the right ones pass


def test_the_collator_counts_tasks_only_for_a_forward_that_splits_by_them():
    """The Trainer's collator adds `task_counts` for the encoder families; not when told not to (what
    `MultiTaskTrainer` does under `nn.DataParallel`, which scatters a batch's rows over devices), nor for a model
    whose forward does not take them (a family without per-task heads, one registered by a user)."""
    from hf_taskmoe import MMoEModel
    from hf_taskmoe.training.batches import HostCheckedCollator, MultiTaskCollator

    from .test_mmoe import config

    features = [{"input_ids": [5, 6, 7], "task_ids": 0, "labels": 1},
                {"input_ids": [5, 6], "task_ids": 2, "labels": 0.5},
                {"input_ids": [7], "task_ids": 2, "labels": 1.5}]
    model = FAMILIES["pals"][0]()
    batch = HostCheckedCollator(MultiTaskCollator(pad_token_id=0), BatchChecker.for_model(model))(features)
    assert batch["values_checked"] is True and batch["task_counts"] == (1, 0, 2)
    with host_reads() as calls:
        model(**batch).loss.backward()
    assert not calls, Counter(calls)
    scattered = HostCheckedCollator(MultiTaskCollator(pad_token_id=0),
                                    BatchChecker.for_model(model, counts_tasks=False))
    assert "task_counts" not in scattered(features) and scattered(features)["values_checked"] is True
    assert not BatchChecker.for_model(MMoEModel(config())).counts_tasks


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


def test_the_trainer_hands_the_forward_its_batches_checked_and_counted(tmp_path):
    """Every training batch reaches the forward with `values_checked=True` and its own rows per task."""
    from datasets import Dataset

    from hf_taskmoe.training import MultiTaskTrainer, MultiTaskTrainingArguments

    model = FAMILIES["mt_tag_grouped_mm"][0]()
    rows = {"input_ids": [[5, 6, 7, 8]] * 6, "attention_mask": [[1, 1, 1, 1]] * 6}
    train = {
        "a": Dataset.from_dict({**rows, "labels": [0, 1, 0, 1, 0, 1]}),
        "b": Dataset.from_dict({**rows, "labels": [0, 1, 2, 1, 0, 2]}),
        "c": Dataset.from_dict({**rows, "labels": [0.5, 1.0, 1.5, 2.0, 0.0, 1.0]}),
    }
    args = MultiTaskTrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4,
                                      use_cpu=True, report_to="none", save_strategy="no", batching="heterogeneous")
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs), with_kwargs=True)
    MultiTaskTrainer(model=model, args=args, train_dataset=train).train()
    assert len(seen) == 4
    for kwargs in seen:
        assert kwargs["values_checked"] is True
        assert kwargs["task_counts"] == tuple(torch.bincount(kwargs["task_ids"], minlength=3).tolist())
    assert any(sum(c > 0 for c in kwargs["task_counts"]) > 1 for kwargs in seen)  # mixed batches among them


def test_the_checked_collator_reads_and_writes_through_and_pickles():
    import pickle

    from hf_taskmoe.training.batches import HostCheckedCollator, MultiTaskCollator

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
