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

`tokenize_task` turns a split into model columns (single text, text pair, multiple choice, word spans,
pre-split words for token classification); `MultiTaskDataset` concatenates the tasks' training sets for
the task sampler; `MultiTaskCollator` pads a mixed batch and carries `task_ids`.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ..layers.heads import IGNORE_INDEX
from ..tasks import TaskSpec
from ..utils import lookup

SPLITS = ("train", "validation", "test")


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


def _glue(config, text_fields, label_names=None, metrics=("accuracy",), splits=None, **spec):
    spec = {"name": config, "text_fields": list(text_fields), "metrics": list(metrics), **spec}
    if label_names:
        spec["label_names"] = list(label_names)
    return TaskPreset("nyu-mll/glue", config, spec, splits or {"train": "train", "validation": "validation", "test": "test"})


def _super_glue(config, text_fields, label_names=None, metrics=("accuracy",), **spec):
    spec = {"name": config, "text_fields": list(text_fields), "metrics": list(metrics), **spec}
    if label_names:
        spec["label_names"] = list(label_names)
    return TaskPreset("aps/super_glue", config, spec)


TASK_PRESETS: dict[str, TaskPreset] = {
    # GLUE (MT-TaG section 4.1, CA-MTL, PALs)
    "cola": _glue("cola", ["sentence"], ["unacceptable", "acceptable"], ["matthews_correlation"]),
    "sst2": _glue("sst2", ["sentence"], ["negative", "positive"]),
    "mrpc": _glue("mrpc", ["sentence1", "sentence2"], ["not_equivalent", "equivalent"], ["accuracy", "f1"]),
    "qqp": _glue("qqp", ["question1", "question2"], ["not_duplicate", "duplicate"], ["accuracy", "f1"]),
    "stsb": _glue("stsb", ["sentence1", "sentence2"], None, ["pearson", "spearmanr"], problem_type="regression"),
    "mnli": _glue(
        "mnli", ["premise", "hypothesis"], ["entailment", "neutral", "contradiction"],
        splits={"train": "train", "validation": "validation_matched", "test": "test_matched"},
    ),
    "mnli_mm": TaskPreset(
        "nyu-mll/glue", "mnli",
        {"name": "mnli_mm", "text_fields": ["premise", "hypothesis"], "label_names": ["entailment", "neutral", "contradiction"]},
        {"train": "train", "validation": "validation_mismatched", "test": "test_mismatched"},
    ),
    "qnli": _glue("qnli", ["question", "sentence"], ["entailment", "not_entailment"]),
    "rte": _glue("rte", ["sentence1", "sentence2"], ["entailment", "not_entailment"]),
    # SuperGLUE (MT-TaG GLUE++)
    "boolq": _super_glue("boolq", ["question", "passage"], ["False", "True"]),
    "cb": _super_glue("cb", ["premise", "hypothesis"], ["entailment", "contradiction", "neutral"], ["accuracy", "f1_macro"]),
    "copa": _super_glue("copa", ["premise", "question"], None, problem_type="multiple_choice", choice_fields=["choice1", "choice2"]),
    "multirc": _super_glue("multirc", ["paragraph", "question", "answer"], ["False", "True"], ["f1a"]),
    "wic": _super_glue(
        "wic", ["sentence1", "sentence2"], ["False", "True"], problem_type="span_classification",
        span_fields=[["start1", "end1"], ["start2", "end2"]],
    ),
    # sentiment and NLI tasks of MT-TaG's GLUE++ and unseen-task experiments
    "rotten_tomatoes": TaskPreset(
        "cornell-movie-review-data/rotten_tomatoes", None,
        {"name": "rotten_tomatoes", "text_fields": ["text"], "label_names": ["neg", "pos"]},
    ),
    "imdb": TaskPreset(
        "stanfordnlp/imdb", None, {"name": "imdb", "text_fields": ["text"], "label_names": ["neg", "pos"]},
        {"train": "train", "validation": "test", "test": "test"},
    ),
    "yelp_polarity": TaskPreset(
        "fancyzhx/yelp_polarity", None, {"name": "yelp_polarity", "text_fields": ["text"], "num_labels": 2},
        {"train": "train", "validation": "test", "test": "test"},
    ),
    "scitail": TaskPreset(
        "allenai/scitail", "tsv_format",
        {"name": "scitail", "text_fields": ["premise", "hypothesis"], "label_names": ["entails", "neutral"]},
    ),
}


