import math

import pytest
import torch
from torch.nn import functional as F

from hf_taskmoe import TaskSpec
from hf_taskmoe.layers.heads import MultiTaskHeads

from .conftest import ALL_KINDS

H, S = 8, 6


def _heads(tasks=ALL_KINDS, scale=False):
    torch.manual_seed(0)
    heads = MultiTaskHeads(tasks, hidden_size=H, dropout=0.0, scale_loss_by_num_classes=scale).eval()
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return heads


def _run(heads, task_ids, labels=None, spans=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randn(len(task_ids), S, H, generator=g)
    pooled = torch.randn(len(task_ids), H, generator=g)
    task_ids = torch.tensor(task_ids)
    rows = heads.split_rows(task_ids)
    prepared = heads.check_inputs(rows, S, labels, spans)
    return heads(seq, pooled, rows, prepared if labels is not None else None, spans), seq, pooled


def test_classification_and_regression_losses_match_formulas():
    heads = _heads(ALL_KINDS[:3])  # sst2 (2 classes), mnli (3 classes), stsb (regression)
    task_ids = [0, 1, 2, 1, 0, 2]
    labels = torch.tensor([1.0, 2.0, 0.7, 0.0, 0.0, -1.2])
    out, seq, pooled = _run(heads, task_ids, labels)
    sst = heads["sst2"].classifier(pooled[[0, 4]])
    mnli = heads["mnli"].classifier(pooled[[1, 3]])
    sts = heads["stsb"].regressor(pooled[[2, 5]])
    expected = {
        "sst2": F.cross_entropy(sst, torch.tensor([1, 0])),
        "mnli": F.cross_entropy(mnli, torch.tensor([2, 0])),
        "stsb": F.mse_loss(sts.squeeze(-1), torch.tensor([0.7, -1.2])),
    }
    for name, value in expected.items():
        torch.testing.assert_close(out.task_losses[name], value)
    # total = mean over the batch's examples: each task weighted by its row count (2 each here)
    torch.testing.assert_close(out.loss, sum(expected.values()) / 3)
    torch.testing.assert_close(out.task_logits["mnli"], mnli)
    assert out.logits is None  # mixed batch with logits of different widths


def test_loss_scaling_divides_by_log_num_classes():
    plain, scaled = _heads(ALL_KINDS[:2]), _heads(ALL_KINDS[:2], scale=True)
    labels = torch.tensor([1, 2, 0, 1])
    a, _, _ = _run(plain, [0, 1, 0, 1], labels)
    b, _, _ = _run(scaled, [0, 1, 0, 1], labels)
    torch.testing.assert_close(b.task_losses["sst2"], a.task_losses["sst2"] / math.log(2))
    torch.testing.assert_close(b.task_losses["mnli"], a.task_losses["mnli"] / math.log(3))


def test_multiple_choice_groups_consecutive_rows():
    heads = _heads([ALL_KINDS[4]])  # copa, 2 choices
    labels = torch.tensor([1, 1, 0, 0])  # example 0: choice 1 right; example 1: choice 0 right
    out, _, pooled = _run(heads, [0, 0, 0, 0], labels)
    scores = heads["copa"].scorer(pooled).view(2, 2)
    torch.testing.assert_close(out.logits, scores)
    torch.testing.assert_close(out.task_losses["copa"], F.cross_entropy(scores, torch.tensor([1, 0])))


def test_span_head_pools_each_span():
    heads = _heads([ALL_KINDS[5]])  # wic
    spans = torch.tensor([[[1, 3], [4, 5]], [[2, 3], [3, 6]]])
    out, seq, pooled = _run(heads, [0, 0], torch.tensor([0, 1]), spans)
    features = torch.stack(
        [
            torch.cat([pooled[0], seq[0, 1:3].mean(0), seq[0, 4:5].mean(0)]),
            torch.cat([pooled[1], seq[1, 2:3].mean(0), seq[1, 3:6].mean(0)]),
        ]
    )
    torch.testing.assert_close(out.logits, heads["wic"].classifier(features))


def test_token_and_multilabel_heads():
    heads = _heads([ALL_KINDS[3], ALL_KINDS[6]])  # tags (4 labels), ner (5 classes)
    labels = torch.full((2, S), -100.0)
    labels[0, :4] = torch.tensor([1.0, 0.0, 0.0, 1.0])  # row 0: multi-hot
    labels[1, 1:4] = torch.tensor([3.0, 0.0, 4.0])  # row 1: token labels, rest ignored
    out, seq, pooled = _run(heads, [0, 1], labels)
    tags = heads["tags"].classifier(pooled[[0]])
    ner = heads["ner"].classifier(seq[[1]])
    torch.testing.assert_close(
        out.task_losses["tags"], F.binary_cross_entropy_with_logits(tags, torch.tensor([[1.0, 0, 0, 1]]))
    )
    torch.testing.assert_close(out.task_losses["ner"], F.cross_entropy(ner[0, 1:4], torch.tensor([3, 0, 4])))


def test_mixed_batch_logits_in_batch_order_when_shapes_agree():
    tasks = [TaskSpec(name="x", num_labels=2), TaskSpec(name="y", num_labels=2)]
    heads = _heads(tasks)
    out, _, pooled = _run(heads, [1, 0, 1])
    expected = torch.stack(
        [heads["y"].classifier(pooled[0]), heads["x"].classifier(pooled[1]), heads["y"].classifier(pooled[2])]
    )
    torch.testing.assert_close(out.logits, expected)


@pytest.mark.parametrize(
    "task_ids, labels, match",
    [
        ([0, 0], torch.tensor([0, 2]), r"'sst2'.*\[0, 2\).*rows \[1\]"),
        ([0, 0], torch.tensor([0.5, 1.0]), "non-integer"),
        ([2, 2], torch.tensor([1, 2]), "regression task 'stsb' must be floating point"),
        ([2, 2], torch.tensor([1.0, float("nan")]), "finite"),
        ([3, 3], torch.tensor([1.0, 0.0]), "multi-hot"),
        ([3], torch.tensor([[1.0, 0.0, 2.0, 0.0]]), "must be 0 or 1"),
        ([4, 4, 4], torch.tensor([0, 0, 0]), "2 consecutive rows"),
        ([4, 4], torch.tensor([0, 1]), "same label"),
        ([6], torch.tensor([1]), "2-D"),
    ],
)
def test_bad_labels_name_task_and_rows(task_ids, labels, match):
    heads = _heads()
    rows = heads.split_rows(torch.tensor(task_ids))
    with pytest.raises(ValueError, match=match):
        heads.check_inputs(rows, S, labels, None)


def test_span_task_needs_valid_spans():
    heads = _heads()
    rows = heads.split_rows(torch.tensor([5]))
    with pytest.raises(ValueError, match="needs `span_positions`"):
        heads.check_inputs(rows, S, None, None)
    with pytest.raises(ValueError, match="start < end"):
        heads.check_inputs(rows, S, None, torch.tensor([[[2, 2], [0, 1]]]))


@pytest.mark.parametrize(
    "task_ids, labels, match",
    [
        # one-hot rows for a single-label task: refused by shape (nothing in the batch takes wider labels)
        (
            [0, 0],
            torch.tensor([[1, 0], [0, 1]]),
            r"single-label task 'sst2' must have shape \(batch,\) or \(batch, 1\), got \(2, 2\).*argmax",
        ),
        ([1, 0], torch.tensor([[0, 0, 1], [1, 0, -100]]), r"single-label task '(sst2|mnli)' must have shape"),
        # three targets for a one-output regression
        (
            [2, 2],
            torch.tensor([[0.1, 0.2, 0.3], [1.0, 2.0, 3.0]]),
            r"regression task 'stsb' must have shape \(batch,\) or \(batch, 1\), got \(2, 3\)",
        ),
        ([4, 4], torch.tensor([[1, 0], [1, 0]]), r"multiple-choice task 'copa' must have shape"),
        ([5], torch.tensor([[1, 0]]), r"span-classification task 'wic' must have shape"),
        (
            [3],
            torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0]]),
            r"multi-label task 'tags' must have shape \(batch, 4\), got \(1, 5\)",
        ),
        ([0, 0], torch.zeros(2, 1, 1, dtype=torch.long), r"'sst2' must have shape"),
        # in a mixed batch with token labels the -100 padding is fine, anything else beyond column 0 is not
        (
            [0, 6],
            torch.tensor([[0, 1, -100], [1, 2, 3]]),
            r"'sst2' take 1 value\(s\) per row, but rows \[0\] hold more",
        ),
        (
            [6, 2],
            torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.5, -100.0]]),
            r"'stsb' take 1 value\(s\) per row, but rows \[1\]",
        ),
        (
            [3, 6],
            torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0], [1.0, 2.0, 3.0, 4.0, 0.0]]),
            r"'tags' take 4 value\(s\) per row, but rows \[0\]",
        ),
    ],
)
def test_labels_shaped_for_another_task_are_refused_not_read_in_part(task_ids, labels, match):
    heads = _heads()
    rows = heads.split_rows(torch.tensor(task_ids))
    spans = torch.tensor([[[1, 2], [3, 4]]] * len(task_ids))
    with pytest.raises(ValueError, match=match):
        heads.check_inputs(rows, S, labels, spans)


def test_shape_refusals_need_no_value_reads():
    """Without the value checks (a batch checked on the host, `values_checked=True`) a label of the wrong shape is
    still refused: its shape is known without reading the device."""
    heads = _heads()
    rows = heads.split_rows(torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="must have shape"):
        heads.check_inputs(rows, S, torch.tensor([[1, 0], [0, 1]]), None, check_values=False)


def test_padding_of_a_mixed_batch_is_read_as_padding():
    heads = _heads()
    labels = torch.tensor([[1, -100, -100], [3, 0, 4], [0, -100, -100]])
    out, _, pooled = _run(heads, [0, 6, 0], labels)
    sst = heads["sst2"].classifier(pooled[[0, 2]])
    torch.testing.assert_close(out.task_losses["sst2"], F.cross_entropy(sst, torch.tensor([1, 0])))
    stsb = torch.tensor([[0.5], [0.25]])  # (batch, 1) targets of a one-output regression are its own shape
    out, _, pooled = _run(heads, [2, 2], stsb)
    torch.testing.assert_close(out.task_losses["stsb"], F.mse_loss(heads["stsb"].regressor(pooled), stsb))
