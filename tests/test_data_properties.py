"""Property: every row of a task file is either loaded exactly as written or refused naming its file and line.

Hypothesis writes task files (JSON lines, JSON arrays, CSV) whose texts hold quotes, commas, line breaks, tabs and the
Unicode separators `str.splitlines` splits at (U+2028, U+2029, U+0085, ...), and whose labels are valid or not
(class names, positions, booleans, floats, out-of-range and look-alike values such as "²", lists, nulls, missing
labels, a column mixing names and positions). An oracle written from the rules (TaskSpec docstring: a label is a
class name or a 0-based position, integers that could be either are refused, booleans match by name) says which
rows are valid. Then:

- a file without an invalid row loads, and every text, label and line number equals what was written;
- a file with one is refused (`DataError`) and every problem names a line that holds an invalid row: no valid row
  is blamed, and no invalid row is trained on.

Derandomized and small (`max_examples`), so the suite stays deterministic and fast.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hf_taskmoe.training.data import DataError, check_tasks, load_task_config

SETTINGS = settings(max_examples=80, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])

LABEL_SETS = [["neg", "pos"], ["True", "False"], ["1", "0"], ["a", "b", "c"]]
MISSING = object()  # the row has no label field at all

# characters that break naive readers: delimiters, quotes, CR/LF, and what str.splitlines also splits at
TRICKY = list(',;"\'\t\r\n \\') + [
    "\r\n",
    "\u2028",
    "\u2029",
    "\x85",
    "\x1c",
    "\x1d",
    "\x1e",
    "\x0b",
    "\x0c",
    "\ufeff",
    "é",
    "²",
    "🙂",
]
pieces = st.lists(
    st.one_of(st.sampled_from(TRICKY), st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=4)),
    max_size=6,
).map("".join)
# mostly a word among tricky characters (a text to train on); sometimes only tricky ones (maybe empty: refused)
texts = st.one_of(
    pieces,
    st.tuples(pieces, st.text("abcXYZ 0123", min_size=1, max_size=4).filter(str.strip), pieces).map("".join),
    st.tuples(pieces, st.sampled_from(["word", "say \"hi\", ok", "a\nb", "x\u2028y"])).map("".join),
)


def json_labels(names):
    valid = st.one_of(st.sampled_from(names), st.integers(0, len(names) - 1))
    return st.one_of(valid, valid, valid, any_json_label(names))  # mostly valid: files that load are common too


def any_json_label(names):
    return st.one_of(
        st.sampled_from(names),  # a class name
        st.integers(-1, len(names)),  # a position, or just outside the range
        st.sampled_from(
            [True, False, 0.0, 1.0, 1.5, -1.0, float("nan"), 1e300, 2**64, None, MISSING, "", "²", "0", "1", "7", "x"]
        ),
        st.lists(st.sampled_from(names + [0, 1]), max_size=2),
        texts,
    )


def csv_labels(names):
    valid = st.sampled_from(names + [str(i) for i in range(len(names))])
    return st.one_of(valid, valid, valid, st.sampled_from(["0", "1", "2", "-1", "", " 1", "²", "1.0", "x"]), texts)


def expected_class(value, names):
    """The class a raw label means under the documented rules, or None when the row must be refused."""
    if value is MISSING or value is None:
        return None
    if isinstance(value, bool):  # by name only
        for name in ("True", "true") if value else ("False", "false"):
            if name in names:
                return names.index(name)
        return None
    if isinstance(value, str):
        if value in names:
            return names.index(value)
        if not re.fullmatch(r"-?[0-9]+", value):
            return None
        value = int(value)
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            return None
        value = int(value)
    if not isinstance(value, int) or not 0 <= value < len(names):
        return None
    if str(value) in names and names.index(str(value)) != value:  # position 0 or the class named "0"?
        return None
    return value


def json_kind(value):
    """How a JSON value is written; a column must be written one way (Arrow holds one type per column)."""
    if value is MISSING or value is None:
        return None
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "text"
    kinds = {json_kind(v) for v in value}
    return "list" if not kinds else "mixed" if len(kinds) > 1 else f"list of {kinds.pop()}"


def invalid_rows(rows, names, kinds=True):
    """Indices of the rows the oracle refuses: an empty text, a label that is no class, or (JSON) a label written
    as another kind than the first row's."""
    bad, first_kind = set(), None
    for i, (text, label) in enumerate(rows):
        if not text.strip() or expected_class(label, names) is None:
            bad.add(i)
        kind = json_kind(label) if kinds else None
        if kind is not None:
            if first_kind is None or (first_kind == "list" and kind.startswith("list")):
                first_kind = kind
            elif kind != first_kind and not (kind == "list" and first_kind.startswith("list")):
                bad.add(i)
    return bad


