import json
import re

import datasets
import pytest
import torch

from hf_taskmoe.training import MultiTaskCollator, MultiTaskDataset, load_task_config, load_tasks, tokenize_task
from hf_taskmoe.training.data import TASK_PRESETS, DataError, check_tasks

from .conftest import ALL_KINDS

SST2, MNLI, STSB, TAGS, COPA, WIC, NER = ALL_KINDS


def _ds(**columns):
    return datasets.Dataset.from_dict(columns)


def test_single_and_pair_texts(minilm_tokenizer):
    tok = tokenize_task(SST2, _ds(sentence=["a good film", "bad"], label=[1, 0]), minilm_tokenizer, task_id=0)
    assert tok.column_names == ["input_ids", "token_type_ids", "attention_mask", "task_ids", "labels"]
    assert minilm_tokenizer.decode(tok[0]["input_ids"]) == "[CLS] a good film [SEP]"
    pair = tokenize_task(
        MNLI, _ds(premise=["It rains."], hypothesis=["It is wet."], label=["neutral"]), minilm_tokenizer, task_id=1
    )
    assert pair[0]["labels"] == 1 and pair[0]["task_ids"] == 1 and 1 in pair[0]["token_type_ids"]


def test_multiple_choice_keeps_one_row_per_example(minilm_tokenizer):
    data = _ds(
        premise=["The man broke his toe."],
        question=["cause"],
        choice1=["He dropped a hammer."],
        choice2=["He ate."],
        label=[0],
    )
    tok = tokenize_task(COPA, data, minilm_tokenizer, task_id=4)
    assert len(tok) == 1 and len(tok[0]["input_ids"]) == 2
    assert "hammer" in minilm_tokenizer.decode(tok[0]["input_ids"][0])


def test_span_positions_cover_the_word(minilm_tokenizer):
    s1, s2 = "He sat on the bank of the river.", "The bank raised interest rates."
    data = _ds(sentence1=[s1], sentence2=[s2], start1=[s1.index("bank")], end1=[s1.index("bank") + 4],
               start2=[s2.index("bank")], end2=[s2.index("bank") + 4], label=[0])
    row = tokenize_task(WIC, data, minilm_tokenizer, task_id=5)[0]
    for start, end in row["span_positions"]:
        assert minilm_tokenizer.decode(row["input_ids"][start:end]) == "bank"


def test_token_labels_align_to_first_word_pieces(minilm_tokenizer):
    data = _ds(tokens=[["Johanson", "lives", "here"]], label=[[1, 0, 2]])
    row = tokenize_task(NER, data, minilm_tokenizer, task_id=6)[0]
    pieces = minilm_tokenizer.convert_ids_to_tokens(row["input_ids"])
    assert [lab for lab in row["labels"] if lab != -100] == [1, 0, 2]
    assert row["labels"][0] == -100 and row["labels"][-1] == -100  # [CLS], [SEP]
    assert len(pieces) > 5  # "Johanson" is several pieces; only the first carries the label


def test_collator_pads_a_mixed_batch():
    features = [
        {"input_ids": [101, 5, 102], "attention_mask": [1, 1, 1], "labels": 1, "task_ids": 0},
        {"input_ids": [101, 6, 7, 8, 102], "attention_mask": [1] * 5, "labels": 0.75, "task_ids": 2},
        {
            "input_ids": [[101, 9, 102], [101, 9, 10, 102]],
            "attention_mask": [[1] * 3, [1] * 4],
            "labels": 1,
            "task_ids": 4,
        },
        {"input_ids": [101, 11, 12, 102], "attention_mask": [1] * 4, "labels": [-100, 3, 0, -100], "task_ids": 6},
        {
            "input_ids": [101, 13, 102],
            "attention_mask": [1] * 3,
            "labels": 0,
            "task_ids": 5,
            "span_positions": [[1, 2], [1, 2]],
        },
    ]
    batch = MultiTaskCollator(pad_token_id=0, pad_to_multiple_of=8)(features)
    assert batch["input_ids"].shape == (6, 8)  # the copa example became two consecutive rows
    assert batch["task_ids"].tolist() == [0, 2, 4, 4, 6, 5]
    assert batch["attention_mask"].sum(1).tolist() == [3, 5, 3, 4, 4, 3]
    assert batch["labels"].dtype == torch.float32 and batch["labels"].shape == (6, 4)
    assert batch["labels"][:, 0].tolist() == [1.0, 0.75, 1.0, 1.0, -100.0, 0.0]
    assert batch["labels"][4].tolist() == [-100.0, 3.0, 0.0, -100.0]
    assert batch["span_positions"].shape == (6, 2, 2) and batch["span_positions"][5].tolist() == [[1, 2], [1, 2]]
    single = MultiTaskCollator()([features[0], features[0]])
    assert single["labels"].dtype == torch.long and single["labels"].shape == (2,)


