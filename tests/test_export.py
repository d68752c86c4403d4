"""`export_for_remote_code`: a flat folder that loads with `trust_remote_code=True` where hf_taskmoe is not
importable (checked in a subprocess that blocks the import) and gives identical outputs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard

from hf_taskmoe import BertForTaskMoE, BertWithPALs, MMoEModel
from hf_taskmoe.hub import bundle_source, export_for_remote_code

from .conftest import random_batch, tiny_config
from .test_bart_routed import batch as seq2seq_batch
from .test_bart_routed import routed as bart_routed
from .test_bert_pals import pals_config
from .test_camtl import _model as camtl_model
from .test_mmoe import batch as tabular_batch
from .test_mmoe import config as mmoe_config

LOADER = Path(__file__).parent / "fixtures" / "load_remote_code.py"
FAMILIES = {
    "bert_taskmoe": (lambda: BertForTaskMoE(tiny_config(num_experts=3)), lambda m: random_batch(m.config)),
    "bert_pals": (lambda: BertWithPALs(pals_config(pal_decoder_init="normal")), lambda m: random_batch(m.config)),
    "camtl": (camtl_model, lambda m: random_batch(m.config)),
    "mmoe": (lambda: MMoEModel(mmoe_config()), lambda m: {k: v for k, v in tabular_batch().items() if k != "labels"}),
    "bart_routed": (
        lambda: bart_routed("gumbel_softmax_st"),
        lambda m: {k: v for k, v in seq2seq_batch().items() if k != "labels"},
    ),
}


@pytest.fixture(scope="module")
def exports(tmp_path_factory, minilm):
    """Every family exported into its own folder, then loaded by one fresh interpreter that cannot import hf_taskmoe
    (one process start for the five, each export from its own folder)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("exports")
    tokenizer = AutoTokenizer.from_pretrained(minilm)
    made, args = {}, []
    for family, (build, make_batch) in FAMILIES.items():
        torch.manual_seed(0)
        model = build().eval()
        folder = export_for_remote_code(
            model,
            root / f"export_{family}",
            tokenizer=tokenizer,
            metrics={f"eval_{model.config.task_names[0]}_{model.config.task_specs[0].metrics[0]}": 0.5},
        )
        autos = ["AutoModel"] + (["AutoModelForSeq2SeqLM"] if family == "bart_routed" else [])
        batch = make_batch(model)
        torch.save(batch, root / f"batch_{family}.pt")
        made[family] = (model, folder, autos, batch, root / f"out_{family}.pt")
        args += [str(folder), str(root / f"batch_{family}.pt"), str(root / f"out_{family}.pt"), autos[-1]]
    env = dict(os.environ, HF_MODULES_CACHE=str(root / "modules"), HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, str(LOADER), *args], capture_output=True, text=True, env=env, cwd=root, timeout=600
    )
    return made, result


@pytest.mark.ci
@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_loads_without_hf_taskmoe_and_gives_identical_outputs(family, exports):
    made, result = exports
    model, folder, autos, batch, out_path = made[family]
    files = sorted(p.name for p in folder.iterdir())
    stem = f"modeling_{model.config.model_type}"
    assert f"{stem}.py" in files and "model.safetensors" in files and "tokenizer.json" in files and "README.md" in files
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": f"{stem}.{type(model.config).__name__}",
        **{a: f"{stem}.{type(model).__name__}" for a in autos},
    }
    assert getattr(model.config, "auto_map", None) is None  # the live model's config is left as it was
    card = ModelCard.load(folder / "README.md")
    assert len(card.data.eval_results) == 1 and type(model).__name__ in card.content

    assert result.returncode == 0, result.stderr[-3000:]
    loaded = torch.load(out_path)
    assert "error" not in loaded, loaded.get("error")
    assert not loaded["hf_taskmoe_imported"]
    assert loaded["class"].startswith("transformers_modules.") and loaded["class"].endswith(type(model).__name__)
    with torch.no_grad():
        out = model(**batch)
    expected = out.task_logits if hasattr(out, "task_logits") else {"lm": out.logits}
    if model.config.is_encoder_decoder:  # the remote class generates with task_ids as the package's does
        assert torch.equal(loaded["generated"], model.generate(**batch, max_new_tokens=5, num_beams=2, do_sample=False))
    assert set(loaded["task_logits"]) == set(expected)
    for name, logits in expected.items():
        torch.testing.assert_close(
            loaded["task_logits"][name], logits, atol=1e-6, rtol=1e-5
        )  # another process: BLAS may split work differently


def test_bundle_is_self_contained_and_refuses_shadowed_names(monkeypatch):
    import ast

    source = bundle_source(BertForTaskMoE)
    imports = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert imports and not any(getattr(n, "level", 0) for n in imports)  # no relative import
    assert not any((getattr(n, "module", None) or "").startswith("hf_taskmoe") for n in imports)
    assert not any(a.name.startswith("hf_taskmoe") for n in imports for a in n.names)
    import hf_taskmoe.hub as hub

    real = hub._strip_internal_imports
    monkeypatch.setattr(hub, "_strip_internal_imports", lambda m: (real(m)[0], real(m)[1] | {"clash"}))
    with pytest.raises(RuntimeError, match="`clash` is defined in both"):
        bundle_source(MMoEModel)