def check_file(name, content, rows, starts, names):
    """Load `content` (file `name`) as a task's train split; apply the property."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / name).write_bytes(content.encode("utf-8"))
        entry = {"name": "t", "text_fields": ["text"], "label_names": names, "train_file": name}
        (tmp / "tasks.json").write_text(json.dumps({"tasks": [entry]}))
        bad = invalid_rows(rows, names, kinds=not name.endswith(".csv"))
        try:
            tasks = load_task_config(tmp / "tasks.json", splits=("train",))
            labels = check_tasks(tasks, ["train"])[("t", "train")]
        except DataError as err:
            named = set()
            for problem in err.problems:
                found = re.search(rf"{re.escape(name)}, line (\d+)", problem)
                assert found, f"a problem names no line of {name}: {problem}"
                named.add(int(found.group(1)))
            bad_lines = {starts[i] for i in bad}
            assert bad, f"a valid file was refused: {err}"
            assert named <= bad_lines, f"valid rows were blamed: lines {sorted(named - bad_lines)}\n{err}"
            event("refused")
            return
        assert not bad, f"rows {sorted(bad)} were loaded, not refused: {[rows[i] for i in sorted(bad)]}"
        (task,) = tasks
        assert task.split("train")["text"] == [text for text, _ in rows]
        assert labels == [expected_class(label, names) for _, label in rows]
        assert task.lines["train"] == starts
        event("loaded")


@st.composite
def jsonl_files(draw):
    names = draw(st.sampled_from(LABEL_SETS))
    rows = draw(st.lists(st.tuples(texts, json_labels(names)), min_size=1, max_size=6))
    newline = draw(st.sampled_from(["\n", "\r\n"]))
    ascii_only = draw(st.booleans())
    parts, starts, line = [], [], 1
    for text, label in rows:
        while draw(st.integers(0, 4)) == 4:  # blank lines between rows are skipped
            parts.append(newline)
            line += 1
        obj = {"text": text} if label is MISSING else {"text": text, "label": label}
        parts.append(json.dumps(obj, ensure_ascii=ascii_only) + newline)
        starts.append(line)
        line += 1
    return names, rows, starts, "".join(parts)


@given(jsonl_files())
@SETTINGS
def test_jsonl_rows_load_as_written_or_are_refused_by_line(case):
    names, rows, starts, content = case
    check_file("train.jsonl", content, rows, starts, names)


@given(st.sampled_from(LABEL_SETS).flatmap(lambda names: st.tuples(
    st.just(names), st.lists(st.tuples(texts, json_labels(names)), min_size=1, max_size=5))))
@SETTINGS
def test_json_array_rows_load_as_written_or_are_refused_by_line(case):
    names, rows = case
    items = [
        json.dumps({"text": t} if label is MISSING else {"text": t, "label": label}, ensure_ascii=False)
        for t, label in rows
    ]
    content = (
        "[\n" + ",\n".join(items) + "\n]\n"
    )  # item i starts on line i + 2 (U+2028 inside a string is no line break)
    check_file("train.json", content, rows, [i + 2 for i in range(len(rows))], names)


@st.composite
def csv_files(draw):
    names = draw(st.sampled_from(LABEL_SETS))
    rows = draw(st.lists(st.tuples(texts, csv_labels(names)), min_size=1, max_size=6))
    quoting = draw(st.sampled_from([csv.QUOTE_MINIMAL, csv.QUOTE_ALL]))
    out = io.StringIO(newline="")
    writer = csv.writer(out, quoting=quoting, lineterminator="\r\n")  # RFC 4180: CRLF, so cells holding CR are quoted
    bom = "\ufeff" if draw(st.booleans()) else ""
    writer.writerow(["text", "label"])
    starts = []
    for text, label in rows:
        # a record starts after every line break written so far (CRLF, CR or LF, as csv and editors count them)
        starts.append(len(re.findall(r"\r\n|\r|\n", out.getvalue())) + 1)
        writer.writerow([text, label])
    return names, rows, starts, bom + out.getvalue()


@given(csv_files())
@SETTINGS
def test_csv_rows_load_as_written_or_are_refused_by_line(case):
    names, rows, starts, content = case
    check_file("train.csv", content, rows, starts, names)


def test_the_oracle_agrees_with_the_documented_examples():
    """The oracle itself, on the cases the issue names (so a wrong oracle cannot make the properties vacuous)."""
    assert expected_class(True, ["True", "False"]) == 0 and expected_class(False, ["True", "False"]) == 1
    assert expected_class(True, ["neg", "pos"]) is None and expected_class("²", ["neg", "pos"]) is None
    assert (
        expected_class("1", ["1", "0"]) == 0
        and expected_class(1, ["1", "0"]) is None
        and expected_class(1, ["neg", "pos"]) == 1
    )
    assert expected_class([0, 1], ["neg", "pos"]) is None and expected_class(1.5, ["neg", "pos"]) is None
    assert invalid_rows([("a", "pos"), ("b", 0)], ["neg", "pos"]) == {1}  # a column mixing names and positions
    assert invalid_rows([("a", "pos"), (" \u2028", "neg")], ["neg", "pos"]) == {1}  # a text of separators only


@st.composite
def token_files(draw):
    names = draw(st.sampled_from([["O", "B", "I"], ["0", "1"]]))
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        word = st.tuples(pieces, st.sampled_from(["Ann", "x", "é", "🙂", "0"]), pieces).map("".join)
        words = [] if draw(st.integers(0, 9)) == 9 else draw(st.lists(word, min_size=1, max_size=4))
        size = len(words) if draw(st.integers(0, 4)) else draw(st.integers(0, 5))  # mostly one tag per word
        tags = [draw(st.sampled_from(names)) if draw(st.integers(0, 12)) else draw(st.sampled_from(["X", "²", "7"]))
                for _ in range(size)]
        if draw(st.integers(0, 19)) == 19:  # tags written as positions: another kind than names
            tags = [i for i, _ in enumerate(tags)]
        rows.append((words, tags))
    return names, rows


@given(token_files())
@SETTINGS
def test_token_rows_load_as_written_or_are_refused_by_line(case):
    names, rows = case
    content = "".join(json.dumps({"text": w, "label": t}, ensure_ascii=False) + "\n" for w, t in rows)
    bad, first_kind = set(), None
    for i, (words, tags) in enumerate(rows):
        if not words or len(words) != len(tags) or any(expected_class(t, names) is None for t in tags):
            bad.add(i)
        kind = json_kind(tags)
        if first_kind is None or (first_kind == "list" and kind != "list"):
            first_kind = kind
        elif kind not in (first_kind, "list"):
            bad.add(i)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "tok.jsonl").write_text(content, encoding="utf-8")
        entry = {"name": "t", "problem_type": "token_classification", "text_fields": ["text"], "label_names": names,
                 "train_file": "tok.jsonl"}
        (tmp / "tasks.json").write_text(json.dumps({"tasks": [entry]}))
        try:
            tasks = load_task_config(tmp / "tasks.json", splits=("train",))
            labels = check_tasks(tasks, ["train"])[("t", "train")]
        except DataError as err:
            named = {int(m.group(1)) for p in err.problems for m in [re.search(r"tok.jsonl, line (\d+)", p)] if m}
            assert len(named) and all("tok.jsonl, line " in p for p in err.problems), err
            assert bad and named <= {i + 1 for i in bad}, err
            event("refused")
            return
    assert not bad, f"rows {sorted(bad)} were loaded, not refused"
    assert tasks[0].split("train")["text"] == [w for w, _ in rows]
    assert labels == [[expected_class(t, names) for t in tags] for _, tags in rows]
    event("loaded")
