"""`benchmarks/gpu.py` runs on a machine without a GPU: at tiny shapes on the CPU (a smoke run, its timings mean
nothing), every section it is asked for gives its figures, and its last line is the JSON object of the run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

# out of the default run for its time: .ci/run runs it (`pytest -m ci`)
pytestmark = pytest.mark.ci

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_gpu_benchmark_smoke_run_on_the_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    run = subprocess.run(
        [sys.executable, "gpu.py", "--device", "cpu", "--sections", "train,infer,profile,compile,generate,peft",
         "--families", "mt_dense,mt_tag,pals,camtl", "--compile-families", "bert_seq_cls,mt_tag",
         "--generate-models", "llama", "--out", str(out)],
        cwd=BENCHMARKS, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == json.loads(out.read_text())
    sections = result["sections"]
    assert not [name for name, figures in sections.items() if "error" in figures], sections
    for precision in ("fp32", "bf16"):
        assert set(sections["train"][f"train_{precision}_ratio"]) == {"bert_seq_cls", "mt_dense", "mt_tag", "pals",
                                                                        "camtl"}
    assert sections["profile"]["kernels"]["mt_tag"] > sections["profile"]["kernels"]["bert_seq_cls"]
    # the default MT-TaG ("auto" dispatch: the grouped GEMM when compiled in bf16) compiles into one graph with labels,
    # and a second task mix does not recompile
    assert sections["compile"]["mt_tag"]["ok"], sections["compile"]
    generate = sections["generate"]["llama_generate_ratio"]
    assert set(generate) == {"dense", "routed_one_task", "routed_mixed", "routed_mixed_per_expert", "export_task"}
    assert "peft_lora_8_adapters_mixed" in sections["peft"]["infer_4x16_ratio"]

    table = subprocess.run([sys.executable, "gpu.py", "--report", str(out)], cwd=BENCHMARKS, capture_output=True,
                           text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    assert "| train: train_bf16 | mt_tag |" in table.stdout


def test_profile_gives_mt_tag_experts_floor():
    """The profile of MT-TaG's grouped GEMM profiles it again with one expert fewer (`experts_floor`): on the CPU its
    figure is the aten operations, which an expert more does not add to (one grouped product over every expert)."""
    run = subprocess.run(
        [sys.executable, "gpu.py", "--device", "cpu", "--sections", "profile", "--families", "mt_tag_grouped_mm"],
        cwd=BENCHMARKS, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    profile = json.loads(run.stdout.strip().splitlines()[-1])["sections"]["profile"]
    assert set(profile["kernels"]) == {"bert_seq_cls", "mt_tag_grouped_mm", "mt_tag_grouped_mm_one_expert_fewer"}
    assert profile["params_M"]["mt_tag_grouped_mm_one_expert_fewer"] < profile["params_M"]["mt_tag_grouped_mm"]
    assert profile["experts_floor"] == {"per_expert_kernels": 0, "kernels_floor_ratio": 1.0}
    assert profile["kernels_ratio"]["mt_tag_grouped_mm"] > 1.0
