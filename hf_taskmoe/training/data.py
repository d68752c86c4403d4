"""Data loading for multi-task training.

A task's data comes either from the Hub through `datasets.load_dataset` (presets for the GLUE and
SuperGLUE tasks the papers use) or from local csv/json/jsonl/parquet files described in a task-config
file:

```json
{"tasks": [
  {"name": "rotten_tomatoes", "label_names": ["rotten", "fresh"], "text_fields": ["text"],
   "train_file": "rotten_tomatoes/train.jsonl", "validation_file": "rotten_tomatoes/dev.jsonl"},
  {"preset": "sst2"}
]}
```

(an entry holds `TaskSpec` fields plus `train_file` / `validation_file` / `test_file`, paths relative to
the config file; or a `preset` name with optional overrides). Every split is checked before training
(`check_task_split`): a missing field, an empty split or a label outside the task's label set stops with
a message naming the task, the field and the row.

Labels are never guessed: a label is a class name or a 0-based position (or one of `label_values`), a JSON
boolean is the class of that name ("True"/"False"), a token-classification row has one tag per word, and a
field is written one way on every row (names and positions are not mixed); any other row is refused by file
and line. CSV/TSV files are read per RFC 4180 (a quoted cell keeps its quotes, delimiters and line breaks);
JSON lines end at "\\n" only, so U+2028 and the other Unicode separators inside a string are text.

`tokenize_task` turns a split into model columns (single text, text pair, multiple choice, word spans,
pre-split words for token classification); `MultiTaskDataset` concatenates the tasks' training sets for
the task sampler; `MultiTaskCollator` (`batches.py`, beside the host-side batch checks) pads a mixed batch and
carries `task_ids`.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..problem_types import problem_type_of, target_token_ids  # noqa: F401 (target_token_ids: part of this module's API)
from ..problem_types.classification import MultipleChoice, Regression, SpanClassification
from ..tasks import TaskSpec
from ..utils import lookup

SPLITS = ("train", "validation", "test")
# the problem types the GLUE/SuperGLUE presets below name
_REGRESSION, _MULTIPLE_CHOICE, _SPAN_CLASSIFICATION = Regression.name, MultipleChoice.name, SpanClassification.name


# ----------------------------------------------------------------------------------------------- presets
@dataclass(frozen=True)
class TaskPreset:
    """A Hub dataset and the `TaskSpec` of the task it holds."""

    dataset: str
    config: str | None
    spec: dict
    splits: dict = field(default_factory=lambda: {"train": "train", "validation": "validation", "test": "test"})

    def task_spec(self, **overrides) -> TaskSpec:
        return TaskSpec.from_dict({**self.spec, "dataset": self.dataset, "dataset_config": self.config, **overrides})


def _glue(config, text_fields, label_names=None, metrics=("accuracy",), splits=None, dataset="nyu-mll/glue", **spec):
    spec = {"name": config, "text_fields": list(text_fields), "metrics": list(metrics), **spec}
    if label_names:
        spec["label_names"] = list(label_names)
    return TaskPreset(dataset, config, spec, splits or {"train": "train", "validation": "validation", "test": "test"})


_super_glue = partial(_glue, dataset="aps/super_glue")


TASK_PRESETS: dict[str, TaskPreset] = {
    # GLUE (MT-TaG section 4.1, CA-MTL, PALs)
    "cola": _glue("cola", ["sentence"], ["unacceptable", "acceptable"], ["matthews_correlation"]),
    "sst2": _glue("sst2", ["sentence"], ["negative", "positive"]),
    "mrpc": _glue("mrpc", ["sentence1", "sentence2"], ["not_equivalent", "equivalent"], ["accuracy", "f1"]),
    "qqp": _glue("qqp", ["question1", "question2"], ["not_duplicate", "duplicate"], ["accuracy", "f1"]),
    "stsb": _glue("stsb", ["sentence1", "sentence2"], None, ["pearson", "spearmanr"], problem_type=_REGRESSION),
    "mnli": _glue(
        "mnli",
        ["premise", "hypothesis"],
        ["entailment", "neutral", "contradiction"],
        splits={"train": "train", "validation": "validation_matched", "test": "test_matched"},
    ),
    "mnli_mm": TaskPreset(
        "nyu-mll/glue",
        "mnli",
        {
            "name": "mnli_mm",
            "text_fields": ["premise", "hypothesis"],
            "label_names": ["entailment", "neutral", "contradiction"],
        },
        {"train": "train", "validation": "validation_mismatched", "test": "test_mismatched"},
    ),
    "qnli": _glue("qnli", ["question", "sentence"], ["entailment", "not_entailment"]),
    "rte": _glue("rte", ["sentence1", "sentence2"], ["entailment", "not_entailment"]),
    # SuperGLUE (MT-TaG GLUE++)
    "boolq": _super_glue("boolq", ["question", "passage"], ["False", "True"]),
    "cb": _super_glue(
        "cb", ["premise", "hypothesis"], ["entailment", "contradiction", "neutral"], ["accuracy", "f1_macro"]
    ),
    "copa": _super_glue(
        "copa", ["premise", "question"], None, problem_type=_MULTIPLE_CHOICE, choice_fields=["choice1", "choice2"]
    ),
    "multirc": _super_glue("multirc", ["paragraph", "question", "answer"], ["False", "True"], ["f1a"]),
    "wic": _super_glue(
        "wic",
        ["sentence1", "sentence2"],
        ["False", "True"],
        problem_type=_SPAN_CLASSIFICATION,
        span_fields=[["start1", "end1"], ["start2", "end2"]],
    ),
    # sentiment and NLI tasks of MT-TaG's GLUE++ and unseen-task experiments
    "rotten_tomatoes": TaskPreset(
        "cornell-movie-review-data/rotten_tomatoes",
        None,
        {"name": "rotten_tomatoes", "text_fields": ["text"], "label_names": ["neg", "pos"]},
    ),
    "imdb": TaskPreset(
        "stanfordnlp/imdb",
        None,
        {"name": "imdb", "text_fields": ["text"], "label_names": ["neg", "pos"]},
        {"train": "train", "validation": "test", "test": "test"},
    ),
    "yelp_polarity": TaskPreset(
        "fancyzhx/yelp_polarity",
        None,
        {"name": "yelp_polarity", "text_fields": ["text"], "num_labels": 2},
        {"train": "train", "validation": "test", "test": "test"},
    ),
    "scitail": TaskPreset(
        "allenai/scitail",
        "tsv_format",
        {"name": "scitail", "text_fields": ["premise", "hypothesis"], "label_names": ["entails", "neutral"]},
    ),
}


# ----------------------------------------------------------------------------------------------- loading
class DataError(ValueError):
    """Every problem found in the data at once: `problems` holds one line per problem (task, file, line, field,
    value, what was expected); the message shows the first `limit` and counts the rest."""

    def __init__(self, problems: list[str], limit: int = 20):
        self.problems = list(problems)
        shown = "\n  ".join(self.problems[:limit])
        more = f"\n  ... and {len(self.problems) - limit} more" if len(self.problems) > limit else ""
        super().__init__(f"{len(self.problems)} problem(s) in the data:\n  {shown}{more}")


@dataclass
class TaskData:
    """A task and its raw splits (`datasets.Dataset`s; a missing split is None). `lines[split]` holds the file
    line of each row (for messages), when the split was read from a text file."""

    spec: TaskSpec
    splits: dict = field(default_factory=dict)
    source: str = ""
    files: dict = field(default_factory=dict)
    lines: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name

    def split(self, name: str):
        return self.splits.get(name)

    def where(self, split: str, row: int) -> str:
        """`file, line N` (or `split row N`) of a row, for messages."""
        lines = self.lines.get(split)
        if split in self.files and lines is not None:
            return f"{split} file {self.files[split]}, line {lines[row]}"
        return f"{split} row {row}"


_FILE_TYPES = (".csv", ".tsv", ".json", ".jsonl", ".parquet")


def _read_text_rows(path: Path, problems: list[str], where: str) -> tuple[list[dict], list[int]]:
    """Rows and the line each starts on, from a .jsonl / .json / .csv / .tsv file; each malformed row is added to
    `problems` (all of them, not the first only).

    Lines end at "\\n" (or "\\r\\n") only: U+2028, U+0085 and the other characters `str.splitlines` also splits at
    are text inside a JSON string. CSV follows RFC 4180: a quoted cell keeps its commas, quotes and line breaks."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        problems.append(
            f"{where}: {path}, line {line}: not UTF-8 text (byte {raw[err.start]:#04x}); save the file as UTF-8."
        )
        return [], []
    if not text.strip():
        problems.append(f"{where}: {path} is empty.")
        return [], []
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv"):
        return _read_csv_rows(text, path, problems, where, delimiter="\t" if suffix == ".tsv" else ",")
    if suffix == ".json" and text.lstrip().startswith("["):  # one JSON array of objects
        pairs = _read_json_array(text, path, problems, where)
    else:  # JSON lines
        pairs = []
        for number, line in enumerate(text.split("\n"), start=1):
            if not line.strip(" \t\r"):  # JSON whitespace; a line holding only U+2028 is no blank line
                continue
            try:
                pairs.append((json.loads(line), number))
            except json.JSONDecodeError as err:
                problems.append(f"{where}: {path}, line {number}: not a JSON object ({err.msg}).")
    rows, lines = [], []
    for item, number in pairs:
        if not isinstance(item, dict):
            problems.append(f"{where}: {path}, line {number}: a row must be a JSON object, got {type(item).__name__}.")
            continue
        rows.append(item)
        lines.append(number)
    return rows, lines


