"""Checkpoints saved by earlier code still load (issue 45, item 2): `tests/fixtures/legacy/<name>/` holds a tiny
`BertForTaskMoE`, `BertWithPALs`, `CAMTLModel` and `BartTaskRouted` as those classes saved them, with a fixed batch
and the logits they gave (`tests/fixtures/make_legacy_checkpoints.py` wrote them; it is not rerun here). Through
`AutoModel` and through the class's own `from_pretrained`, each must come back as that class with every saved
tensor bit for bit, nothing missing or left over, and the saved logits on the saved batch.

When a refactor changes a layout (issue 45 folds these classes into the backbone-generic ones), these files are the
old layout: the loader must convert them, and this test must keep passing against the unchanged files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModel

import hf_taskmoe  # noqa: F401  (registers the Auto classes)
from hf_taskmoe import BartTaskRouted, BertForTaskMoE, BertWithPALs, CAMTLModel
from hf_taskmoe.models.task_routing.modeling_seq2seq import LEGACY_BART_KEYS

LEGACY = Path(__file__).parent / "fixtures" / "legacy"
CLASSES = {"bert_taskmoe": BertForTaskMoE, "bert_pals": BertWithPALs, "camtl": CAMTLModel,
           "bart_task_routed": BartTaskRouted}
# logits are compared to 1e-6, not bit for bit (the weights, which involve no arithmetic, are): loaded tensors sit at
# other memory alignments than freshly built ones, and CPU kernels round differently on them (CAMTLModel's task `b`:
# 1.5e-8 on the machine that wrote the files, same weights bit for bit), and another CPU's kernels may differ again
ATOL = 1e-6
#: the declared conversion of a fixture's weight names to the class's today (the loader applies the same map)
KEY_MAPS = {"bart_task_routed": LEGACY_BART_KEYS}


def current_name(name: str, fixture: str) -> str:
    for pattern, replacement in KEY_MAPS.get(fixture, {}).items():
        name = re.sub(pattern, replacement, name)
    return name


def saved_outputs(name: str) -> tuple[dict, dict]:
    tensors = load_file(LEGACY / name / "outputs.safetensors")
    batch = {k[len("input."):]: v for k, v in tensors.items() if k.startswith("input.")}
    logits = {k: v for k, v in tensors.items() if k.startswith("logits")}
    return batch, logits


def test_the_fixtures_are_tiny_and_complete():
    assert sorted(p.name for p in LEGACY.iterdir()) == sorted(CLASSES)
    assert sum(f.stat().st_size for f in LEGACY.rglob("*") if f.is_file()) < 200_000
    for name, cls in CLASSES.items():
        with safe_open(LEGACY / name / "outputs.safetensors", "pt") as f:
            assert f.metadata()["class"] == cls.__name__


@pytest.mark.parametrize("loader", ["AutoModel", "class"])
@pytest.mark.parametrize("name", list(CLASSES))
def test_a_legacy_checkpoint_loads_to_its_weights_and_logits(name, loader):
    cls = CLASSES[name]
    folder = LEGACY / name
    if loader == "AutoModel":
        model = AutoModel.from_pretrained(folder)
    else:
        model, info = cls.from_pretrained(folder, output_loading_info=True)
        assert not any(info.values()), info  # nothing missing, unexpected, mismatched or erroneous
    assert type(model) is cls
    saved = {current_name(k, name): v for k, v in load_file(folder / "model.safetensors").items()}
    state = model.state_dict()
    for key, tensor in saved.items():
        assert key in state, f"{key} is in the checkpoint but not in the model"
        assert state[key].dtype == tensor.dtype and torch.equal(state[key], tensor), key
    for key in set(state) - set(saved):  # only a tied weight (BART's embeddings, LM head) may be left off the file
        assert any(state[key].data_ptr() == state[other].data_ptr() for other in saved), f"{key} was not loaded"
    batch, expected = saved_outputs(name)
    with torch.no_grad():
        out = model.eval()(**batch)
    got = {"logits": out.logits} if cls is BartTaskRouted else {f"logits.{t}": v for t, v in out.task_logits.items()}
    assert set(got) == set(expected)
    for key, logits in expected.items():
        torch.testing.assert_close(got[key], logits, atol=ATOL, rtol=0, msg=lambda m, key=key: f"{name} {key}: {m}")
