"""Four ways to serve a task-routed LM, side by side in one process: generation throughput on one mixed-task batch.

Model: a random Llama (default 4 layers x 256, 8 heads, 4 key/value heads, FFN 2.6875 x hidden, vocabulary 2000),
every layer forked into 3 experts, 4 tasks, `selection="hard"`; the batch's rows take the tasks in turn. Variants:

- `routed`: the routed model's own `generate` (hard routes: each layer runs only the experts its rows use, each on
  its rows);
- `peft_mixed`: the export of `export_task_adapters(rank=--rank)` loaded with transformers + peft, one adapter name per
  row (`adapter_names`): what a LoRA serving engine batches;
- `export_task`: one plain model per task (`export_task`), each generating its own rows (N copies of the weights);
- `dense`: the Llama it was forked from, on the whole batch (the floor: no routing at all).

Greedy, key/value cache, exactly `--new` new tokens from `--prompt`-token prompts. Each figure is the median over
rounds of a block of calls, the variants alternating order every round. On a CUDA device the models run in bf16 (fp32
on the CPU) and the clock waits for the device. At Llama 16 x 1024 shapes on a GPU:

    python benchmarks/routed_serving.py --layers 16 --hidden 1024 --heads 16 --kv-heads 8 --batch 16 --prompt 128 \\
        --new 64

Progress goes to stderr, one line per phase with its seconds (`[  12.3 s] export: 8.1 s`: the time since the start,
then the phase's own), the adapters' export timed alone (`export_s` in the JSON, with the subspace iterations it
took). `--budget-s` bounds a run (a short GPU session): after the warm-up and the first timed round, a further round
starts only if the time so far plus the last round's stays within the budget; `--variants` leaves variants out. For
one GPU figure at the Llama shapes above: `--rounds 3 --repeats 1 --budget-s 120`.

Prints a table (wall ms per call, generated tokens per second, ratio to the dense model; the process's CPU time and its
ratio, steadier on a shared CPU), then one JSON line (`rounds_done`, and `partial: true` where the budget cut rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_taskmoe import TaskRoutedForCausalLM, TaskSpec  # noqa: E402
from hf_taskmoe.lora_export import export_task_adapters  # noqa: E402

VOCAB = 2000
VARIANTS = ("routed", "peft_mixed", "export_task", "dense")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--rank", default="16", help="the adapters' rank (or 'full')")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting rounds once the run would pass this many seconds (at least one round)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated subset of {','.join(VARIANTS)} (dense is the ratios' reference)")
    parser.add_argument("--svd", default="auto", help="export_task_adapters(svd=...): auto, exact or subspace")
    args = parser.parse_args()
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not chosen or any(v not in VARIANTS for v in chosen) or len(set(chosen)) != len(chosen):
        parser.error(f"--variants takes distinct names of {VARIANTS}, got {args.variants!r}")
    start = time.perf_counter()
    last = [start]

    def progress(message: str) -> None:
        """`[since start] message: the phase's seconds` on stderr."""
        now = time.perf_counter()
        print(f"[{now - start:7.1f} s] {message}: {now - last[0]:.1f} s", file=sys.stderr, flush=True)
        last[0] = now

    torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rank = args.rank if args.rank == "full" else int(args.rank)

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=args.hidden * 43 // 16,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt + args.new + 8, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    dense = transformers.LlamaForCausalLM(config).eval()
    tasks = [TaskSpec(name=f"t{i}", problem_type="seq2seq") for i in range(args.tasks)]
    progress(f"dense llama {args.layers}x{args.hidden} built")
    # experts moved apart (as training would) so that the routes and adapters are not trivial
    routed = TaskRoutedForCausalLM.from_dense(dense, tasks, num_experts=3, selection="hard", expert_noise_variance=1e-4)
    routed.eval()
    names = routed.config.task_names
    from peft import PeftModel

    progress("routed model forked (3 experts per layer)")
    routed.to(device)  # the export's decompositions run where the model will (fp32 until it is cast below)
    progress(f"routed model on {device.type}")
    peft_model = export = None
    with tempfile.TemporaryDirectory() as tmp:
        began = time.perf_counter()
        export = export_task_adapters(routed, Path(tmp) / "export", rank=rank, svd=args.svd)
        export_seconds = time.perf_counter() - began
        progress(f"export: adapters rank {export.rank} on {device.type}, svd {export.svd}, "
                 f"{max(export.svd_iterations.values())} subspace iterations at most")
        if "peft_mixed" in chosen:
            base = transformers.AutoModelForCausalLM.from_pretrained(Path(tmp) / "export" / "base", dtype=dtype)
            peft_model = PeftModel.from_pretrained(base, Path(tmp) / "export" / names[0], adapter_name=names[0])
            for task in names[1:]:
                peft_model.load_adapter(Path(tmp) / "export" / task, adapter_name=task)
            peft_model = peft_model.to(device).eval()
            progress("peft model loaded (base + one adapter per task)")
    per_task = {t: routed.export_task(t).to(device, dtype) for t in names} if "export_task" in chosen else {}
    if per_task:
        progress("export_task models built (one per task)")
    routed, dense = routed.to(device, dtype), dense.to(device, dtype)
    progress(f"models cast to {str(dtype).replace('torch.', '')}")

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, VOCAB, (args.batch, args.prompt), generator=g).to(device)
    task_ids = (torch.arange(args.batch) % args.tasks).to(device)
    row_names = [names[t] for t in task_ids.tolist()]
    common = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new, min_new_tokens=args.new,
                  do_sample=False, pad_token_id=0)
    rows = {t: (task_ids == i).nonzero().flatten() for i, t in enumerate(names)}

    def per_task_generate():
        for t, model in per_task.items():
            if len(rows[t]):
                model.generate(ids[rows[t]], **{**common, "attention_mask": common["attention_mask"][rows[t]]})

    variants = {
        "routed": lambda: routed.generate(ids, task_ids=task_ids, **common),
        "peft_mixed": lambda: peft_model.generate(input_ids=ids, adapter_names=row_names, **common),
        "export_task": per_task_generate,
        "dense": lambda: dense.generate(ids, **common),
    }
    variants = {v: fn for v, fn in variants.items() if v in chosen}

    def timed(fn):
        """(wall, CPU) seconds per call: on a shared machine the wall time also counts waiting for a core, the
        process's CPU time (all its threads) only the work."""
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(args.repeats):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / args.repeats, (time.process_time() - cpu) / args.repeats

    with torch.no_grad():
        for v, fn in variants.items():  # warm-up
            fn()
            progress(f"warm-up {v}")
        times = {v: [] for v in variants}
        order = list(variants)
        rounds_done = 0
        for r in range(args.rounds):
            round_began = time.perf_counter()
            for v in order if r % 2 == 0 else order[::-1]:
                times[v].append(timed(variants[v]))
            rounds_done += 1
            progress(f"round {rounds_done}/{args.rounds}")
            spent, last_round = time.perf_counter() - start, time.perf_counter() - round_began
            if args.budget_s is not None and rounds_done < args.rounds and spent + last_round > args.budget_s:
                print(f"budget {args.budget_s:g} s: {spent:.1f} s spent, a round takes {last_round:.1f} s: stopping "
                      f"after {rounds_done} of {args.rounds} rounds", file=sys.stderr, flush=True)
                break
    ms = {v: 1000 * statistics.median(w for w, _ in t) for v, t in times.items()}
    cpu_ms = {v: 1000 * statistics.median(c for _, c in t) for v, t in times.items()}
    tokens = args.batch * args.new
    shape = f"llama {args.layers}x{args.hidden}, {args.tasks} tasks x 3 experts, batch {args.batch}, prompt " \
            f"{args.prompt}, {args.new} new tokens, rank {export.rank}"
    print(f"{shape}; {device.type} {str(dtype).replace('torch.', '')}, threads {args.threads}")
    print(f"{'variant':<12} {'ms/call':>9} {'tokens/s':>10} {'x dense':>8} {'CPU ms':>9} {'CPU x dense':>12}")
    result = {"device": device.type, "dtype": str(dtype).replace("torch.", ""), "layers": args.layers,
              "hidden": args.hidden, "tasks": args.tasks, "batch": args.batch, "prompt": args.prompt,
              "new_tokens": args.new, "rank": export.rank, "threads": args.threads,
              "export_s": round(export_seconds, 2), "export_svd": export.svd,
              "export_svd_iterations": max(export.svd_iterations.values()), "rounds": args.rounds,
              "rounds_done": rounds_done, "partial": rounds_done < args.rounds, "repeats": args.repeats,
              "total_s": round(time.perf_counter() - start, 1)}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    reference = "dense" if "dense" in ms else None
    for v, value in ms.items():
        ratio = value / ms[reference] if reference else float("nan")
        cpu_ratio = cpu_ms[v] / cpu_ms[reference] if reference else float("nan")
        print(f"{v:<12} {value:9.1f} {1000 * tokens / value:10.0f} {ratio:8.2f} {cpu_ms[v]:9.1f} {cpu_ratio:12.2f}")
        result[f"{v}_ms"] = round(value, 2)
        result[f"{v}_cpu_ms"] = round(cpu_ms[v], 2)
        result[f"{v}_tokens_per_s"] = round(1000 * tokens / value, 1)
        if reference:
            result[f"{v}_cpu_ratio"] = round(cpu_ratio, 3)
            result[f"{v}_ratio"] = round(ratio, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
