"""A training step and a mixed-task generation of task routing with low-rank experts, against peft LoRA (issue 56's
goals: a step's peak memory within 1.15x of one peft LoRA with as many trainable parameters, its time within 1.3x of
one peft LoRA of rank `r`; hard-routed generation of a mixed batch within 1.3x of the dense model and faster than
peft's mixed-adapter batch of the exported adapters).

Shapes: SmolLM2-135M's (`LlamaConfig`: hidden 576, FFN 1536, 30 layers, 9 heads, 3 key/value heads, vocabulary 49152,
tied embeddings; random weights, `--layers` shrinks it), one fixed batch of `--rows` x `--seq` random tokens whose
rows cycle over 4 tasks. The training configurations, each built and stepped (forward, backward, AdamW) in a fresh
subprocess so that its peak memory is its own:

- `routed_hard`: `TaskRoutedForCausalLM.from_dense(..., expert_rank=r, num_experts=4, selection="hard")`, deltas on
  every projection of every layer, base frozen (the one-expert-per-row path);
- `routed_gumbel_st`: the same with `selection="gumbel_softmax_st"` (straight-through: the mixing path, every
  expert's delta computed);
- `lora_r`: `peft.get_peft_model` with `LoraConfig(r=r, target_modules=[q, k, v, o, gate, up, down])`;
- `lora_4r`: the same at rank `4 * r` (as many delta parameters as the 4 experts);
- `dense_full`: the dense model with every weight trained (a reference: what the frozen base saves).

Peak memory is the child's peak resident set (`VmHWM` of /proc/self/status) over the timed steps, reset
(`/proc/self/clear_refs`) once the model is built, so building (which briefly holds the dense model and the routed
one) does not count; it includes the weights, activations, gradients and AdamW's state. Step time is the median over
`--steps` steps after one warm-up, over `--repeats` rounds in which the configurations run alternately (the order
rotates each round), and the median process CPU time of the same steps (`cpu_s`: on cores other programs share, wall
time swings with their load, several-fold with `--threads 2`, whose threads wait on each other; CPU time at `--threads
1` does much less). Ratios are to `lora_r` and to `lora_4r`. Before the peak is reset the heap's free memory is handed
back (`malloc_trim`), so the dense model a routed one was built from is not counted.

Generation (`--generation`, in its own child): a routed low-rank model with `selection="hard"` (random deltas and
router, as training would leave them), its `export_task_adapters` read back as a base (the dense model) and as
peft's `PeftModel` with one adapter per task, greedy on one batch of `--rows` prompts of `--prompt` tokens over 4
tasks, `--new` new tokens: the routed model, the dense base, and peft's mixed-adapter batch (`adapter_names`),
alternated, `--gen_repeats` times each; median wall seconds and median process CPU seconds of each call, their
ratios to dense (on shared cores the CPU time is the steadier of the two), and whether peft's greedy tokens equal the
routed model's. `--only-generation` runs this child alone.

    python benchmarks/low_rank_step.py                 # 30 layers (slow on a CPU)
    python benchmarks/low_rank_step.py --layers 6      # quicker
    python benchmarks/low_rank_step.py --smoke         # tiny shapes, seconds
    python benchmarks/low_rank_step.py --layers 6 --threads 1 --only-generation   # the generation child alone

A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from low_rank_evidence import _status, _trim_heap  # noqa: E402  (/proc/self/status fields, malloc_trim)

CONFIGS = ["routed_hard", "routed_gumbel_st", "lora_r", "lora_4r", "dense_full"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NUM_TASKS = 4


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set (Linux >= 4.0)


def dense_config(args):
    from transformers import LlamaConfig

    if args.smoke:
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers or 2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
                           tie_word_embeddings=True)
    return LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers or 30,
                       num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                       tie_word_embeddings=True)


def _tasks():
    from hf_taskmoe import TaskSpec

    return [TaskSpec(name=f"t{i}", problem_type="seq2seq") for i in range(NUM_TASKS)]


def build(name: str, args):
    """The model of configuration `name` and whether its forward takes `task_ids`."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    dense = LlamaForCausalLM(dense_config(args))
    if name == "dense_full":
        return dense, False
    if name in ("lora_r", "lora_4r"):
        from peft import LoraConfig, get_peft_model

        r = args.rank if name == "lora_r" else args.experts * args.rank
        return get_peft_model(dense, LoraConfig(r=r, lora_alpha=r, target_modules=TARGETS)), False
    from hf_taskmoe.models.task_routing import TaskRoutedForCausalLM

    selection = {"routed_hard": "hard", "routed_gumbel_st": "gumbel_softmax_st"}[name]
    model = TaskRoutedForCausalLM.from_dense(dense, _tasks(), num_experts=args.experts, expert_rank=args.rank,
                                             selection=selection)
    return model, True