def _read_csv_rows(
    text: str, path: Path, problems: list[str], where: str, delimiter: str
) -> tuple[list[dict], list[int]]:
    """RFC 4180 rows (strict quoting: `"ab"c` is an error, not `abc`) and the line each row starts on."""
    import csv
    import io

    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True)  # newline="": csv splits lines
    header, rows, lines, previous = None, [], [], 0
    try:
        for cells in reader:
            first, previous = previous + 1, reader.line_num
            if not cells:  # a blank line
                continue
            if header is None:
                header = cells
                duplicates = sorted({c for c in header if header.count(c) > 1})
                if duplicates:
                    problems.append(f"{where}: {path}, line {first}: the header names column(s) {duplicates} twice.")
                    return [], []
                continue
            if len(cells) != len(header):
                problems.append(f"{where}: {path}, line {first}: {len(cells)} columns, the header has {len(header)}.")
                continue
            rows.append(dict(zip(header, cells)))
            lines.append(first)
    except csv.Error as err:
        problems.append(
            f"{where}: {path}, line {previous + 1}: not valid CSV ({err}); a cell holding quotes, the delimiter or a "
            "line "
            'break must be quoted whole, its quotes doubled ("say ""hi""").'
        )
        return [], []
    return rows, lines


def _read_json_array(text: str, path: Path, problems: list[str], where: str) -> list[tuple[Any, int]]:
    """The items of a JSON array and the line each starts on."""
    decoder, pairs = json.JSONDecoder(), []
    line_of = lambda pos: text.count("\n", 0, pos) + 1  # noqa: E731
    skip = lambda pos: len(text) - len(text[pos:].lstrip(" \t\r\n"))  # noqa: E731 (JSON whitespace only)
    pos = skip(text.index("[") + 1)
    try:
        if text[pos:pos + 1] == "]":
            return []
        while True:
            item, end = decoder.raw_decode(text, pos)
            pairs.append((item, line_of(pos)))
            pos = skip(end)
            if text[pos:pos + 1] == ",":
                pos = skip(pos + 1)
                continue
            if text[pos:pos + 1] == "]" and not text[pos + 1:].strip(" \t\r\n"):
                return pairs
            raise json.JSONDecodeError("expected ',' or a final ']'", text, pos)
    except json.JSONDecodeError as err:
        problems.append(f"{where}: {path}, line {err.lineno}: not valid JSON ({err.msg}).")
        return []


