"""`import hf_taskmoe` in a fresh interpreter: what it loads, what it exports, and that registration with the Auto
classes and the pipelines still happens as a side effect (the other public names load lazily)."""

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _fresh(code: str) -> dict:
    """Run `code` in a new interpreter (the repository first on the path); it prints one JSON object last."""
    env_path = f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
    result = subprocess.run([sys.executable, "-c", env_path + code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@functools.cache  # one fresh interpreter answers every test below: what a bare import loads never changes in a run
def _loaded_after_import() -> frozenset:
    return frozenset(_fresh("import json, sys\nimport hf_taskmoe\n"
                            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} | set(sys.modules))))"))


@pytest.mark.parametrize("module", ["matplotlib", "sklearn", "pandas", "datasets", "evaluate",
                                    "hf_taskmoe.analysis", "hf_taskmoe.training"])
def test_import_does_not_load_heavy_optional_modules(module):
    assert module not in _loaded_after_import()


@pytest.mark.xfail(strict=True, reason="transformers' own PreTrainedModel (transformers.loss) imports scipy, and the "
                   "families register their model classes eagerly; needs lazy model registration (see issue 32)")
def test_import_does_not_load_scipy():
    assert "scipy" not in _loaded_after_import()


def test_dir_lists_all_and_every_public_name_resolves():
    out = _fresh("""
import json, hf_taskmoe, hf_taskmoe.analysis, hf_taskmoe.training
report = {}
for package in (hf_taskmoe, hf_taskmoe.analysis, hf_taskmoe.training):
    missing_from_dir = sorted(set(package.__all__) - set(dir(package)))
    unresolved = [n for n in package.__all__ if getattr(package, n, None) is None]
    report[package.__name__] = [missing_from_dir, unresolved, len(package.__all__)]
try:
    hf_taskmoe.not_a_name
except AttributeError as error:
    report["error"] = str(error)
print(json.dumps(report))
""")
    for package in ("hf_taskmoe", "hf_taskmoe.analysis", "hf_taskmoe.training"):
        missing_from_dir, unresolved, count = out[package]
        assert missing_from_dir == [] and unresolved == [] and count > 0, package
    assert out["error"] == "module 'hf_taskmoe' has no attribute 'not_a_name'"


@pytest.mark.ci
def test_a_bare_import_registers_the_families_and_pipelines(tmp_path):
    # save a tiny model in one interpreter, load it through the Auto classes in a fresh one after `import hf_taskmoe`
    _fresh(f"""
import json
from hf_taskmoe import BertForTaskMoE, BertTaskMoEConfig, TaskSpec
config = BertTaskMoEConfig(tasks=[TaskSpec(name="a", num_labels=3)], vocab_size=99, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=37, num_experts=2)
BertForTaskMoE(config).save_pretrained({str(tmp_path)!r})
print(json.dumps({{}}))
""")
    out = _fresh(f"""
import json
import hf_taskmoe
from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM
from transformers.pipelines import PIPELINE_REGISTRY
model = AutoModel.from_pretrained({str(tmp_path)!r})
bart = dict(model_type="bart", vocab_size=60, d_model=16, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=32,
            decoder_ffn_dim=32, encoder_attention_heads=2, decoder_attention_heads=2, max_position_embeddings=40)
config = AutoConfig.for_model("taskmoe_routed_t5", tasks=[{{"name": "t", "problem_type": "seq2seq"}}],
                              dense_config=bart)
seq2seq = AutoModelForSeq2SeqLM.from_config(config)
print(json.dumps({{"model": type(model).__name__, "config": type(config).__name__, "seq2seq": type(seq2seq).__name__,
                  "families": sorted(hf_taskmoe.FAMILIES), "pipelines": PIPELINE_REGISTRY.get_supported_tasks()}}))
""")
    assert out["model"] == "TaskMoEForMultiTask"  # a saved BertForTaskMoE is the MT-TaG family's model
    assert out["config"] == "TaskRoutedSeq2SeqConfig" and out["seq2seq"] == "TaskRoutedForSeq2SeqLM"
    assert set(out["families"]) == {"taskmoe", "pals", "camtl", "task_routing", "mmoe"}  # one family per method
    assert {"multitask-text-classification", "multitask-text2text-generation"} <= set(out["pipelines"])