# ----------------------------------------------------------------------------------------------- loading
@dataclass
class TaskData:
    """A task and its raw splits (`datasets.Dataset`s; a missing split is None)."""

    spec: TaskSpec
    splits: dict = field(default_factory=dict)
    source: str = ""

    @property
    def name(self) -> str:
        return self.spec.name

    def split(self, name: str):
        return self.splits.get(name)


_FILE_BUILDERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _load_file(path: Path, task: str, split: str):
    import datasets

    if not path.exists():
        raise ValueError(f"Task {task!r}: {split} file {path} does not exist.")
    suffix = path.suffix.lower()
    builder = lookup(_FILE_BUILDERS, suffix, f"file type of {path.name} (task {task!r})")
    kwargs = {"delimiter": "\t"} if suffix == ".tsv" else {}
    return datasets.load_dataset(builder, data_files={split: str(path)}, split=split, **kwargs)


def load_preset(name: str, splits: Sequence[str] = ("train", "validation"), cache_dir: str | None = None, **overrides) -> TaskData:
    """Load a preset task from the Hub (`datasets.load_dataset(dataset, config, split=...)`)."""
    import datasets

    preset = lookup(TASK_PRESETS, name, "task preset")
    spec = preset.task_spec(**overrides)
    loaded = {}
    for split in splits:
        hub_split = preset.splits.get(split)
        if hub_split is None:
            continue
        loaded[split] = datasets.load_dataset(preset.dataset, preset.config, split=hub_split, cache_dir=cache_dir)
    return TaskData(spec, loaded, f"{preset.dataset}" + (f" ({preset.config})" if preset.config else ""))


def load_task_config(path: str | os.PathLike, splits: Sequence[str] = ("train", "validation"), cache_dir: str | None = None) -> list[TaskData]:
    """Load every task of a task-config JSON file (see module docstring)."""
    path = Path(path)
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"Task config file {path} does not exist.") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"Task config file {path} is not valid JSON: {err}") from None
    entries = config.get("tasks") if isinstance(config, dict) else config
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"Task config file {path} must hold a non-empty list under `tasks`.")
    tasks = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: tasks[{i}] must be an object, got {entry!r}.")
        entry = dict(entry)
        if "preset" in entry:
            tasks.append(load_preset(entry.pop("preset"), splits, cache_dir, **entry))
            continue
        files = {s: entry.pop(f"{s}_file", None) for s in SPLITS}
        try:
            spec = TaskSpec.from_dict(entry)
        except ValueError as err:
            raise ValueError(f"{path}: tasks[{i}]: {err}") from None
        loaded = {s: _load_file(path.parent / f, spec.name, s) for s, f in files.items() if f is not None and s in splits}
        tasks.append(TaskData(spec, loaded, str(path)))
    return tasks


def load_tasks(tasks: Sequence[str] | str, splits: Sequence[str] = ("train", "validation"), cache_dir: str | None = None) -> list[TaskData]:
    """Tasks by preset name, or a path to a task-config file (or a mix of both in a list)."""
    if isinstance(tasks, (str, os.PathLike)):
        tasks = [tasks]
    loaded = []
    for item in tasks:
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
def _required_fields(spec: TaskSpec, with_labels: bool) -> list[str]:
    fields = list(spec.text_fields) + list(spec.choice_fields or [])
    for pair in spec.span_fields or []:
        fields.extend(pair)
    if with_labels:
        fields.append(spec.label_field)
    return fields