def _load_file(path: Path, spec: TaskSpec, split: str, problems: list[str]):
    """One split of a task from a local file, keeping the fields the task reads; `(dataset, lines)`, or
    `(None, None)` after adding what is wrong to `problems`."""
    import datasets

    where = f"Task {spec.name!r} ({split})"
    if not path.exists():
        problems.append(f"{where}: file {path} does not exist.")
        return None, None
    if path.is_dir():
        problems.append(
            f"{where}: {path} is a directory, not a data file; name one {'/'.join(_FILE_TYPES)} file in `{split}_file`."
        )
        return None, None
    suffix = path.suffix.lower()
    if suffix not in _FILE_TYPES:
        problems.append(
            f"{where}: file type of {path.name} must be one of {list(_FILE_TYPES)}, got {suffix or 'none'!r}."
        )
        return None, None
    try:
        if suffix == ".parquet":
            return datasets.load_dataset("parquet", data_files={split: str(path)}, split=split), None
        count = len(problems)
        rows, lines = _read_text_rows(path, problems, where)
    except OSError as err:
        problems.append(f"{where}: {path} could not be read ({err.strerror or err}).")
        return None, None
    except Exception as err:  # noqa: BLE001 -- a damaged parquet file: Arrow's error, named by file
        problems.append(f"{where}: {path} could not be read as {suffix[1:]} ({type(err).__name__}: {err}).")
        return None, None
    wanted = list(dict.fromkeys(problem_type_of(spec).required_fields(spec, with_labels=True)))
    present = list(dict.fromkeys(k for row in rows for k in row))
    # (a split to predict on may come without labels; training and evaluation need them)
    absent = [
        name
        for name in wanted
        if name not in present and not (name == spec.label_field and split not in ("train", "validation"))
    ]
    if rows and absent:
        problems.append(
            f"{where}: {path} has no field(s) {absent}; its rows have the fields {present}. Name the fields the task "
            "reads "
            f"in the task config: `text_fields` (now {list(spec.text_fields)}) and `label_field` (now "
            f"{spec.label_field!r})."
        )
        return None, None
    flagged: set[tuple[int, str]] = set()  # (line, field) of each problem found so far, reported once
    problems.extend(_check_row_types(spec, rows, lines, path, where, flagged))  # the rows that parsed, beside the rest
    problems.extend(_check_column_kinds(spec, rows, lines, path, where, wanted, flagged))
    if len(problems) > count:
        # the file cannot become a dataset; the values of its other rows are still checked (a label outside the
        # task's set on one line, a label of another kind on the next: both reported at once)
        names = dict.fromkeys([*wanted, *problem_type_of(spec).text_fields(spec), spec.label_field])
        columns = {name: [row.get(name) for row in rows] for name in names}
        problems.extend(_row_problems(
            spec, columns, split, with_labels=any(spec.label_field in row for row in rows),
            where=lambda row: f"{split} file {path}, line {lines[row]}",
            skip=lambda row, name: (lines[row], name) in flagged,
        )[0])
        problems[count:] = sorted(problems[count:], key=_line_of)  # this file's problems in the order of its lines
        return None, None
    # only the fields the task reads: another column of mixed types must not stop Arrow
    columns = {name: [row.get(name) for row in rows] for name in wanted if any(name in row for row in rows)}
    try:
        return datasets.Dataset.from_dict(columns), lines
    except Exception as err:  # noqa: BLE001 -- what `_check_column_kinds` did not foresee is still named by file
        problems.append(
            f"{where}: {path}: the fields {list(columns)} cannot be stored as one column each ({type(err).__name__}: "
            f"{err}); write each field with one type on every row."
        )
        return None, None


