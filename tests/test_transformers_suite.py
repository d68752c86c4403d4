"""transformers' own `ModelTesterMixin` for every method class (the harness: tests/transformers_suite.py).

Runs only where `HF_TASKMOE_TRANSFORMERS_TESTS` names the unpacked `tests/` folder of the installed transformers'
sdist (`.ci/run` sets it up); otherwise the module skips with the reason, so a plain `pytest` stays offline.
`HF_TASKMOE_TRANSFORMERS_CASES` (comma-separated case names of `transformers_suite.CASES`) narrows the run.
"""

from __future__ import annotations

import os

import pytest

from . import transformers_suite as suite

_reason = suite.why_not_available()
if _reason:
    pytest.skip(_reason, allow_module_level=True)

_wanted = [n for n in os.environ.get("HF_TASKMOE_TRANSFORMERS_CASES", "").split(",") if n]
_unknown = set(_wanted) - set(suite.CASES)
if _unknown:
    raise ValueError(f"HF_TASKMOE_TRANSFORMERS_CASES: no such case {sorted(_unknown)}; cases: {list(suite.CASES)}")

for _name, _cls in suite.test_classes(suite.load_model_tester_mixin()).items():
    if not _wanted or _name.removeprefix("Test") in _wanted:
        globals()[_name] = _cls
del _name, _cls  # pytest collects every TestCase subclass a module name holds


def test_refusals_name_real_tests_and_cases():
    """A refusal of a test the mixin does not have, or of a case that does not exist, is a stale entry."""
    mixin = suite.load_model_tester_mixin()
    for test_name, reasons in suite.REFUSALS.items():
        assert callable(getattr(mixin, test_name, None)), test_name
        assert set(reasons) <= {suite.ALL, *suite.CASES}, (test_name, reasons)
        assert all(len(reason) > 20 for reason in reasons.values()), (test_name, reasons)