def encode_label(spec: TaskSpec, value: Any, row: int, split: str):
    """The model label of one raw label; raises a ValueError naming task, split and row."""
    where = f"Task {spec.name!r}, {split} row {row}"
    if value is None:
        raise ValueError(f"{where}: the label (field {spec.label_field!r}) is missing.")
    if spec.problem_type == "regression":
        if isinstance(value, (list, tuple)):
            if len(value) != spec.num_labels:
                raise ValueError(f"{where}: expected {spec.num_labels} regression targets, got {value!r}.")
            return [float(v) for v in value]
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: regression label {value!r} is not a number.") from None
        if not math.isfinite(number):
            raise ValueError(f"{where}: regression label {value!r} is not finite.")
        return number
    if spec.problem_type == "seq2seq":  # a target text (a class name, an answer, a summary)
        if not isinstance(value, str):
            value = str(value)
        if not value.strip():
            raise ValueError(f"{where}: the target text (field {spec.label_field!r}) is empty.")
        return value
    if spec.problem_type == "multi_label_classification":
        names = spec.label_names or []
        hot = [0] * spec.num_labels
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            idx = _class_index(spec, v, names, spec.num_labels, where)
            hot[idx] = 1
        return hot
    if spec.problem_type == "token_classification":
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: token-classification labels must be a list (one per word), got {value!r}.")
        return [_class_index(spec, v, spec.label_names or [], spec.num_labels, where) for v in value]
    return _class_index(spec, value, spec.label_names or [], spec.num_labels, where)


def _class_index(spec: TaskSpec, value: Any, names: list[str], num_classes: int, where: str) -> int:
    if isinstance(value, str):
        if value in names:
            return names.index(value)
        if value.lstrip("-").isdigit():
            value = int(value)
        else:
            allowed = names if names else list(range(num_classes))
            raise ValueError(f"{where}: label {value!r} is not one of the task's labels {allowed}.")
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or not 0 <= value < num_classes:
        allowed = names if names else list(range(num_classes))
        raise ValueError(f"{where}: label {value!r} is outside the task's label set {allowed} (indices 0..{num_classes - 1}).")
    return value


def check_task_split(spec: TaskSpec, dataset, split: str, with_labels: bool = True) -> list | None:
    """Stop early, naming task, field and row: empty split, missing field, missing text, bad label.

    Returns the model labels of every row (`encode_label`), or None without labels."""
    if dataset is None or len(dataset) == 0:
        raise ValueError(f"Task {spec.name!r}: the {split} split is empty.")
    missing = [f for f in _required_fields(spec, with_labels) if f not in dataset.column_names]
    if missing:
        raise ValueError(
            f"Task {spec.name!r}: the {split} split has no field(s) {missing}; its fields are {dataset.column_names}."
        )
    for name in list(spec.text_fields) + list(spec.choice_fields or []):
        column = dataset[name]
        for row, text in enumerate(column):
            if text is None or (isinstance(text, str) and not text.strip() and spec.problem_type != "multiple_choice"):
                raise ValueError(f"Task {spec.name!r}, {split} row {row}: field {name!r} is empty.")
    if not with_labels:
        return None
    return [encode_label(spec, value, row, split) for row, value in enumerate(dataset[spec.label_field])]


# ----------------------------------------------------------------------------------------------- tokenising
def _join(values: list[str]) -> str:
    return " ".join(v for v in values if v)


