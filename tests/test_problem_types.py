"""The problem-type registry: a type is one unit, names live only in their own files, a new type registered later
is taken by every family with its capability."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from hf_taskmoe import BertForTaskMoE, BertTaskMoEConfig, MMoEConfig, TaskSpec
from hf_taskmoe.layers.task_head import TaskHead
from hf_taskmoe.models import FAMILIES
from hf_taskmoe.problem_types import (
    ENCODER,
    PROBLEM_TYPES,
    TABULAR,
    TEXT_TO_TEXT,
    ProblemType,
    get_problem_type,
    problem_type_names,
    register_problem_type,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)


def _literal_sites() -> dict[str, list[tuple[int, str]]]:
    """Where a problem-type name is written as a string literal, in the package and the example script."""
    names = set(PROBLEM_TYPES)
    sites: dict[str, list[tuple[int, str]]] = {}
    for path in sorted((ROOT / "hf_taskmoe").rglob("*.py")) + [ROOT / "examples" / "run_multitask.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                sites.setdefault(str(path.relative_to(ROOT)), []).append((node.lineno, node.value))
    return sites


def test_problem_type_names_are_written_only_in_the_types_own_files():
    sites = _literal_sites()
    assert len(sites) <= 3, sites
    assert all(path.startswith("hf_taskmoe/problem_types/") for path in sites), sites
    # and each name is written in one file only: its class's
    owners = {}
    for path, found in sites.items():
        for _, name in found:
            owners.setdefault(name, set()).add(path)
    assert all(len(paths) == 1 for paths in owners.values()), owners


def test_every_registered_type_is_complete():
    for name, kind in PROBLEM_TYPES.items():
        assert kind.name == name and kind.hub_pipeline_tag and kind.capabilities
        if ENCODER in kind.capabilities:
            assert issubclass(kind.head_class, TaskHead), name
        spec = TaskSpec(name="t", problem_type=name, **_minimal_fields(name))
        assert spec.metrics == list(kind.default_metrics)


def _minimal_fields(name: str) -> dict:
    kind = get_problem_type(name)
    fields = {}
    if "choice_fields" in kind.own_spec_fields:
        fields["choice_fields"] = ["a", "b"]
    if "span_fields" in kind.own_spec_fields:
        fields.update(text_fields=["s1", "s2"], span_fields=[["a", "b"]])
    if kind.has_classes:
        fields["num_labels"] = 3
    if kind.pipeline_inputs == ("question", "context"):  # extractive QA reads a question and its context
        fields["text_fields"] = ["question", "context"]
    return fields


def test_families_take_the_types_of_their_capability():
    assert set(FAMILIES["taskmoe"].supported_problem_types) == set(problem_type_names(ENCODER))
    assert set(FAMILIES["mmoe"].supported_problem_types) == set(problem_type_names(TABULAR))
    assert FAMILIES["task_routing"].supported_problem_types == problem_type_names(TEXT_TO_TEXT)
    with pytest.raises(ValueError, match="has no encoder head"):
        BertTaskMoEConfig(tasks=[TaskSpec(name="s", problem_type=problem_type_names(TEXT_TO_TEXT)[0])], **TINY)


def test_an_unknown_type_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"problem_type.*must be one of \[.*regression.*\], got 'ranking'"):
        get_problem_type("ranking")
    with pytest.raises(ValueError, match="problem_type"):
        TaskSpec(name="x", problem_type="ranking", num_labels=2)


class _MeanHead(TaskHead):
    def __init__(self, task, hidden_size, dropout, scale_loss_by_num_classes=False):
        super().__init__(task, hidden_size, dropout, scale_loss_by_num_classes)
        self.score = nn.Linear(hidden_size, 1)

    def forward(self, sequence_output, pooled_output, span_positions=None):
        return self.score(sequence_output.mean(1))  # (rows, 1)

    def prepare_labels(self, labels, rows, seq_len, padded=True, check_values=True):
        return self._own_columns(labels.float(), rows, 1, padded, "mean-score", check_values)

    def loss(self, logits, labels):
        return ((logits.float() - labels) ** 2).mean()


class _MeanScore(ProblemType):
    name = "mean_score_test"
    has_classes = False
    min_labels = 1
    head_class = _MeanHead

    def resolve_num_labels(self, spec, prefix):
        return 1


@pytest.fixture
def mean_score_type():
    kind = register_problem_type(_MeanScore())
    yield kind
    PROBLEM_TYPES.pop(kind.name)


def test_a_type_registered_later_trains_in_an_encoder_family_and_round_trips(mean_score_type, tmp_path):
    tasks = [TaskSpec(name="cls", num_labels=2), TaskSpec(name="mean", problem_type=mean_score_type.name)]
    model = BertForTaskMoE(BertTaskMoEConfig(tasks=tasks, num_experts=2, **TINY))
    assert isinstance(model.heads["mean"], _MeanHead)
    batch = dict(input_ids=torch.randint(3, 50, (4, 6)), task_ids=torch.tensor([0, 1, 0, 1]),
                 labels=torch.tensor([[1.0], [0.5], [0.0], [-0.5]]))
    out = model(**batch)
    assert set(out.task_losses) == {"cls", "mean"}
    out.loss.backward()
    assert model.heads["mean"].score.weight.grad is not None
    model.save_pretrained(tmp_path)
    again = BertForTaskMoE.from_pretrained(tmp_path).eval()
    model.eval()
    torch.testing.assert_close(again(**batch).loss, model(**batch).loss)


def test_a_tabular_family_refuses_a_type_without_the_capability():
    with pytest.raises(ValueError, match="multi_label_classification"):
        MMoEConfig(tasks=[TaskSpec(name="m", problem_type="multi_label_classification", num_labels=3)],
                   numeric_features=["a"], num_experts=2)


def test_an_all_ignored_task_gives_the_same_loss_with_and_without_value_checks():
    """No hidden switch: the loss of a batch whose labels are all ignored is 0 whether or not the values were
    checked on the host (it used to be None in one mode and 0 in the other)."""
    torch.manual_seed(0)
    model = BertForTaskMoE(BertTaskMoEConfig(tasks=[TaskSpec(name="a", num_labels=2)], num_experts=2, **TINY)).eval()
    batch = dict(input_ids=torch.randint(3, 50, (3, 5)), labels=torch.full((3,), -100))
    checked, unchecked = model(**batch), model(**batch, values_checked=True)
    assert checked.loss.item() == unchecked.loss.item() == 0.0
    assert checked.task_losses["a"].item() == unchecked.task_losses["a"].item() == 0.0


def test_targets_end_with_the_end_token_even_when_the_tokenizer_adds_none():
    """GPT-2's and Llama's tokenizers end a text without EOS: the targets get one (within max_length), or a causal LM
    never learns to stop; a tokenizer that already ends its texts with it (BART, T5, BERT's [SEP]) is left alone."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_taskmoe.problem_types.seq2seq import target_token_ids

    words = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<eos>": 2, "<unk>": 3}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>", unk_token="<unk>")
    assert target_token_ids(tokenizer, ["a b", "b b b b b", ""], max_length=3) == [[0, 1, 2], [1, 1, 2], [2]]
    assert target_token_ids(tokenizer, ["a <eos>"], max_length=3) == [[0, 2]]