def test_collator_gives_a_mixture_with_a_multi_label_task_one_labels_shape():
    """Issue 59 item 3: with the mixture's widest label (`mixture_label_width`: the multi-label task's 4 values) every
    batch's labels are `(rows, 4)`, padded with -100, whether it holds a multi-label row or not (a compiled step's
    graph keys on the shape); without it they followed the batch, 1-D for a batch of class indices."""
    from hf_taskmoe.problem_types.base import mixture_label_width

    mixture = [SST2, STSB, TAGS]
    assert mixture_label_width(mixture) == 4
    assert mixture_label_width([SST2, STSB, COPA, WIC]) is None  # one value per row: 1-D labels, as before
    assert mixture_label_width([SST2, TAGS, NER]) is None  # a label per token: as wide as the batch, as before
    collate = MultiTaskCollator(float_labels=True, label_width=mixture_label_width(mixture))
    sst2 = {"input_ids": [101, 5, 102], "attention_mask": [1, 1, 1], "labels": 1, "task_ids": 0}
    stsb = {"input_ids": [101, 6, 102], "attention_mask": [1, 1, 1], "labels": 0.5, "task_ids": 1}
    tags = {"input_ids": [101, 7, 102], "attention_mask": [1, 1, 1], "labels": [0, 1, 1, 0], "task_ids": 2}
    with_tags, without = collate([sst2, tags, stsb]), collate([sst2, stsb, sst2])
    assert with_tags["labels"].shape == without["labels"].shape == (3, 4)
    assert with_tags["labels"].dtype == without["labels"].dtype == torch.float32
    assert without["labels"].tolist() == [[1, -100, -100, -100], [0.5, -100, -100, -100], [1, -100, -100, -100]]
    assert with_tags["labels"][1].tolist() == [0, 1, 1, 0]
    # the evaluation reads each task's own columns back (`ProblemType.own_labels`)
    from hf_taskmoe.problem_types import problem_type_of

    assert problem_type_of(SST2).own_labels(SST2, without["labels"]).tolist() == [1, 0.5, 1]
    assert problem_type_of(TAGS).own_labels(TAGS, with_tags["labels"]).shape == (3, 4)
    assert MultiTaskCollator()([sst2, sst2])["labels"].shape == (2,)  # no width given: as before


def test_multitask_dataset_indexes_tasks_in_order():
    a, b = _ds(x=[0, 1, 2]), _ds(x=[10, 11])
    data = MultiTaskDataset([a, b], ["a", "b"])
    assert len(data) == 5 and data[3]["x"] == 10 and data.locate(4) == (1, 1)
    assert [r["x"] for r in data.__getitems__([4, 0, 3, 2])] == [11, 0, 10, 2]


def test_task_config_loads_local_files(tmp_path):
    (tmp_path / "t").mkdir()
    rows = [{"text": "fine", "label": "pos"}, {"text": "bad", "label": "neg"}]
    (tmp_path / "t" / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "t" / "dev.csv").write_text("text,label\nok,pos\n")
    _ds(text=["meh"], label=["neg"]).to_parquet(str(tmp_path / "t" / "test.parquet"))
    config = {"tasks": [{"name": "t", "label_names": ["neg", "pos"], "text_fields": ["text"],
                         "train_file": "t/train.jsonl", "validation_file": "t/dev.csv", "test_file": "t/test.parquet"}]}
    (tmp_path / "tasks.json").write_text(json.dumps(config))
    (task,) = load_task_config(tmp_path / "tasks.json", splits=("train", "validation", "test"))
    assert task.spec.label_names == ["neg", "pos"]
    assert (
        len(task.split("train")) == 2
        and task.split("validation")["text"] == ["ok"]
        and task.split("test")["label"] == ["neg"]
    )