def _line_of(problem: str) -> int:
    """The line a problem message names first (0: none), to list a file's problems in the order of its lines."""
    found = re.search(r"\bline (\d+)", problem)
    return int(found.group(1)) if found else 0


def _wrong_text(spec: TaskSpec, words: bool, value: Any) -> str | None:
    """What a text field holds when it is not what it must be (None: it is text -- a list of words for `words` --, or
    absent): a list where text belongs may be a text pair written as one field."""
    if value is None or ((isinstance(value, (list, tuple)) and all(isinstance(w, str) for w in value)) if words
                         else isinstance(value, str)):
        return None
    pair = (f"; a text pair is two fields, e.g. `text_fields: {list(spec.text_fields) + ['<second field>']}`"
            if not words and isinstance(value, (list, tuple)) else "")
    return f"expected {'a list of words' if words else 'text'}, got {value!r}{pair}."


def _check_row_types(spec: TaskSpec, rows: list[dict], lines: list[int], path: Path, where: str,
                     flagged: set | None = None) -> list[str]:
    """Text fields hold text (token classification: a list of words); a number where text belongs is reported (and
    its `(line, field)` added to `flagged`)."""
    kind = problem_type_of(spec)
    problems = []
    for row, line in zip(rows, lines):
        for name in kind.text_fields(spec):
            wrong = _wrong_text(spec, kind.text_is_words, row.get(name))
            if wrong:
                problems.append(f"{where}: {path}, line {line}, field {name!r}: {wrong}")
                if flagged is not None:
                    flagged.add((line, name))
    return problems