def batch(args, rows: int, seq: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, vocab, (rows, seq), generator=g)
    tasks = torch.arange(rows) % NUM_TASKS
    return ids, tasks


def child_step(name: str, args) -> dict:
    """Build configuration `name`, then `1 + --steps` training steps; peak memory over the steps, their times."""
    import gc

    import torch

    torch.set_num_threads(args.threads)
    model, routed = build(name, args)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    ids, tasks = batch(args, args.rows, args.seq, dense_config(args).vocab_size)
    kwargs = {"input_ids": ids, "labels": ids}
    if routed:
        kwargs["task_ids"] = tasks
    gc.collect()
    _trim_heap()
    _reset_peak()
    before = _status("VmRSS")
    times, cpu = [], []
    for step in range(1 + args.steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        model(**kwargs).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:  # the first step is a warm-up (allocations, AdamW's state)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return {"config": name, "peak_bytes": _status("VmHWM"), "built_bytes": before, "step_s": times, "cpu_s": cpu,
            "trainable": sum(p.numel() for p in params), "stored": sum(p.numel() for p in model.parameters())}


def child_generation(args) -> dict:
    """Routed hard model vs the dense base vs peft's mixed-adapter batch of the exported adapters (module docstring)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from hf_taskmoe.models.task_routing import TaskRoutedForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = dense_config(args)
    model = TaskRoutedForCausalLM.from_dense(LlamaForCausalLM(cfg), _tasks(), num_experts=args.experts,
                                             expert_rank=args.rank, selection="hard").eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # random deltas and router, as training would leave them: the tasks take different experts
        for n, p in model.named_parameters():
            if n.endswith(".lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            elif n.startswith("router."):
                p.add_(torch.randn(p.shape, generator=g))
    names = [t.name for t in _tasks()]
    routes = {tuple(model.hard_route(t)) for t in names}
    ids, tasks = batch(args, args.rows, args.prompt, cfg.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        model.export_task_adapters(Path(tmp) / "out")
        dense = AutoModelForCausalLM.from_pretrained(Path(tmp) / "out" / "base").eval()
        base = AutoModelForCausalLM.from_pretrained(Path(tmp) / "out" / "base").eval()
        peft_model = PeftModel.from_pretrained(base, Path(tmp) / "out" / names[0], adapter_name=names[0])
        for task in names[1:]:
            peft_model.load_adapter(Path(tmp) / "out" / task, adapter_name=task)
        peft_model.eval()
    kwargs = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)
    runs = {
        "routed_hard": lambda: model.generate(ids, task_ids=tasks, **kwargs),
        "dense": lambda: dense.generate(input_ids=ids, **kwargs),
        "peft_mixed": lambda: peft_model.generate(input_ids=ids, adapter_names=[names[t] for t in tasks], **kwargs),
    }
    order = list(runs)
    times = {k: [] for k in order}
    cpu = {k: [] for k in order}
    out = {}
    with torch.no_grad():
        for k in order:  # warm-up
            out[k] = runs[k]()
        for rep in range(args.gen_repeats):
            for k in order[rep % len(order):] + order[:rep % len(order)]:
                start, start_cpu = time.perf_counter(), time.process_time()
                runs[k]()
                times[k].append(time.perf_counter() - start)
                cpu[k].append(time.process_time() - start_cpu)
    median = {k: statistics.median(v) for k, v in times.items()}
    median_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    return {
        "rows": args.rows, "tasks": NUM_TASKS, "distinct_routes": len(routes), "prompt": args.prompt, "new": args.new,
        "threads": args.threads, "repeats": args.gen_repeats,
        "seconds": {k: round(v, 4) for k, v in median.items()},
        "ratio_to_dense": {k: round(v / median["dense"], 3) for k, v in median.items()},
        "cpu_seconds": {k: round(v, 4) for k, v in median_cpu.items()},
        "cpu_ratio_to_dense": {k: round(v / median_cpu["dense"], 3) for k, v in median_cpu.items()},
        "peft_tokens_equal_routed": bool(torch.equal(out["peft_mixed"], out["routed_hard"])),
        "all_seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "all_cpu_seconds": {k: [round(x, 4) for x in v] for k, v in cpu.items()},
    }


def _run_child(argv: list[str]) -> dict:
    done = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"child {argv} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _print_generation(gen: dict) -> None:
    print(f"generation of {gen['rows']} rows, {gen['new']} new tokens ({gen['threads']} threads, median of "
          f"{gen['repeats']}):")
    print(f"{'model':<14}{'wall s':>9}{'x dense':>9}{'cpu s':>9}{'x dense':>9}")
    for k, v in gen["seconds"].items():
        print(f"{k:<14}{v:>9.3f}{gen['ratio_to_dense'][k]:>9.3f}{gen['cpu_seconds'][k]:>9.3f}"
              f"{gen['cpu_ratio_to_dense'][k]:>9.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 30; 2 with --smoke)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per child, after one warm-up")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of one child per configuration")
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    parser.add_argument("--generation", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--only_generation", "--only-generation", action="store_true",
                        help="the generation child alone, no training step")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--gen_repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (hidden 64, 2 layers, vocabulary 256)")
    parser.add_argument("--machine", default="", help="a label written into the JSON")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "generation":
        print(json.dumps(child_generation(args)))
        return
    if args.child:
        print(json.dumps(child_step(args.child, args)))
        return

    passthrough = [a for a in (argv if argv is not None else sys.argv[1:])
                   if a not in ("--no-generation", "--only_generation", "--only-generation")]
    cfg = dense_config(args)
    if args.only_generation:
        gen = _run_child([*passthrough, "--child", "generation"])
        _print_generation(gen)
        print(json.dumps({"machine": args.machine, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                          "rank": args.rank, "experts": args.experts, "generation": gen}))
        return
    runs = {c: [] for c in args.configs}
    for rep in range(args.repeats):
        shift = rep % len(args.configs)
        for name in args.configs[shift:] + args.configs[:shift]:
            runs[name].append(_run_child([*passthrough, "--child", name]))
    rows = {}
    for name, results in runs.items():
        steps = [t for r in results for t in r["step_s"]]
        rows[name] = {
            "trainable": results[0]["trainable"], "stored": results[0]["stored"],
            "peak_mib": round(statistics.median(r["peak_bytes"] for r in results) / 2**20, 1),
            "built_mib": round(statistics.median(r["built_bytes"] for r in results) / 2**20, 1),
            "step_s": round(statistics.median(steps), 4), "all_step_s": [round(t, 4) for t in steps],
            "cpu_s": round(statistics.median(t for r in results for t in r["cpu_s"]), 4),
        }
    for ref in ("lora_r", "lora_4r"):
        if ref in rows:
            for row in rows.values():
                row[f"peak_x_{ref}"] = round(row["peak_mib"] / rows[ref]["peak_mib"], 3)
                row[f"step_x_{ref}"] = round(row["step_s"] / rows[ref]["step_s"], 3)
                row[f"cpu_x_{ref}"] = round(row["cpu_s"] / rows[ref]["cpu_s"], 3)
    print(f"{'config':<18}{'trainable':>12}{'peak MiB':>10}{'step s':>9}{'cpu s':>8}{'mem/r':>7}{'mem/4r':>8}"
          f"{'t/r':>7}{'t/4r':>7}{'cpu/r':>7}")
    for name, row in rows.items():
        print(f"{name:<18}{row['trainable']:>12,}{row['peak_mib']:>10.1f}{row['step_s']:>9.3f}{row['cpu_s']:>8.3f}"
              f"{row.get('peak_x_lora_r', float('nan')):>7.3f}{row.get('peak_x_lora_4r', float('nan')):>8.3f}"
              f"{row.get('step_x_lora_r', float('nan')):>7.3f}{row.get('step_x_lora_4r', float('nan')):>7.3f}"
              f"{row.get('cpu_x_lora_r', float('nan')):>7.3f}")
    result = {
        "machine": args.machine, "threads": args.threads, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
        "rows": args.rows, "seq": args.seq, "rank": args.rank, "experts": args.experts, "steps": args.steps,
        "repeats": args.repeats, "train": rows,
    }
    if args.generation:
        gen = _run_child([*passthrough, "--child", "generation"])
        _print_generation(gen)
        result["generation"] = gen
    print(json.dumps(result))


if __name__ == "__main__":
    main()