def test_demo_mixture_config_is_valid():
    from pathlib import Path

    config = Path(__file__).resolve().parents[1] / "examples" / "data" / "demo_mixture" / "tasks.json"
    tasks = load_tasks([str(config)])
    assert [t.name for t in tasks] == ["rotten_tomatoes", "trec", "sms_spam", "tweet_sentiment", "newsgroups"]
    assert all(len(t.split("train")) >= 1000 and len(t.split("validation")) == 400 for t in tasks)


def test_presets_describe_the_paper_tasks():
    assert {
        "cola",
        "sst2",
        "mrpc",
        "qqp",
        "stsb",
        "mnli",
        "qnli",
        "rte",
        "boolq",
        "cb",
        "copa",
        "multirc",
        "wic",
    } <= set(TASK_PRESETS)
    assert TASK_PRESETS["stsb"].task_spec().problem_type == "regression"
    assert TASK_PRESETS["copa"].task_spec().choice_fields == ["choice1", "choice2"]
    assert TASK_PRESETS["mnli"].splits["validation"] == "validation_matched"
    assert TASK_PRESETS["multirc"].task_spec().metrics == ["f1a"]


@pytest.mark.parametrize(
    "spec, columns, match",
    [
        (SST2, dict(text=["x"], label=[1]), r"Task 'sst2': the train split has no field\(s\) \['sentence'\]"),
        (SST2, dict(sentence=["x"]), r"no field\(s\) \['label'\]"),
        (SST2, dict(sentence=["fine", "good"], label=[1, 2]), r"Task 'sst2', train row 1: label 2 is outside"),
        (
            MNLI,
            dict(premise=["a"], hypothesis=["b"], label=["maybe"]),
            r"label 'maybe' is not one of the task's labels \['entailment'",
        ),
        (STSB, dict(sentence1=["a"], sentence2=["b"], label=["high"]), r"regression label 'high' is not a number"),
        (SST2, dict(sentence=["ok", ""], label=[1, 0]), r"train row 1: field 'sentence' is empty"),
        (SST2, dict(sentence=[], label=[]), r"Task 'sst2': the train split is empty"),
    ],
)
def test_bad_data_stops_naming_task_field_and_row(minilm_tokenizer, spec, columns, match):
    data = datasets.Dataset.from_dict(columns)
    with pytest.raises(ValueError, match=match):
        tokenize_task(spec, data, minilm_tokenizer, task_id=0)


def test_unknown_task_and_missing_files(tmp_path):
    with pytest.raises(ValueError, match="Unknown task 'glue-sst2'.*presets are"):
        load_tasks(["glue-sst2"])
    (tmp_path / "tasks.json").write_text(
        json.dumps({"tasks": [{"name": "t", "num_labels": 2, "train_file": "nope.jsonl"}]})
    )
    with pytest.raises(ValueError, match=r"Task .t. \(train\): file .*nope.jsonl does not exist"):
        load_task_config(tmp_path / "tasks.json")
    (tmp_path / "bad.json").write_text(
        json.dumps({"tasks": [{"name": "t", "problem_type": "ranking", "num_labels": 2}]})
    )
    with pytest.raises(ValueError, match=r"tasks\[0\].*problem_type"):
        load_task_config(tmp_path / "bad.json")


# ----------------------------------------------------------------------------------------------- issue 35: files
def _task_file(tmp_path, name, content, **task):
    """A task-config with one task `t` (text field `text`) reading `name`, which holds `content`."""
    if content is not None:
        (tmp_path / name).write_text(content, encoding="utf-8")
    entry = {"name": "t", "text_fields": ["text"], "label_names": ["neg", "pos"], "train_file": name, **task}
    (tmp_path / "tasks.json").write_text(json.dumps({"tasks": [entry]}))
    return tmp_path / "tasks.json"


def _load(config):
    tasks = load_task_config(config, splits=("train",))
    return tasks[0], check_tasks(tasks, ["train"])[(tasks[0].name, "train")]


def test_json_booleans_map_to_classes_by_name(tmp_path):
    rows = '{"text": "a", "label": true}\n{"text": "b", "label": false}\n{"text": "c", "label": true}\n'
    task, labels = _load(_task_file(tmp_path, "b.jsonl", rows, label_names=["True", "False"]))
    assert labels == [0, 1, 0]  # true is the class named "True" (position 0), never position 1
    task, labels = _load(_task_file(tmp_path, "b.jsonl", rows, label_names=["False", "True"]))
    assert labels == [1, 0, 1]
    _, labels = _load(_task_file(tmp_path, "b.jsonl", rows, label_names=["yes", "no"], label_values=["true", "false"]))
    assert labels == [0, 1, 0]
    with pytest.raises(DataError, match=r"b.jsonl, line 1: label true is a boolean, matched by name.*'True'"):
        _load(_task_file(tmp_path, "b.jsonl", rows, label_names=None, num_labels=2))