_FIELD_KINDS = ("text", "number", "boolean", "list", "list of text", "list of number", "list of boolean")


def _kind(value: Any) -> str | None:
    """How a JSON value is written, for `_check_column_kinds`: None (null), 'text', 'number', 'boolean', 'list of
    <kind>', 'object', or 'mixed list' (elements of several kinds)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        kinds = {_kind(v) for v in value} - {None}
        return "list" if not kinds else f"list of {kinds.pop()}" if len(kinds) == 1 else "mixed list"
    return "object"


def _a(kind: str) -> str:
    return kind if kind == "text" else f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def _check_column_kinds(
    spec: TaskSpec, rows: list[dict], lines: list[int], path: Path, where: str, wanted: list[str],
    flagged: set | None = None,
) -> list[str]:
    """Each field the task reads is written one way on every row (a column of Arrow holds one type): a label column
    mixing class names and positions ("pos" and 0), booleans and numbers, lists and single labels is refused at the
    rows that differ from the first, with the kinds; so are objects, nested lists and integers beyond 64 bits. The
    `(line, field)` of each problem is added to `flagged`."""
    problems = []
    flagged = set() if flagged is None else flagged
    for name in wanted:
        if name == spec.label_field and problem_type_of(spec).label_is_object:
            continue  # an object label (extractive QA's answers) is checked by its problem type's `encode_label`
        first = None  # (kind, line, value) of the first row with a value
        for row, line in zip(rows, lines):
            value = row.get(name)
            kind = _kind(value)
            if kind is None:
                continue
            at = f"{where}: {path}, line {line}, field {name!r}"
            if kind not in _FIELD_KINDS:
                problems.append(f"{at}: {value!r} is {_a(kind)}; a field holds text, a "
                                "number, a boolean or a list of one of them.")
                flagged.add((line, name))
                continue
            if any(isinstance(v, int) and not isinstance(v, bool) and not -2**63 <= v < 2**63
                   for v in (value if isinstance(value, list) else [value])):
                problems.append(f"{at}: the integer {value!r} is too large (beyond 64 bits).")
                flagged.add((line, name))
                continue
            if first is None or (first[0] == "list" and kind.startswith("list")):  # [] fits any list; the next sets it
                first = (kind, line, value)
            elif kind != first[0] and not (kind == "list" and first[0].startswith("list")):
                problems.append(
                    f"{at}: {value!r} is {_a(kind)}, but line {first[1]} writes {first[2]!r} ({_a(first[0])}); write "
                    "this field "
                    "the same way on every row (e.g. every label a class name, or every label a class position)."
                )
                flagged.add((line, name))
    return problems


class PresetLoadError(RuntimeError):
    """`datasets.load_dataset` failed for a preset task: says which task and Hub dataset (the cause chained)."""

    def __init__(self, task: str, dataset: str, config: str | None, cause: BaseException):
        self.task, self.dataset_id = task, dataset + (f" ({config})" if config else "")
        super().__init__(f"Could not load the data of preset task {task!r} (Hub dataset {self.dataset_id}): "
                         f"{type(cause).__name__}: {cause}")


def load_preset(
    name: str, splits: Sequence[str] = ("train", "validation"), cache_dir: str | None = None, **overrides
) -> TaskData:
    """Load a preset task from the Hub (`datasets.load_dataset(dataset, config, split=...)`)."""
    import datasets

    preset = lookup(TASK_PRESETS, name, "task preset")
    spec = preset.task_spec(**overrides)
    try:
        loaded = {split: datasets.load_dataset(preset.dataset, preset.config, split=preset.splits[split],
                                               cache_dir=cache_dir)
                  for split in splits if preset.splits.get(split) is not None}  # a split the preset has
    except Exception as err:  # noqa: BLE001 -- said with the task and dataset it was loading; the cause chained
        raise PresetLoadError(name, preset.dataset, preset.config, err) from err
    return TaskData(spec, loaded, f"{preset.dataset}" + (f" ({preset.config})" if preset.config else ""))


def load_task_config(
    path: str | os.PathLike, splits: Sequence[str] = ("train", "validation"), cache_dir: str | None = None
) -> list[TaskData]:
    """Load every task of a task-config JSON file (see module docstring). Problems in the task entries and
    data files of all tasks are reported together (`DataError`)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(_directory_message(path))
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"Task config file {path} does not exist.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"Task config file {path} is not valid JSON: {err}") from None
    except OSError as err:
        raise ValueError(f"Task config file {path} could not be read ({err.strerror or err}).") from None
    entries = config.get("tasks") if isinstance(config, dict) else config
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"Task config file {path} must hold a non-empty list under `tasks`.")
    tasks, problems = [], []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            problems.append(f"{path}: tasks[{i}] must be an object, got {entry!r}.")
            continue
        entry = dict(entry)
        if "preset" in entry:
            tasks.append(load_preset(entry.pop("preset"), splits, cache_dir, **entry))
            continue
        files = {s: entry.pop(f"{s}_file", None) for s in SPLITS}
        try:
            spec = TaskSpec.from_dict(entry)
        except ValueError as err:
            problems.append(f"{path}: tasks[{i}]: {err}")
            continue
        for split, name in files.items():
            if name is not None and (not isinstance(name, str) or not name.strip()):
                problems.append(
                    f"{path}: tasks[{i}] (task {spec.name!r}): `{split}_file` must be the path of a data file (text, "
                    f"relative to the task-config file), got {name!r}."
                )
                files[split] = None
        data = TaskData(spec, source=str(path))
        for split, name in files.items():
            if name is None or split not in splits:
                continue
            dataset, lines = _load_file(path.parent / name, spec, split, problems)
            if dataset is not None:
                data.splits[split], data.files[split], data.lines[split] = dataset, str(path.parent / name), lines
        tasks.append(data)
    if problems:
        raise DataError(problems)
    return tasks


