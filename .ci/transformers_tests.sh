#!/usr/bin/env bash
# CI's step for transformers' own model tests (.ci/run runs it after the README's test command; it also runs alone):
# the sdist of the installed transformers release carries tests/test_modeling_common.py (ModelTesterMixin), which
# the wheel does not. Download it once into a cache under ${TMPDIR:-/tmp}, unpack only tests/ and PKG-INFO (the
# harness checks the release), and run tests/test_transformers_suite.py over every method class
# (tests/transformers_suite.py: the testers, the stand-ins for the folders the sdist lacks, the refusals).
# HF_TASKMOE_TRANSFORMERS_CASES narrows the classes (comma-separated names of transformers_suite.CASES).
# Measured (this script, all 10 classes, transformers 5.24.0): 223 s of tests, 274 s with the download, on a 2-core
# machine shared with other jobs (load average 14); the slowest tests are test_bc_torch_dtype (17 s BART, 16 s T5).
# Six more cases run the routed classes on architectures declared later (transformers_suite.NEW_ARCH_CASES: Gemma 2,
# OLMo 2, Qwen3, Phi-3, UMT5, mBART): 57 s for gemma2 + umt5 and 68 s for the other four, run narrowed as above.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
version=$("$python" -c "import transformers; print(transformers.__version__)")
cache="${TMPDIR:-/tmp}/hf-taskmoe-transformers-sdist/${version}"
tests="${cache}/transformers-${version}/tests"
if [ ! -f "${tests}/test_modeling_common.py" ]; then
  mkdir -p "${cache}"
  "$python" -m pip download "transformers==${version}" --no-binary :all: --no-deps -d "${cache}"
  tar xzf "${cache}/transformers-${version}.tar.gz" -C "${cache}" \
    "transformers-${version}/tests" "transformers-${version}/PKG-INFO"
fi
# test_modeling_common.py imports `parameterized` (transformers' own test extra)
"$python" -c "import parameterized" 2>/dev/null || "$python" -m pip install parameterized
HF_TASKMOE_TRANSFORMERS_TESTS="${tests}" "$python" -m pytest -q -p no:cacheprovider tests/test_transformers_suite.py "$@"