def test_csv_keeps_quoted_line_breaks_commas_and_quotes(tmp_path):
    content = 'text,label\r\n"two\nlines",pos\r\n"say ""hi"", then\r\nleave",neg\r\nplain,pos\r\n'
    task, labels = _load(_task_file(tmp_path, "q.csv", content))
    assert task.split("train")["text"] == ["two\nlines", 'say "hi", then\r\nleave', "plain"]
    assert labels == [1, 0, 1] and task.lines["train"] == [2, 4, 6]  # the line each row starts on


@pytest.mark.parametrize(
    "content, match",
    [
        ('text,label\nok,pos\n"bad"quote,neg\n', r"q.csv, line 3: not valid CSV"),
        ('text,label\nok,pos\n"never closed,neg\n', r"q.csv, line 3: not valid CSV"),
        ("text,label\nok,pos,extra\n", r"q.csv, line 2: 3 columns, the header has 2"),
        ("text,text\nok,pos\n", r"q.csv, line 1: the header names column\(s\) \['text'\] twice"),
    ],
)
def test_malformed_csv_is_refused_by_line(tmp_path, content, match):
    with pytest.raises(DataError, match=match):
        _load(_task_file(tmp_path, "q.csv", content))


def test_jsonl_with_unicode_line_separators_inside_strings_loads(tmp_path):
    text = "one\u2028two\u2029three\x85four\x1cfive\x0bsix"
    rows = (
        json.dumps({"text": text, "label": "pos"}, ensure_ascii=False)
        + "\n"
        + json.dumps({"text": "x", "label": "neg"})
        + "\n"
    )
    task, labels = _load(_task_file(tmp_path, "u.jsonl", rows))
    assert task.split("train")["text"] == [text, "x"] and labels == [1, 0] and task.lines["train"] == [1, 2]


def test_json_array_rows_are_named_by_their_line(tmp_path):
    content = '[\n  {"text": "a", "label": "pos"},\n  {"text": "b",\n   "label": "maybe"}\n]\n'
    with pytest.raises(DataError, match=r"arr.json, line 3: label 'maybe' is not one of the task's labels"):
        _load(_task_file(tmp_path, "arr.json", content))
    with pytest.raises(DataError, match=r"arr.json, line 2: not valid JSON"):
        _load(_task_file(tmp_path, "arr.json", '[{"text": "a", "label": "pos"},\n {"text": }]'))


@pytest.mark.parametrize(
    "rows, match",
    [
        (
            ['{"text": "a", "label": "pos"}', '{"text": "b", "label": 0}'],
            r"Task 't' \(train\): .*m.jsonl, line 2, field 'label': 0 is a number, but line 1 writes 'pos' \(text\)",
        ),
        (
            ['{"text": "a", "label": 1}', '{"text": "b", "label": true}'],
            r"m.jsonl, line 2, field 'label': True is a boolean",
        ),
        (
            ['{"text": "a", "label": ["pos"]}', '{"text": "b", "label": "neg"}'],
            r"line 2, field 'label': 'neg' is text, but line 1",
        ),
        (['{"text": "a", "label": {"x": 1}}'], r"line 1, field 'label': \{'x': 1\} is an object"),
        (['{"text": "a", "label": ["pos", 1]}'], r"line 1, field 'label': .* is a mixed list"),
        (['{"text": "a", "label": 100000000000000000000000}'], r"line 1, field 'label': the integer .* is too large"),
        (
            ['{"text": "a", "label": "\u00b2"}'],
            r"Task 't', train file .*m.jsonl, line 1: label '\u00b2' is not one of the task's labels",
        ),
        (
            ['{"text": "a", "label": [0, 1]}'],
            r"line 1: a single_label_classification label is one class .* got \[0, 1\]",
        ),
        (
            ['{"text": ["a", "b"], "label": "pos"}'],
            r"line 1, field 'text': expected text, got \['a', 'b'\]; a text pair is two fields",
        ),
    ],
)
def test_labels_and_texts_of_the_wrong_kind_are_refused_by_file_and_line(tmp_path, rows, match):
    with pytest.raises(DataError, match=match):
        _load(_task_file(tmp_path, "m.jsonl", "\n".join(rows) + "\n"))


