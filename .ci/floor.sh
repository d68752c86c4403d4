#!/usr/bin/env bash
# CI's floor step (.ci/run runs it last; it also runs alone): the oldest transformers, peft and accelerate that
# pyproject.toml declares (.ci/floor_versions.py), tested in a second environment made over the first one, the Python
# this script is started with (`python` on PATH, or $PYTHON): the family, generation, pipeline, export and compat tests.
#
# The second environment is a plain venv whose site-packages holds one .pth file that adds the first environment's
# site-packages after its own (site.addsitedir, so their .pth files, the editable install's included, work too). It
# sees every package of the first environment, torch included; pip installs into it only the floors and what they
# need in other versions, which then come first on sys.path. torch is pinned to the first environment's own build
# (a constraint), so a second torch is never resolved. This works the same whether the first Python is a venv (the
# README's set-up) or not (CI's): `python -m venv --system-site-packages` would share the *base* interpreter's
# packages instead, which, started from a venv, lacks torch, datasets and the rest.
#
# Checked (issue 44 item 1) from a fresh venv, as the README sets a machine up:
# python3 -m venv /tmp/v && . /tmp/v/bin/activate
# && pip install torch==2.13.0 && pip install -e ".[test]" && pip install --no-deps -r requirements-offline.txt &&
# .ci/floor.sh. It installed transformers 5.10.4, peft 0.18.0, accelerate 1.5.2 and, in the versions they need,
# huggingface_hub 1.33.0, tokenizers 0.22.2, httpx 0.28.1 and httpcore 1.0.9 into the floor environment, no torch,
# and the floor tests passed (729 passed, 36 skipped). Checked too as from a Python that is not a venv (CI's): the
# base interpreter with that venv's packages as its user site (PYTHONUSERBASE, PYTHON=<base python>), no torch
# installed, tests/test_compat.py passed.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
floors=$("$python" .ci/floor_versions.py)
echo "floor environment: ${floors}"
venv="${TMPDIR:-/tmp}/hf-taskmoe-floor-venv"
rm -rf "$venv"
"$python" -m venv "$venv"
# the first environment's site directories (a venv's one; a system Python's several, and its user site if enabled)
first_sites=$("$python" -c 'import os, site
dirs = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
print("\n".join(d for d in dirs if os.path.isdir(d)))')
floor_site=$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
while IFS= read -r dir; do
  printf 'import site; site.addsitedir(%s)\n' "$("$python" -c 'import sys; print(repr(sys.argv[1]))' "$dir")"
done <<< "$first_sites" > "$floor_site/hf_taskmoe_first_env.pth"
# never a second torch: the first environment's build is the only one pip may choose
torch_version=$("$python" -c 'import torch; print(torch.__version__)')
constraints="$venv/torch-constraint.txt"
echo "torch==${torch_version}" > "$constraints"
# --no-warn-conflicts: pip would list the dependencies of the data packages the first environment installed with
# --no-deps on purpose (requirements-offline.txt) as conflicts; a floor that does not work fails the tests below
# shellcheck disable=SC2086
"$venv/bin/pip" install -q --no-warn-conflicts -c "$constraints" ${floors}
echo "installed into the floor environment (the rest comes from the first one):"
"$venv/bin/pip" list --path "$floor_site" --format freeze | grep -v -E '^(pip|setuptools)==' | sed 's/^/  /'
"$venv/bin/python" - "$floor_site" <<'EOF'
import sys

import accelerate
import peft
import torch
import transformers

if torch.__file__.startswith(sys.argv[1]):
    sys.exit(f"a second torch was installed into the floor environment: {torch.__file__}")
print("tested at the floor: transformers", transformers.__version__, "peft", peft.__version__, "accelerate",
      accelerate.__version__, "(torch", torch.__version__, "of the first environment)")
EOF
# the tests given as arguments, or the floor set
tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
  tests=(tests/test_compat.py tests/test_families.py tests/test_bart_generation.py tests/test_bart_routed.py
    tests/test_pipeline.py tests/test_export.py tests/test_ecosystem.py tests/test_trainer.py tests/test_backbones.py
    tests/test_backbones_pals.py tests/test_backbones_camtl.py tests/test_task_routed_lm.py
    tests/test_task_routed_t5.py tests/test_host_syncs_backbones.py tests/test_family_registry.py)
fi
"$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}"