def tokenize_task(
    spec: TaskSpec, dataset, tokenizer, task_id: int, max_length: int = 128, split: str = "train", with_labels: bool = True,
    max_target_length: int = 64,
):
    """Model columns for one task split: `input_ids`, `attention_mask`, (`token_type_ids`), `labels`, `task_ids`
    (+ `span_positions` for span tasks). A multiple-choice example keeps one row holding one sequence per choice;
    the collator expands it. A `seq2seq` task's labels are the target text's token ids (at most
    `max_target_length`), padded with -100 by the collator."""
    labels = check_task_split(spec, dataset, split, with_labels)  # encoded once, reused below
    fields = spec.text_fields

    def encode(batch, indices):
        n = len(indices)
        out: dict[str, list] = {}
        if spec.problem_type == "multiple_choice":
            contexts = [_join([batch[f][i] for f in fields]) for i in range(n)]
            per_choice = [
                tokenizer(contexts, batch[c], truncation=True, max_length=max_length) for c in spec.choice_fields
            ]
            for key in per_choice[0]:
                out[key] = [[enc[key][i] for enc in per_choice] for i in range(n)]
        elif spec.problem_type == "span_classification":
            enc = tokenizer(
                *[batch[f] for f in fields[:2]], truncation=True, max_length=max_length, return_offsets_mapping=True
            )
            out.update({k: v for k, v in enc.items() if k != "offset_mapping"})
            out["span_positions"] = [
                _span_tokens(spec, enc, i, [(batch[s][i], batch[e][i]) for s, e in spec.span_fields], indices[i], split)
                for i in range(n)
            ]
        else:
            texts = [batch[f] for f in fields]
            if len(texts) > 2:  # e.g. MultiRC: (paragraph + question, answer)
                texts = [[_join([t[i] for t in texts[:-1]]) for i in range(n)], texts[-1]]
            seq2seq = spec.problem_type == "seq2seq"  # encoder-decoder inputs carry no segment ids
            out.update(tokenizer(*texts, truncation=True, max_length=max_length, **({"return_token_type_ids": False} if seq2seq else {})))
        out["task_ids"] = [task_id] * n
        if with_labels and spec.problem_type == "seq2seq":
            targets = [labels[i] for i in indices]
            out["labels"] = tokenizer(text_target=targets, truncation=True, max_length=max_target_length)["input_ids"]
        elif with_labels:
            out["labels"] = [labels[i] for i in indices]
        return out

    if spec.problem_type == "token_classification":
        return _tokenize_words(spec, dataset, tokenizer, task_id, max_length, split, labels)
    return dataset.map(encode, batched=True, with_indices=True, remove_columns=dataset.column_names, desc=f"Tokenising {spec.name} ({split})")


def _tokenize_words(spec, dataset, tokenizer, task_id, max_length, split, labels):
    """Token classification: pre-split words; `labels` are the rows' word labels from `check_task_split`."""

    def encode(batch, indices):
        enc = tokenizer(batch[spec.text_fields[0]], is_split_into_words=True, truncation=True, max_length=max_length)
        out = dict(enc)
        out["task_ids"] = [task_id] * len(indices)
        if labels is not None:
            out["labels"] = [_align_word_labels(enc.word_ids(i), labels[row]) for i, row in enumerate(indices)]
        return out

    return dataset.map(encode, batched=True, with_indices=True, remove_columns=dataset.column_names, desc=f"Tokenising {spec.name} ({split})")


def _align_word_labels(word_ids: list[int | None], word_labels: list[int]) -> list[int]:
    """Label the first word piece of each word; -100 for special tokens and continuation pieces."""
    labels, previous = [], None
    for w in word_ids:
        labels.append(word_labels[w] if w is not None and w != previous and w < len(word_labels) else IGNORE_INDEX)
        previous = w
    return labels


def _span_tokens(spec, enc, i, char_spans, row, split) -> list[list[int]]:
    """Token [start, end) of each character span; span k lies in text segment k."""
    sequence_ids = enc.sequence_ids(i)
    offsets = enc["offset_mapping"][i]
    spans = []
    for k, (start, end) in enumerate(char_spans):
        tokens = [
            t for t, (seg, (a, b)) in enumerate(zip(sequence_ids, offsets))
            if seg == k and b > a and a < int(end) and b > int(start)
        ]
        if not tokens:
            raise ValueError(
                f"Task {spec.name!r}, {split} row {row}: span {k} (characters {start}..{end}) covers no token "
                "(outside the text or truncated away)."
            )
        spans.append([tokens[0], tokens[-1] + 1])
    return spans


