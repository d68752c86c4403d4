"""The explicit package list in pyproject.toml must name every subpackage (a missing one would be left
out of the wheel), and the data files the library reads at run time must be declared."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "hf_taskmoe").rglob("__init__.py")}
    assert found - listed == set(), f"add to pyproject.toml [tool.setuptools] packages: {sorted(found - listed)}"
    assert config["package-dir"]["hf_taskmoe.model_cards"] == "model_cards"


def test_runtime_data_files_are_declared():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "metric_modules/*/*.py" in config["hf_taskmoe"]
    assert list((ROOT / "hf_taskmoe" / "metric_modules").glob("*/*.py"))
    assert "*.md" in config["hf_taskmoe.model_cards"] and (ROOT / "model_cards" / "multitask_model_card.md").exists()
