"""Task-routed generation under hard routes against the dense model, side by side in one run (CPU proxy of
`benchmarks/gpu.py --sections generate`).

Model: a random Llama of 4 layers x 256 (8 heads, 4 key/value heads, FFN 688, vocabulary 2000), every layer forked
into 3 experts, 4 tasks, `selection="hard"` (at evaluation: the arg-max expert of each task and layer). Batch of 8
rows x 32-token prompts, exactly 16 new tokens, greedy, key/value cache. Variants:

- `dense`: the Llama it was forked from;
- `routed_one_task`: every row of one task (each layer: one expert on the whole batch);
- `routed_mixed`: the 4 tasks in turn, as the model runs them by default on this device (on a CPU each used expert
  on its own rows, `group_hard_routes="auto"`);
- `routed_mixed_grouped`: the same with `group_hard_routes=True` (what a GPU runs: each mixed layer as one layer,
  one grouped GEMM per linear over the experts' row segments);
- `export_task`: the plain Llama holding one task's route (`export_task`), the floor.

Each figure is the median over rounds of a block of calls, the variants alternating in order every round so that
machine noise hits all of them alike.

    python benchmarks/routed_generation.py [--rounds 5] [--repeats 2] [--threads 1] [--models llama,t5] [--host]

`--host`: the host-overhead proxy of a GPU's decoding step (the arithmetic nearly gone): a Llama of 16 layers x 32
(4 heads, FFN 88), batch 16, 8-token prompts, 16 new tokens, where the step is Python, dispatch and the allocator.

Prints a table, then one JSON line with the milliseconds and the ratios to the dense model: wall time (`_ms`,
`_ratio`) and the process's CPU time (`_cpu_ms`, `_cpu_ratio`, steadier on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers

from hf_taskmoe import TaskRoutedForCausalLM, TaskRoutedForSeq2SeqLM, TaskSpec

TASKS = [TaskSpec(name=f"t{i}", problem_type="seq2seq") for i in range(4)]
BATCH, PROMPT, NEW = 8, 32, 16


def models(name: str, host: bool = False):
    if name == "llama" and host:
        config = transformers.LlamaConfig(vocab_size=2000, hidden_size=32, intermediate_size=88, num_hidden_layers=16,
                                          num_attention_heads=4, num_key_value_heads=2)
        return transformers.LlamaForCausalLM(config).eval(), TaskRoutedForCausalLM
    if name == "llama":
        config = transformers.LlamaConfig(vocab_size=2000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                          num_attention_heads=8, num_key_value_heads=4)
        return transformers.LlamaForCausalLM(config).eval(), TaskRoutedForCausalLM
    if name == "t5":
        config = transformers.T5Config(vocab_size=2000, d_model=256, d_kv=32, d_ff=688, num_layers=4, num_heads=8,
                                       feed_forward_proj="gated-gelu", decoder_start_token_id=0)
        return transformers.T5ForConditionalGeneration(config).eval(), TaskRoutedForSeq2SeqLM
    raise ValueError(f"`--models` must name llama or t5, got {name!r}.")


def timed(fn, repeats: int) -> tuple[float, float]:
    """(wall, CPU) seconds per call: on a shared machine the wall time also counts waiting for a core, the process's
    CPU time (all its threads) only the work."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - wall) / repeats, (time.process_time() - cpu) / repeats


def grouped(routed, common: dict, task_ids):
    saved, routed.group_hard_routes = routed.group_hard_routes, True
    try:
        return routed.generate(**common, task_ids=task_ids)
    finally:
        routed.group_hard_routes = saved


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default="llama")
    parser.add_argument("--host", action="store_true", help="Tiny widths, 16 layers: the host-overhead proxy.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch, prompt, new = (16, 8, 16) if args.host else (BATCH, PROMPT, NEW)
    result = {"threads": args.threads, "batch": batch, "prompt": prompt, "new_tokens": new, "host": args.host}
    print(f"threads {args.threads}, {args.rounds} rounds x {args.repeats} calls; median per generate call")
    for name in args.models.split(","):
        torch.manual_seed(0)
        dense, routed_class = models(name, args.host)
        routed = routed_class.from_dense(dense, TASKS, num_experts=3, selection="hard").eval()
        exported = routed.export_task("t1")
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(5, 2000, (batch, prompt), generator=g)
        common = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                      do_sample=False)
        one, mixed = torch.full((batch,), 1), torch.arange(batch) % len(TASKS)
        variants = {
            "dense": lambda m=dense, c=common: m.generate(**c),
            "routed_one_task": lambda m=routed, c=common, t=one: m.generate(**c, task_ids=t),
            "routed_mixed": lambda m=routed, c=common, t=mixed: m.generate(**c, task_ids=t),
            "routed_mixed_grouped": lambda m=routed, c=common, t=mixed: grouped(m, c, t),
            "export_task": lambda m=exported, c=common: m.generate(**c),
        }
        with torch.no_grad():
            for fn in variants.values():  # warm-up
                fn()
            times = {v: [] for v in variants}
            names = list(variants)
            for r in range(args.rounds):
                for v in names if r % 2 == 0 else names[::-1]:
                    times[v].append(timed(variants[v], args.repeats))
        wall = {v: 1000 * statistics.median(w for w, _ in t) for v, t in times.items()}
        cpu = {v: 1000 * statistics.median(c for _, c in t) for v, t in times.items()}
        for v in variants:
            print(f"{name} {v:<16} wall {wall[v]:8.1f} ms {wall[v] / wall['dense']:5.2f}x dense   "
                  f"CPU {cpu[v]:8.1f} ms {cpu[v] / cpu['dense']:5.2f}x dense")
            result[f"{name}_{v}_ms"] = round(wall[v], 1)
            result[f"{name}_{v}_ratio"] = round(wall[v] / wall["dense"], 3)
            result[f"{name}_{v}_cpu_ms"] = round(cpu[v], 1)
            result[f"{name}_{v}_cpu_ratio"] = round(cpu[v] / cpu["dense"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