def _directory_message(path: Path) -> str:
    found = sorted(p.name for p in path.glob("*.json"))[:5]
    hint = f" (it holds {found})" if found else ""
    return (f"Task config {path} is a directory, not a task-config file; pass the JSON file that lists the tasks, "
            f"e.g. {path / (found[0] if found else 'tasks.json')}{hint}.")


def load_tasks(
    tasks: Sequence[str] | str, splits: Sequence[str] = ("train", "validation"), cache_dir: str | None = None
) -> list[TaskData]:
    """Tasks by preset name, or a path to a task-config file (or a mix of both in a list)."""
    if isinstance(tasks, (str, os.PathLike)):
        tasks = [tasks]
    loaded = []
    for item in tasks:
        if not isinstance(item, (str, os.PathLike)):
            raise ValueError(f"A task must be a preset name or the path of a task-config JSON file, got {item!r}.")
        if Path(item).is_dir():
            raise ValueError(_directory_message(Path(item)))
        if str(item).endswith(".json") or Path(item).is_file():
            loaded.extend(load_task_config(item, splits, cache_dir))
        elif item in TASK_PRESETS:
            loaded.append(load_preset(item, splits, cache_dir))
        else:
            raise ValueError(
                f"Unknown task {item!r}: not a task-config file and not a preset; presets are {sorted(TASK_PRESETS)}."
            )
    names = [t.name for t in loaded]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"Tasks {duplicates} are given twice.")
    return loaded


