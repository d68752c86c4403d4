"""Two processes with torchrun (gloo, CPU) train each family while experts, heads, PALs and routes sit idle on some
ranks: DDP with a static graph (find_unused_parameters=False, the default)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "distributed" / "ddp_train.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DDP_RUNS = [
    ("bert_taskmoe", False), ("bert_pals", False), ("camtl", False), ("bart_routed", False),
    ("bert_pals", True),  # the user's old setting still works (DDP marks idle parameters itself)
]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """The five DDP runs below in one torchrun launch, one after the other (each in its own folder): two processes
    start once instead of five times, which was most of each run's time."""
    out = tmp_path_factory.mktemp("ddp")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    runs = ",".join(family + ("+find_unused" if find_unused else "") for family, find_unused in DDP_RUNS)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        str(SCRIPT),
        str(out),
        runs,
    ]
    return out, subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.ci
@pytest.mark.parametrize("family, find_unused", DDP_RUNS)
def test_torchrun_two_processes_static_graph_with_idle_task_modules(ddp_runs, family, find_unused):
    out, result = ddp_runs
    folder = out / (family + ("+find_unused" if find_unused else ""))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world"] == 2 and r["find_unused_parameters"] is find_unused for r in ranks)
    # one task per rank and step (the other heads got no rows there), and the ranks saw different batches
    assert all(len(set(batch)) == 1 for r in ranks for batch in r["seen"])
    assert ranks[0]["seen"] != ranks[1]["seen"]
    # per-task losses are reduced over the ranks: a log holds the tasks both ranks trained on
    assert any(len(logged) == 2 for logged in ranks[0]["task_losses"])
    assert ranks[0]["task_losses"] == ranks[1]["task_losses"]
    # DDP kept the replicas identical
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=1e-9, abs=1e-9)