@pytest.mark.parametrize(
    "rows, spec, expected",
    [
        (  # a class outside the set, then a list where one class belongs, then a number where names are written
            ['{"text": "a", "label": "pos"}', '{"text": "b", "label": "maybe"}', '{"text": "c", "label": ["neg"]}',
             '{"text": "d", "label": 1}', '{"text": "e", "label": "neg"}'],
            {},
            [r"line 2: label 'maybe' is not one of the task's labels \['neg', 'pos'\]",
             r"line 3, field 'label': \['neg'\] is a list of text, but line 1 writes 'pos' \(text\)",
             r"line 4, field 'label': 1 is a number, but line 1 writes 'pos' \(text\)"],
        ),
        (  # regression: text where a number belongs, then a target that is not finite, an empty text, a bad line
            ['{"text": "a", "label": 0.5}', '{"text": "b", "label": "high"}', '{"text": "c", "label": NaN}',
             '{"text": "", "label": 1.0}', '{"text": "e", "label"'],
            dict(problem_type="regression", label_names=None),
            [r"line 2, field 'label': 'high' is text, but line 1 writes 0.5 \(a number\)",
             r"line 3: regression label nan is not finite",
             r"line 4: field 'text' is empty",
             r"line 5: not a JSON object"],
        ),
        (  # token classification: a tag outside the set, one tag of another kind, a row with a tag too few
            ['{"text": ["a", "b"], "label": ["pos", "neg"]}', '{"text": ["c"], "label": ["maybe"]}',
             '{"text": ["d", "e"], "label": "pos"}', '{"text": ["f", "g"], "label": ["neg"]}'],
            dict(problem_type="token_classification"),
            [r"line 2: label 'maybe' is not one of the task's labels",
             r"line 3, field 'label': 'pos' is text, but line 1 writes \['pos', 'neg'\] \(a list of text\)",
             r"line 4: 1 label\(s\) \(field 'label'\) for 2 word\(s\)"],
        ),
    ],
    ids=["out-of-set-then-other-kinds", "regression", "token-classification"],
)
def test_every_bad_row_of_a_file_is_listed_at_once(tmp_path, rows, spec, expected):
    """Issue 59 item 4: a file whose label column mixes kinds (refused before Arrow can store it) still has every
    other row's values checked: the out-of-set label, the empty text, the malformed line and a row whose tags do not
    match its words are listed beside the rows of another kind, in line order, in one error."""
    with pytest.raises(DataError) as caught:
        _load(_task_file(tmp_path, "m.jsonl", "\n".join(rows) + "\n", **spec))
    problems = caught.value.problems
    assert len(problems) == len(expected), problems
    for problem, pattern in zip(problems, expected):
        assert "m.jsonl" in problem and re.search(pattern, problem), (pattern, problem)
    assert all(str(p) in str(caught.value) for p in problems)


def test_regression_targets_are_plain_numbers_of_the_task_width(tmp_path):
    spec = dict(problem_type="regression", label_names=None)
    task, labels = _load(_task_file(tmp_path, "r.csv", "text,label\na, 2.5\nb,-1e-3\n", **spec))
    assert labels == [2.5, -0.001]
    for bad in ("1_000", "\u00b2", "\u0661", "true"):
        with pytest.raises(DataError, match=rf"r.csv, line 2: regression label '{bad}' is not a number"):
            _load(_task_file(tmp_path, "r.csv", f"text,label\na,{bad}\n", **spec))
    with pytest.raises(DataError, match=r"r.jsonl, line 1: expected 1 regression target\(s\), got \[1.0, 2.0, 3.0\]"):
        _load(_task_file(tmp_path, "r.jsonl", '{"text": "a", "label": [1.0, 2.0, 3.0]}\n', **spec))
    with pytest.raises(DataError, match=r"r.jsonl, line 1: expected 2 regression target\(s\), got 0.5"):
        _load(_task_file(tmp_path, "r.jsonl", '{"text": "a", "label": 0.5}\n', **spec, num_labels=2))