# ----------------------------------------------------------------------------------------------- checking
def encode_label(spec: TaskSpec, value: Any, row: int | str, split: str = "train"):
    """The model label of one raw label; raises a ValueError naming task and row (`row`: an index, or where
    the row is, e.g. `dev.jsonl, line 7`)."""
    where = f"Task {spec.name!r}, {split} row {row}" if isinstance(row, int) else f"Task {spec.name!r}, {row}"
    if value is None:
        raise ValueError(f"{where}: the label (field {spec.label_field!r}) is missing.")
    return problem_type_of(spec).encode_label(spec, value, where)


def check_task_split(
    spec: TaskSpec, dataset, split: str, with_labels: bool = True, data: TaskData | None = None
) -> list | None:
    """Check a split before any compute: empty split, missing field, missing text, bad label. Every bad row is
    reported (`DataError`: task, file and line when known, field, value). Returns the model labels of every row
    (`encode_label`), or None without labels."""
    if dataset is None or len(dataset) == 0:
        raise DataError([f"Task {spec.name!r}: the {split} split is empty."])
    missing = [f for f in problem_type_of(spec).required_fields(spec, with_labels) if f not in dataset.column_names]
    if missing:
        raise DataError(
            [f"Task {spec.name!r}: the {split} split has no field(s) {missing}; its fields are {dataset.column_names}."]
        )
    where = (lambda row: data.where(split, row)) if data is not None else None
    kind = problem_type_of(spec)
    names = list(dict.fromkeys(kind.text_fields(spec) + ([spec.label_field] if with_labels else [])))
    problems, labels = _row_problems(spec, {name: dataset[name] for name in names}, split, with_labels, where)
    if problems:
        raise DataError(problems)
    return labels


def _row_problems(spec: TaskSpec, columns: dict[str, list], split: str, with_labels: bool, where=None,
                  skip=None) -> tuple[list[str], list | None]:
    """`check_task_split`'s checks of every row's values: `(problems, encoded labels or None)`. `columns`: the text
    fields' and the label field's values; `where(row)` names a row (default `<split> row <i>`); `skip(row, field)`:
    a value already reported (by the file's checks) is not checked again."""
    named = where is not None
    where = where or (lambda row: f"{split} row {row}")
    skip = skip or (lambda row, name: False)
    problems = []
    kind = problem_type_of(spec)
    words = kind.text_is_words
    for name in kind.text_fields(spec):
        for row, text in enumerate(columns[name]):
            if skip(row, name):
                continue
            wrong = _wrong_text(spec, words, text)  # a list here is no text (nor a pair)
            if wrong:
                problems.append(f"Task {spec.name!r}, {where(row)}: field {name!r}: {wrong}")
            elif words and text is not None and not text:
                problems.append(f"Task {spec.name!r}, {where(row)}: field {name!r} holds no words.")
            elif text is None or (not words and not text.strip() and not kind.allows_empty_text):
                problems.append(f"Task {spec.name!r}, {where(row)}: field {name!r} is empty.")
    labels = None
    if with_labels:
        labels = []
        for row, value in enumerate(columns[spec.label_field]):
            if skip(row, spec.label_field):
                labels.append(None)
                continue
            try:
                labels.append(encode_label(spec, value, where(row) if named else row, split))
            except ValueError as err:
                problems.append(str(err))
                labels.append(None)
        # what a row's label and inputs say together (token classification: one tag per word), on every row whose
        # label was read (None: a label reported above or by the file's checks)
        for row, label in enumerate(labels):
            if label is not None:
                problems.extend(kind.check_row(spec, {k: columns[k][row] for k in kind.text_fields(spec)}, label,
                                               where(row)))
    return problems, labels