@pytest.fixture(scope="module")
def zero2_runs(tmp_path_factory):
    """ZeRO-2 of both families below in one torchrun launch, one after the other (each in its own folder).

    The shipped configuration as written, but for `"torch_adam": true` in its optimizer's parameters: DeepSpeed still
    builds its AdamW from the file's optimizer section (the Trainer filling the "auto" values), with torch's kernel
    instead of DeepSpeed's C++ CPU Adam, which it would JIT-compile on a fresh machine first (about 25 s on an idle
    2-core machine, 150 s on a busy one: the default run's largest single cost)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[test]' installs it)")
    out = tmp_path_factory.mktemp("zero2")
    shipped = json.loads((Path(__file__).resolve().parents[1] / "examples" / "deepspeed" / "zero2.json").read_text())
    assert shipped["optimizer"]["type"] == "AdamW" and "torch_adam" not in shipped["optimizer"]["params"]
    shipped["optimizer"]["params"]["torch_adam"] = True
    config = out / "zero2_torch_adam.json"
    config.write_text(json.dumps(shipped))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(SCRIPT), str(out), "bert_taskmoe,bart_routed", str(config)]
    return out, subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.ci
@pytest.mark.parametrize("family", ["bert_taskmoe", "bart_routed"])
def test_deepspeed_zero2_on_a_task_mixture(zero2_runs, family):
    """ZeRO-2 through the Trainer (`deepspeed=examples/deepspeed/zero2.json`) on CPU, each rank a different task per
    step: every rank reduces the same gradient buckets, and the replicas stay identical."""
    out, result = zero2_runs
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((out / family / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["zero_stage"] == 2 and r["world"] == 2 for r in ranks)
    assert ranks[0]["seen"] != ranks[1]["seen"]  # different tasks on the two ranks
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=1e-9, abs=1e-9)


@pytest.mark.ci
def test_mt_uncertainty_selects_across_ranks(tmp_path):
    """MT-Uncertainty under DDP takes the most uncertain candidates of all ranks' pools, not of each rank's."""
    script = Path(__file__).parent / "distributed" / "uncertainty_select.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(script), str(tmp_path)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"select{r}.json").read_text()) for r in (0, 1)]
    # globally: the eight uncertain candidates, six from rank 0 and two from rank 1
    assert ranks[0]["global"] == [0] * 6 and ranks[1]["global"] == [0] * 2
    # each rank alone: its own top 4 (rank 1 has to take two confident ones)
    assert ranks[0]["alone"] == [0, 0, 0, 0] and sorted(ranks[1]["alone"]) == [0, 0, 9, 9]


def _sharded_run(tmp_path, family, engine, mode):
    script = Path(__file__).parent / "distributed" / "sharded_train.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(script), str(tmp_path), family, engine, mode]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


def _killed_and_resumed_equals_uninterrupted(tmp_path, family, engine):
    """An uninterrupted 8-step run, then the same run SIGKILLed at step 5 (checkpoint-3 saved, sharded) and resumed:
    the resumed run's losses at steps 4-8 and its final (gathered) weights are the uninterrupted run's."""
    full = _sharded_run(tmp_path, family, engine, "full")
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]
    (tmp_path / "run").rename(tmp_path / "run-full")
    killed = _sharded_run(tmp_path, family, engine, "kill")
    assert killed.returncode != 0 and "SIGKILL" in killed.stdout + killed.stderr  # a real kill -9, no clean exit
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-3"]
    resumed = _sharded_run(tmp_path, family, engine, "resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    runs = {m: [json.loads((tmp_path / f"{m}{r}.json").read_text()) for r in (0, 1)] for m in ("full", "resume")}
    reference, after = runs["full"][0], runs["resume"][0]
    assert all(r["world"] == 2 for rs in runs.values() for r in rs)
    # mixed-task batches, and a task one rank trains in a step is absent from the other rank's batch at some step
    seen = [r["seen"] for r in runs["full"]]
    assert any(len(set(batch)) > 1 for batch in seen[0] + seen[1])
    assert any(set(a) != set(b) for a, b in zip(*seen))
    assert sorted(map(int, reference["losses"])) == list(range(1, 9))
    assert len(set(reference["losses"].values())) > 1  # it trained: the losses moved
    for step in range(4, 9):  # the steps the resumed run trained itself
        assert after["losses"][str(step)] == pytest.approx(reference["losses"][str(step)], rel=1e-6, abs=1e-7)
    assert after["checksum"] == pytest.approx(reference["checksum"], rel=1e-7)
    return runs


@pytest.mark.parametrize("family, unit, count", [
    # (three 2-process runs take about 100 s on a busy 2-core machine: .ci/run's own steps run both families)
    pytest.param("task_moe", "FSDPBertLayer", 2, marks=pytest.mark.ci),
    pytest.param("routed_llama", "FSDPContextRoutedLayer", 2, marks=pytest.mark.slow),
])
def test_fsdp2_sharded_checkpoint_kill_and_resume(tmp_path, family, unit, count):
    """FSDP2 through accelerate (`fsdp_config(model)`: one `fully_shard` unit per declared block, a routed layer whole
    with its experts), on 2 CPU processes (gloo), mixed-task batches that leave heads idle on a rank; checkpoints are
    torch distributed checkpoints, one shard file per rank. The routed LM is a slow case:
    `pytest -m slow tests/test_distributed.py -k "fsdp2 or zero3"` runs it with ZeRO-3's."""
    runs = _killed_and_resumed_equals_uninterrupted(tmp_path, family, "fsdp2")
    for r in runs["full"] + runs["resume"]:
        assert r["fsdp"] and r["wrapper"].startswith("FSDP") and r["units"][unit] == count
    shards = tmp_path / "run" / "checkpoint-3" / "pytorch_model_fsdp_0"
    assert sorted(p.name for p in shards.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


@pytest.mark.slow
def test_deepspeed_zero3_routed_lm_kill_and_resume(tmp_path):
    """DeepSpeed ZeRO-3 (`examples/deepspeed/zero3.json`, `DS_ACCELERATOR=cpu`, gloo) on the routed Llama: every
    expert runs in a training forward, so every rank gathers the same shards. Slow (DeepSpeed's start-up, three
    2-process runs): `pytest -m slow tests/test_distributed.py -k zero3`."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[test]' installs it)")
    config = str(Path(__file__).resolve().parents[1] / "examples" / "deepspeed" / "zero3.json")
    runs = _killed_and_resumed_equals_uninterrupted(tmp_path, "routed_llama", config)
    assert all(r["zero_stage"] == 3 and r["wrapper"] == "DeepSpeedEngine" for rs in runs.values() for r in rs)
    assert any(p.name.startswith("global_step") for p in (tmp_path / "run" / "checkpoint-3").iterdir())


def _zero_config(tmp_path, stage: int = 3) -> str:
    """`examples/deepspeed/zero<stage>.json` without its optimizer and scheduler: the Trainer's AdamW and linear
    schedule, those of the DDP reference."""
    name = f"zero{stage}.json"
    config = json.loads((Path(__file__).resolve().parents[1] / "examples" / "deepspeed" / name).read_text())
    del config["optimizer"], config["scheduler"]
    (tmp_path / name).write_text(json.dumps(config))
    return str(tmp_path / name)


def _ddp_reference(tmp_path, family, seen) -> dict:
    """The uninterrupted run under DDP (nothing sharded) on the same batches as the sharded run (`seen`)."""
    (tmp_path / "ddp").mkdir()
    ddp = _sharded_run(tmp_path / "ddp", family, "ddp", "full")
    assert ddp.returncode == 0, ddp.stdout[-3000:] + ddp.stderr[-3000:]
    reference = [json.loads((tmp_path / "ddp" / f"full{r}.json").read_text()) for r in (0, 1)]
    assert reference[0]["wrapper"] == "DistributedDataParallel" and [r["seen"] for r in reference] == seen
    return reference[0]


def _equal_runs(run, reference):
    for step in range(1, 9):
        assert run["losses"][str(step)] == pytest.approx(reference["losses"][str(step)], rel=1e-5)
    assert run["checksum"] == pytest.approx(reference["checksum"], rel=1e-6)


@pytest.mark.slow
def test_deepspeed_zero3_encoder_family_kill_and_resume_equals_ddp(tmp_path):
    """DeepSpeed ZeRO-3 (`DS_ACCELERATOR=cpu`, gloo) on MT-TaG (`TaskMoEForMultiTask`), mixed-task batches that leave
    a task's head without rows on a rank, and in some steps on both: every head runs in every forward, an absent
    task's on no row (`sharding.run_every_task`, which the trainer applies under ZeRO-3), so the ranks gather and
    reduce the same parameters. Killed at step 5 and resumed from the ZeRO-3 checkpoint-3, the losses and weights are
    the uninterrupted run's; and that run is DDP's (nothing sharded, the same AdamW and schedule: the configuration
    is `examples/deepspeed/zero3.json` without its optimizer and scheduler, so the Trainer's are used) step for step:
    an absent task's head gets what DDP gives it (a zero gradient). Slow: `pytest -m slow tests/test_distributed.py
    -k zero3`."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[test]' installs it)")
    (tmp_path / "zero3").mkdir()
    runs = _killed_and_resumed_equals_uninterrupted(tmp_path / "zero3", "task_moe", _zero_config(tmp_path))
    assert all(r["zero_stage"] == 3 and r["wrapper"] == "DeepSpeedEngine" for rs in runs.values() for r in rs)
    assert any(p.name.startswith("global_step") for p in (tmp_path / "zero3" / "run" / "checkpoint-3").iterdir())
    seen = [r["seen"] for r in runs["full"]]
    assert any(len(set(a) | set(b)) < 3 for a, b in zip(*seen))  # a step without some task on either rank
    _equal_runs(runs["full"][0], _ddp_reference(tmp_path, "task_moe", seen))


@pytest.mark.slow
@pytest.mark.parametrize("family, stage", [("pals", 3), ("camtl", 3), ("task_moe", 2)])
def test_deepspeed_zero3_and_zero2_equal_ddp(tmp_path, family, stage):
    """PALs (whose per-task PALs sit out with their task, like the heads) and CA-MTL under ZeRO-3, and MT-TaG under
    ZeRO-2, on 2 processes, mixed-task batches: the losses of 8 steps and the final weights are DDP's. ZeRO-2 packs
    gradients into its buckets in the order they arrive, so it too needs every rank to run the same heads (before,
    the ranks' different task mixes made it sum one parameter's gradient with another's: 7 of 8 losses differed from
    DDP's). Slow: `pytest -m slow tests/test_distributed.py -k zero3`."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[test]' installs it)")
    (tmp_path / "zero").mkdir()
    result = _sharded_run(tmp_path / "zero", family, _zero_config(tmp_path, stage), "full")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / "zero" / f"full{r}.json").read_text()) for r in (0, 1)]
    assert all(r["zero_stage"] == stage and r["world"] == 2 for r in ranks)
    seen = [r["seen"] for r in ranks]
    assert any(set(a) != set(b) for a, b in zip(*seen))
    _equal_runs(ranks[0], _ddp_reference(tmp_path, family, seen))


@pytest.fixture(scope="module")
def low_rank_runs(tmp_path_factory):
    """The routed Llama with low-rank experts (`expert_rank=4`, hard routes, dense weights frozen) trained 8 steps
    under DDP (the reference), FSDP2 (a routed layer's frozen base and trainable deltas in one `fully_shard` unit) and
    DeepSpeed ZeRO-3 (the Trainer's AdamW), each a 2-process run on the same mixed-task batches."""
    out = tmp_path_factory.mktemp("low_rank")
    runs, results = {}, {}
    for engine in ("ddp", "fsdp2", "zero3"):
        if engine == "zero3":
            pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[test]' installs it)")
        folder = out / engine
        folder.mkdir()
        name = _zero_config(folder) if engine == "zero3" else engine
        results[engine] = _sharded_run(folder, "routed_llama_low_rank", name, "full")
        if results[engine].returncode == 0:
            runs[engine] = [json.loads((folder / f"full{r}.json").read_text()) for r in (0, 1)]
    return runs, results


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp2", "zero3"])
def test_low_rank_frozen_base_under_ddp_fsdp2_and_zero3(low_rank_runs, engine):
    """Low-rank experts over a frozen base on 2 CPU processes: after 8 steps the frozen weights (gathered) are
    bit-identical to the start, the optimizer holds state for the trainable parameters only (the ranks' shards
    together cover exactly the trainable elements under FSDP2; ZeRO-3 pads its flat partition at most to its
    alignment), the loss went down, and FSDP2's and ZeRO-3's losses and final weights are DDP's. Slow:
    `pytest -m slow tests/test_distributed.py -k low_rank`."""
    runs, results = low_rank_runs
    result = results[engine]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = runs[engine]
    first = ranks[0]
    assert all(r["world"] == 2 for r in ranks)
    assert first["frozen_numel"] > 0 and first["frozen_missing"] == []
    assert first["frozen_unchanged"] and all(first["frozen_unchanged"].values()), first["frozen_unchanged"]
    held = [r["optimizer_numel"] for r in ranks]
    trainable = first["trainable_numel"]
    if engine == "ddp":
        assert held == [trainable, trainable]
        assert first["wrapper"] == "DistributedDataParallel"
    elif engine == "fsdp2":
        assert sum(held) == trainable and all(held)
        assert first["fsdp"] and first["units"]["FSDPContextRoutedLayer"] == 2
    else:
        assert first["zero_stage"] == 3 and trainable <= sum(held) < trainable + 2 * 64
    losses = [first["losses"][str(s)] for s in range(1, 9)]
    assert sum(losses[-3:]) < sum(losses[:3]), losses  # it learned
    if engine != "ddp":
        _equal_runs(first, runs["ddp"][0])