# ----------------------------------------------------------------------------------------------- batching
class MultiTaskDataset(torch.utils.data.Dataset):
    """The tasks' tokenised training sets end to end (task 0 first); index i -> (task, row)."""

    def __init__(self, datasets: Sequence, task_names: Sequence[str]):
        self.datasets = list(datasets)
        self.task_names = list(task_names)
        self.sizes = [len(d) for d in self.datasets]
        self.offsets = [0]
        for size in self.sizes[:-1]:
            self.offsets.append(self.offsets[-1] + size)

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
            dataset = self.datasets[task]
            rows = [row for _, row in items]
            fetched = dataset.__getitems__(rows) if hasattr(dataset, "__getitems__") else [dataset[r] for r in rows]
            for (pos, _), example in zip(items, fetched):
                out[pos] = example
        return out


class MultiTaskCollator:
    """Pads a batch that may mix tasks; a multiple-choice example becomes one row per choice (consecutive).

    Labels: a 1-D tensor when every row has one label, else a 2-D one padded with -100; float when any
    label is a float (regression), long otherwise.
    """

    model_keys = ("input_ids", "attention_mask", "token_type_ids")

    def __init__(self, pad_token_id: int = 0, pad_to_multiple_of: int | None = None):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def _rows(self, features: list[dict]) -> list[dict]:
        rows = []
        for f in features:
            ids = f["input_ids"]
            if ids and isinstance(ids[0], (list, tuple)):  # multiple choice: one row per choice
                for c in range(len(ids)):
                    rows.append({**f, **{k: f[k][c] for k in self.model_keys if k in f}})
            else:
                rows.append(f)
        return rows

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        rows = self._rows(features)
        n = len(rows)
        length = max(len(r["input_ids"]) for r in rows)
        if self.pad_to_multiple_of:
            length = math.ceil(length / self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((n, length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((n, length), dtype=torch.long)
        has_types = "token_type_ids" in rows[0]
        token_type_ids = torch.zeros((n, length), dtype=torch.long) if has_types else None
        for i, r in enumerate(rows):
            k = len(r["input_ids"])
            input_ids[i, :k] = torch.tensor(r["input_ids"])
            attention_mask[i, :k] = torch.tensor(r["attention_mask"]) if "attention_mask" in r else 1
            if has_types:
                token_type_ids[i, :k] = torch.tensor(r["token_type_ids"])
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        if has_types:
            batch["token_type_ids"] = token_type_ids
        batch["task_ids"] = torch.tensor([int(r["task_ids"]) for r in rows], dtype=torch.long)
        if "labels" in rows[0]:
            batch["labels"] = self._labels([r["labels"] for r in rows])
        if any("span_positions" in r for r in rows):
            num_spans = max(len(r.get("span_positions") or []) for r in rows)
            spans = torch.zeros((n, num_spans, 2), dtype=torch.long)
            for i, r in enumerate(rows):
                if r.get("span_positions"):
                    spans[i, : len(r["span_positions"])] = torch.tensor(r["span_positions"])
            batch["span_positions"] = spans
        return batch

    @staticmethod
    def _labels(labels: list) -> torch.Tensor:
        is_float = any(isinstance(v, float) or (isinstance(v, list) and any(isinstance(x, float) for x in v)) for v in labels)
        dtype = torch.float32 if is_float else torch.long
        if not any(isinstance(v, (list, tuple)) for v in labels):
            return torch.tensor(labels, dtype=dtype)
        width = max(len(v) if isinstance(v, (list, tuple)) else 1 for v in labels)
        out = torch.full((len(labels), width), IGNORE_INDEX, dtype=dtype)
        for i, v in enumerate(labels):
            values = v if isinstance(v, (list, tuple)) else [v]
            out[i, : len(values)] = torch.tensor(values, dtype=dtype)
        return out
