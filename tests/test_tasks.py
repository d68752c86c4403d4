import json

import pytest

from hf_taskmoe import TaskSpec, parse_tasks
from hf_taskmoe.problem_types import get_problem_type
from hf_taskmoe.tasks import PROBLEM_TYPES

from .conftest import ALL_KINDS


@pytest.mark.parametrize(
    "spec",
    ALL_KINDS + [TaskSpec(name="sum", problem_type="seq2seq", text_fields=["document"])],
    ids=lambda s: s.problem_type,
)
def test_json_round_trip(spec):
    assert TaskSpec.from_json(spec.to_json()) == spec
    assert TaskSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_every_problem_type_is_covered():
    assert {s.problem_type for s in ALL_KINDS} | {"seq2seq", "extractive_qa"} == set(PROBLEM_TYPES)


def test_derived_values():
    mnli = TaskSpec(name="mnli", label_names=["e", "n", "c"])
    assert mnli.num_labels == 3 and mnli.id2label == {0: "e", 1: "n", 2: "c"}
    assert TaskSpec(name="r", problem_type="regression").num_labels == 1
    copa = TaskSpec(name="copa", problem_type="multiple_choice", choice_fields=["c1", "c2", "c3"])
    assert copa.num_labels == 3 and copa.num_choices == 3
    assert TaskSpec(name="x", num_labels=2).metrics == list(
        get_problem_type("single_label_classification").default_metrics
    )
    assert TaskSpec(name="r", problem_type="regression").metrics == ["pearson", "spearmanr"]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(name=""), "name"),
        (dict(name="has.dot", num_labels=2), "name"),
        (dict(name=3, num_labels=2), "name"),
        (dict(name="t", problem_type="ranking", num_labels=2), "problem_type"),
        (dict(name="t"), "num_labels"),
        (dict(name="t", num_labels=1), "num_labels"),
        (dict(name="t", num_labels="2"), "num_labels"),
        (dict(name="t", num_labels=2, label_names=["a", "b", "c"]), "label_names"),
        (dict(name="t", label_names=["a", "a"]), "label_names"),
        (dict(name="t", num_labels=2, text_fields=[]), "text_fields"),
        (dict(name="t", num_labels=2, text_fields="sentence"), "text_fields"),
        (dict(name="t", num_labels=2, metrics=[""]), "metrics"),
        (dict(name="t", num_labels=2, loss_weight=-1.0), "loss_weight"),
        (dict(name="t", num_labels=2, label_field=""), "label_field"),
        (dict(name="t", problem_type="multiple_choice"), "choice_fields"),
        (dict(name="t", problem_type="multiple_choice", choice_fields=["only"]), "choice_fields"),
        (dict(name="t", num_labels=2, choice_fields=["a", "b"]), "choice_fields"),
        (dict(name="t", problem_type="span_classification", num_labels=2), "span_fields"),
        (dict(name="t", problem_type="span_classification", num_labels=2, span_fields=[["s", "e"]] * 2), "span_fields"),
        (dict(name="t", num_labels=2, span_fields=[["s", "e"]]), "span_fields"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TaskSpec(**kwargs)


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="Unknown TaskSpec field"):
        TaskSpec.from_dict({"name": "t", "num_labels": 2, "labels": 3})
    with pytest.raises(ValueError, match="could not be parsed"):
        TaskSpec.from_json("{not json")


def test_parse_tasks():
    specs = parse_tasks([{"name": "a", "num_labels": 2}, TaskSpec(name="b", problem_type="regression")])
    assert [s.name for s in specs] == ["a", "b"]
    with pytest.raises(ValueError, match="duplicate"):
        parse_tasks([{"name": "a", "num_labels": 2}, {"name": "a", "num_labels": 3}])
    with pytest.raises(ValueError, match=r"tasks\[1\]"):
        parse_tasks([{"name": "a", "num_labels": 2}, {"name": "b"}])
    with pytest.raises(ValueError, match="at least one"):
        parse_tasks([])


@pytest.mark.parametrize("name", ["training", "tasks", "keys", "forward", "train", "items"])
def test_names_that_are_module_dict_attributes_are_refused_at_construction(name):
    with pytest.raises(
        ValueError, match=rf"`name` '{name}' is reserved.*Rename the task.*reserved names are \[.*'training'"
    ):
        TaskSpec(name=name, num_labels=2)
    with pytest.raises(ValueError, match=rf"tasks\[1\].*'{name}' is reserved"):
        parse_tasks([{"name": "a", "num_labels": 2}, {"name": name, "num_labels": 2}])


def test_reserved_names_cover_every_attribute_a_task_name_could_collide_with():
    """Canary: a torch that adds an attribute to `nn.ModuleDict` (or a new `MultiTaskHeads` attribute) must be added
    to `RESERVED_TASK_NAMES`, or a task of that name would break every ModuleDict keyed by task name."""
    from torch import nn

    from hf_taskmoe import BertForTaskMoE
    from hf_taskmoe.layers.heads import MultiTaskHeads
    from hf_taskmoe.tasks import RESERVED_TASK_NAMES

    from .conftest import tiny_config

    BertForTaskMoE(tiny_config())  # transformers adds `nn.Module.smart_apply` when it first initialises a model
    heads = MultiTaskHeads([TaskSpec(name="a", num_labels=2)], hidden_size=4, dropout=0.0)
    attributes = {n for n in set(dir(heads)) | set(vars(heads)) | set(dir(nn.ModuleDict)) if not n.startswith("_")} - {
        "a"
    }
    assert attributes <= RESERVED_TASK_NAMES, sorted(attributes - RESERVED_TASK_NAMES)


def test_names_near_the_reserved_ones_key_heads_safely():
    import torch

    from hf_taskmoe.layers.heads import MultiTaskHeads

    tasks = [TaskSpec(name=n, num_labels=2) for n in ("Training", "tasks_2", "keys-x")]
    heads = MultiTaskHeads(tasks, hidden_size=4, dropout=0.0)
    heads.add_task(TaskSpec(name="training_task", problem_type="regression"))
    assert list(heads.keys()) == ["Training", "tasks_2", "keys-x", "training_task"]
    assert heads.training and isinstance(heads.tasks, list)  # the module's own attributes are untouched
    rows = heads.split_rows(torch.tensor([3, 0]))
    out = heads(torch.zeros(2, 3, 4), torch.zeros(2, 4), rows)
    assert set(out.task_logits) == {"Training", "training_task"}
