"""Checkpoints saved by earlier code still load (issue 45, item 2): `tests/fixtures/legacy/<name>/` holds a tiny
`BertWithPALs`, `CAMTLModel` and `BartTaskRouted` as those classes saved them, with a fixed batch
and the logits they gave (`tests/fixtures/make_legacy_checkpoints.py` wrote them; it is not rerun here). Through
`AutoModel` and through the class's own `from_pretrained`, each must come back as that class with every saved
tensor bit for bit, nothing missing or left over, and the saved logits on the saved batch.

When a refactor changes a layout (issue 45 folds these classes into the backbone-generic ones), these files are the
old layout: the loader must convert them, and this test must keep passing against the unchanged files. A class whose
layout changed declares the renaming as `checkpoint_key_mapping` (`{old-name regex: replacement}`, applied in turn, as
transformers' `from_pretrained(key_mapping=...)` applies it); each saved tensor is looked up under its renamed name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModel

import hf_taskmoe  # noqa: F401  (registers the Auto classes)
from hf_taskmoe import BartTaskRouted, BertWithPALs, CAMTLModel

LEGACY = Path(__file__).parent / "fixtures" / "legacy"
#: one training step of some of those checkpoints as the class that saved them took it
#: (`tests/fixtures/make_legacy_steps.py`)
STEPS = Path(__file__).parent / "fixtures" / "legacy_steps"
CLASSES = {"bert_pals": BertWithPALs, "camtl": CAMTLModel,
           "bart_task_routed": BartTaskRouted}
# logits are compared to 1e-6, not bit for bit (the weights, which involve no arithmetic, are): loaded tensors sit at
# other memory alignments than freshly built ones, and CPU kernels round differently on them (CAMTLModel's task `b`:
# 1.5e-8 on the machine that wrote the files, same weights bit for bit), and another CPU's kernels may differ again
ATOL = 1e-6
def current_name(cls, name: str) -> str:
    """A name of the checkpoint's layout in the class's current layout: through the key map the class declares
    (`checkpoint_key_mapping`, applied by its `from_pretrained` as transformers' `key_mapping`: each pattern in turn,
    as transformers chains renamings); a class that kept its layout declares none."""
    for pattern, replacement in (getattr(cls, "checkpoint_key_mapping", None) or {}).items():
        name = re.sub(pattern, replacement, name, count=1)
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
    # the checkpoint's names, in the class's layout: a class that now has another layout (BertWithPALs: its BERT
    # under `backbone.`, its PALs under `pals.`) renames them on load, and declares how (`checkpoint_key_mapping`)
    saved = {current_name(cls, k): v for k, v in load_file(folder / "model.safetensors").items()}
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


@pytest.mark.parametrize("name", sorted(p.stem for p in STEPS.glob("*.safetensors")))
def test_a_legacy_checkpoint_takes_the_training_step_its_class_took(name):
    """The training step recorded with the class that wrote the checkpoint (dropout 0 there, so deterministic): the
    same loss, per-task losses and gradient of every parameter, to 1e-6, whatever implementation the class has now."""
    cls = CLASSES[name]
    step = load_file(STEPS / f"{name}.safetensors")
    with safe_open(STEPS / f"{name}.safetensors", "pt") as f:
        assert f.metadata()["class"] == cls.__name__
    model = cls.from_pretrained(LEGACY / name).train()
    batch, _ = saved_outputs(name)
    out = model(**batch, labels=step["labels"])
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), step["loss"], atol=ATOL, rtol=0)
    expected_losses = {k[len("task_loss."):]: v for k, v in step.items() if k.startswith("task_loss.")}
    assert set(out.task_losses) == set(expected_losses)
    for task, loss in expected_losses.items():
        torch.testing.assert_close(out.task_losses[task].detach(), loss, atol=ATOL, rtol=0)
    expected = {current_name(cls, k[len("grad."):]): v for k, v in step.items() if k.startswith("grad.")}
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(expected)
    for param, grad in expected.items():
        torch.testing.assert_close(got[param], grad, atol=ATOL, rtol=0, msg=lambda m, p=param: f"{name} {p}: {m}")


def test_the_key_maps_leave_names_of_the_current_layout_alone(tmp_path):
    """A class that renames an earlier layout on load must not rename its own: a model saved now (in the current
    layout) loads again, through the class and through `AutoModel`, bit for bit."""
    for name, cls in CLASSES.items():
        model = cls.from_pretrained(LEGACY / name)
        assert all(current_name(cls, key) == key for key in model.state_dict()), name
        model.save_pretrained(tmp_path / name)
        for loaded in (cls.from_pretrained(tmp_path / name), AutoModel.from_pretrained(tmp_path / name)):
            assert type(loaded) is cls
            state = loaded.state_dict()
            assert state.keys() == model.state_dict().keys()
            assert all(torch.equal(state[k], v) for k, v in model.state_dict().items()), name
