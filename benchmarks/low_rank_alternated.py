"""Task-routed low-rank experts against one peft LoRA on SmolLM2-135M's real weights, their training steps
alternated in ONE process on the same batch, so that both meet the same load on shared cores (the evidence benchmark
runs each configuration in its own process, at another time). The model, tokenizer, data and configurations are
`low_rank_evidence.py`'s (`routed_low_rank`: hard routes, 4 experts of rank `--rank` on every projection; `lora_all`:
one LoRA of rank `--rank` on the same projections); one batch of `--batch` rows over the four tasks; after one
warm-up step each, `--steps` rounds of one step of each. Prints each step's wall and process CPU seconds, their
medians and the ratios to `lora_all`, then one JSON line.

    python benchmarks/low_rank_alternated.py --threads 1 --steps 2
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import low_rank_evidence as evidence  # noqa: E402

CONFIGS = ["lora_all", "routed_low_rank"]


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="the evidence benchmark's tiny random Llama")
    args = parser.parse_args(argv)
    args.max_chars, args.eval_per_task, args.seed, args.full_experts = 200, 1, 0, 0
    torch.set_num_threads(args.threads)
    dense, tokenizer = evidence.load(args)
    data = evidence.read_data(args)
    tasks = list(evidence.TASKS)
    rows = [data[t][0][i] for i in range(args.batch) for t in tasks][:args.batch]
    batch = evidence.encode_batch(tokenizer, rows, with_target=True)
    runs = {}
    for config in CONFIGS:
        model, select = evidence.build(config, copy.deepcopy(dense), args, tasks)
        model.train()
        inputs = dict(batch)
        if select == "task_ids":
            inputs["task_ids"] = torch.arange(args.batch) % len(tasks)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        runs[config] = (model, inputs, optimizer)
    del dense
    gc.collect()

    def step(config: str) -> tuple[float, float]:
        model, inputs, optimizer = runs[config]
        start, start_cpu = time.perf_counter(), time.process_time()
        model(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start, time.process_time() - start_cpu

    for config in CONFIGS:  # warm-up: allocations, AdamW's state
        step(config)
    times = {config: [] for config in CONFIGS}
    for _ in range(args.steps):
        for config in CONFIGS:
            times[config].append(step(config))
    result = {"threads": args.threads, "batch": list(batch["input_ids"].shape), "rank": args.rank, "smoke": args.smoke,
              "configs": {}}
    for config in CONFIGS:
        wall = statistics.median(t[0] for t in times[config])
        cpu = statistics.median(t[1] for t in times[config])
        result["configs"][config] = {"wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
                                     "all": [[round(w, 4), round(c, 4)] for w, c in times[config]]}
    ref = result["configs"]["lora_all"]
    for row in result["configs"].values():
        row["wall_x_lora_all"] = round(row["wall_s"] / ref["wall_s"], 3)
        row["cpu_x_lora_all"] = round(row["cpu_s"] / ref["cpu_s"], 3)
    for config, row in result["configs"].items():
        print(f"{config:<18} wall {row['wall_s']:8.3f} s ({row['wall_x_lora_all']:.3f}x)  "
              f"cpu {row['cpu_s']:8.3f} s ({row['cpu_x_lora_all']:.3f}x)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