def check_tasks(
    task_data: Sequence[TaskData], splits: Sequence[str], with_labels: bool = True
) -> dict[tuple[str, str], list]:
    """`check_task_split` for every task and split, the problems of all of them reported together; returns the
    encoded labels `{(task, split): labels}` (for `tokenize_task(..., labels=...)`)."""
    labels, problems = {}, []
    for t in task_data:
        for split in splits:
            if t.split(split) is None:
                continue
            try:
                labels[(t.name, split)] = check_task_split(t.spec, t.split(split), split, with_labels, data=t)
            except DataError as err:
                problems.extend(err.problems)
    if problems:
        raise DataError(problems)
    return labels


# ----------------------------------------------------------------------------------------------- tokenising
def tokenize_task(
    spec: TaskSpec,
    dataset,
    tokenizer,
    task_id: int,
    max_length: int = 128,
    split: str = "train",
    with_labels: bool = True,
    max_target_length: int = 64,
    labels: list | None = None,
    layout: str | None = None,
):
    """Model columns for one task split, made by the task's problem type (`ProblemType.tokenize`): `input_ids`,
    `attention_mask`, (`token_type_ids`), `labels`, `task_ids`, and the type's own columns (`span_positions` for
    span tasks). A multiple-choice example keeps one row holding one sequence per choice; the collator expands it.
    A `seq2seq` task's labels are the target text's token ids (at most `max_target_length`), padded with -100 by
    the collator; with `layout="causal"` (a decoder-only model: `text_to_text_layout(model)`) a row is the input text
    then the target, its labels -100 on the input text. A type may make several rows of one example (a long context
    split into windows)."""
    if labels is None:  # checked (and the labels encoded) once, reused below; `check_tasks` may have done it
        labels = check_task_split(spec, dataset, split, with_labels)
    kind = problem_type_of(spec)

    def encode(batch, indices):
        rows = kind.tokenize(
            spec, batch, [labels[i] for i in indices] if with_labels else None, tokenizer, max_length,
            lambda i: f"{split} row {indices[i]}", max_target_length=max_target_length,
            **({"layout": layout} if layout is not None else {}),
        )
        rows["task_ids"] = [task_id] * len(rows["input_ids"])
        if "labels" in rows:  # labels last, as transformers' collators expect them
            rows["labels"] = rows.pop("labels")
        return rows

    return dataset.map(
        encode,
        batched=True,
        with_indices=True,
        remove_columns=dataset.column_names,
        desc=f"Tokenising {spec.name} ({split})",
    )


# ----------------------------------------------------------------------------------------------- batching
class MultiTaskDataset(torch.utils.data.Dataset):
    """The tasks' tokenised training sets end to end (task 0 first); index i -> (task, row)."""

    def __init__(self, datasets: Sequence, task_names: Sequence[str]):
        self.datasets = list(datasets)
        self.task_names = list(task_names)
        self.sizes = [len(d) for d in self.datasets]
        self.offsets = [0, *itertools.accumulate(self.sizes[:-1])]

    def __len__(self) -> int:
        return sum(self.sizes)

    def locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} examples")
        task = bisect.bisect_right(self.offsets, index) - 1
        return task, index - self.offsets[task]

    def __getitem__(self, index: int) -> dict:
        task, row = self.locate(index)
        return self.datasets[task][row]

    def __getitems__(self, indices: list[int]) -> list[dict]:
        """One batched read per task instead of one per row (datasets' row access is the slow part)."""
        by_task: dict[int, list[tuple[int, int]]] = {}
        for pos, index in enumerate(indices):
            task, row = self.locate(index)
            by_task.setdefault(task, []).append((pos, row))
        out: list[dict | None] = [None] * len(indices)
        for task, items in by_task.items():
            for (pos, _), example in zip(items, read_rows(self.datasets[task], [row for _, row in items])):
                out[pos] = example
        return out


def read_rows(dataset, indices: list[int]) -> list[dict]:
    """Rows `indices` of `dataset`: one batched read where it has one (`datasets.Dataset.__getitems__`)."""
    return dataset.__getitems__(list(indices)) if hasattr(dataset, "__getitems__") else [dataset[i] for i in indices]