def test_multi_label_rows_list_classes_never_a_guessed_multi_hot(tmp_path):
    spec = dict(problem_type="multi_label_classification", label_names=["a", "b", "c"])
    _, labels = _load(
        _task_file(tmp_path, "ml.jsonl", '{"text": "x", "label": ["a", "c"]}\n{"text": "y", "label": ["c"]}\n', **spec)
    )
    assert labels == [[1, 0, 1], [0, 0, 1]]
    _, labels = _load(
        _task_file(tmp_path, "ml.jsonl", '{"text": "x", "label": [0, 2]}\n{"text": "y", "label": []}\n', **spec)
    )
    assert labels == [[1, 0, 1], [0, 0, 0]]
    with pytest.raises(DataError, match=r"line 1: label \[1, 0, 1\] could be a multi-hot row"):
        _load(_task_file(tmp_path, "ml.jsonl", '{"text": "x", "label": [1, 0, 1]}\n', **spec))
    with pytest.raises(DataError, match=r"line 1: label \['a', 'a'\] lists class 'a' twice"):
        _load(_task_file(tmp_path, "ml.jsonl", '{"text": "x", "label": ["a", "a"]}\n', **spec))


def test_token_rows_need_one_tag_per_word(tmp_path, minilm_tokenizer):
    spec = dict(problem_type="token_classification", label_names=["O", "B", "I"])
    good = '{"text": ["Ann", "lives", "here"], "label": ["B", "O", "O"]}\n'
    task, labels = _load(_task_file(tmp_path, "tok.jsonl", good, **spec))
    assert labels == [[1, 0, 0]]
    for line in (
        '{"text": ["Ann", "lives"], "label": ["B", "O", "O"]}',
        '{"text": ["Ann", "lives", "here"], "label": ["B"]}',
    ):
        with pytest.raises(
            DataError, match=r"tok.jsonl, line 2: \d label\(s\) \(field 'label'\) for \d word\(s\) \(field 'text'\)"
        ):
            _load(_task_file(tmp_path, "tok.jsonl", good + line + "\n", **spec))
    with pytest.raises(DataError, match=r"line 1: field 'text' holds no words"):
        _load(_task_file(tmp_path, "tok.jsonl", '{"text": [], "label": []}\n', **spec))
    # labels handed to tokenize_task directly are held to the same rule
    with pytest.raises(ValueError, match=r"train row 0: 4 label\(s\) \(field .label.\) for 3 word\(s\)"):
        tokenize_task(task.spec, task.split("train"), minilm_tokenizer, task_id=0, labels=[[1, 0, 0, 2]])


def test_a_text_pair_written_as_a_list_is_refused_before_the_tokenizer(minilm_tokenizer):
    data = _ds(sentence1=[["a", "b"]], sentence2=["c"], label=[0.5])
    with pytest.raises(
        DataError,
        match=r"Task 'stsb', train row 0: field 'sentence1': expected text, got \['a', 'b'\]; a text pair is two "
        r"fields",
    ):
        tokenize_task(STSB, data, minilm_tokenizer, task_id=0)


def test_paths_that_are_directories_or_numbers_are_refused_in_one_paragraph(tmp_path):
    (tmp_path / "train.jsonl").mkdir()
    with pytest.raises(
        DataError, match=r"Task 't' \(train\): .*train.jsonl is a directory, not a data file; name one .*\.jsonl"
    ):
        load_task_config(_task_file(tmp_path, "train.jsonl", None))
    for value in (5, ["a.jsonl"], ""):
        with pytest.raises(
            DataError, match=r"tasks\[0\] \(task 't'\): `train_file` must be the path of a data file .*, got"
        ):
            load_task_config(_task_file(tmp_path, value, None))
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "glue.json").write_text("{}")
    for load in (load_task_config, load_tasks):
        with pytest.raises(
            ValueError, match=r"Task config .*configs is a directory, not a task-config file; pass .*glue.json"
        ):
            load(tmp_path / "configs")
    with pytest.raises(ValueError, match="preset name or the path of a task-config JSON file, got 3"):
        load_tasks([3])


def test_a_field_under_another_name_is_refused_listing_the_file_s_fields(tmp_path):
    from hf_taskmoe.training.data import DataError, load_task_config

    (tmp_path / "train.jsonl").write_text('{"sentence": "a fine film", "sentiment": "pos"}\n')
    (tmp_path / "tasks.json").write_text(
        json.dumps([{"name": "sst", "label_names": ["neg", "pos"], "train_file": "train.jsonl"}])
    )
    with pytest.raises(DataError) as err:
        load_task_config(tmp_path / "tasks.json", splits=("train",))
    message = str(err.value)
    assert (
        "'sentiment'" in message and "'sentence'" in message and "label_field" in message and "text_fields" in message
    )
