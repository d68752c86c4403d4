"""Stored and trainable parameters of task routing with low-rank experts (`expert_rank`), counted, not run.

Each model is built on the meta device (no memory, no weights): a `TaskRoutedForCausalLM` / `BartTaskRouted` with
`expert_rank=--rank`, `--experts` experts on every linear of every layer (the default `expert_targets`), frozen base,
against the dense model of the same shapes:

- `llama3-8b`: hidden 4096, FFN 14336, 32 layers, 32 heads, 8 key/value heads, vocabulary 128256, untied LM head;
- `smollm2-135m`: hidden 576, FFN 1536, 30 layers, 9 heads, 3 key/value heads, vocabulary 49152, tied embeddings;
- `bart-base`: BERT-base-sized BART (d_model 768, FFN 3072, 6 + 6 layers, 12 heads, vocabulary 50265).

For each: dense parameters, stored parameters (dense + deltas + router + task embeddings) and their ratio to dense,
trainable parameters (deltas, router, task embeddings) and their share of the stored ones, and the deltas per expert
per layer. Whole-layer experts are given beside for comparison (`full_experts_ratio`: stored / dense with every layer
forked into `--experts` copies, counted the same way). A table, then one JSON line.

    python benchmarks/low_rank_experts.py
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch
from transformers import BartConfig, LlamaConfig

from hf_taskmoe import TaskSpec
from hf_taskmoe.models.task_routing import (
    BartTaskRouted,
    BartTaskRoutedConfig,
    TaskRoutedForCausalLM,
    TaskRoutedLMConfig,
)

SHAPES = {
    "llama3-8b": (TaskRoutedForCausalLM, TaskRoutedLMConfig, lambda: LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False)),
    "smollm2-135m": (TaskRoutedForCausalLM, TaskRoutedLMConfig, lambda: LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True)),
    "bart-base": (BartTaskRouted, BartTaskRoutedConfig, lambda: BartConfig(
        d_model=768, encoder_ffn_dim=3072, decoder_ffn_dim=3072, encoder_layers=6, decoder_layers=6,
        encoder_attention_heads=12, decoder_attention_heads=12, vocab_size=50265, max_position_embeddings=1024)),
}
TASKS = [TaskSpec(name=f"t{i}", problem_type="seq2seq") for i in range(4)]


def count(name: str, rank: int, experts: int) -> dict:
    model_class, config_class, dense_config = SHAPES[name]
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense_cfg = dense_config()
        config = config_class.from_dense_config(dense_cfg, TASKS, num_experts=experts, expert_rank=rank,
                                                task_embedding_dim=64)
        model = model_class(config)
        dense = model.dense_auto_class.from_config(dense_cfg)
    dense_n = sum(p.numel() for p in dense.parameters())
    stored = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    deltas = sum(m.lora_A.numel() + m.lora_B.numel() for m in model.low_rank_modules().values())
    layers = len(model.routed_layers())
    # whole-layer experts: each routed layer's dense weights `experts` times (what `expert_rank=None` stores)
    layer_n = sum(p.numel() for layer in model.routed_layers() for n, p in layer.named_parameters()
                  if not n.endswith((".lora_A", ".lora_B")))
    full = dense_n + (experts - 1) * layer_n + (stored - dense_n - deltas)
    return {
        "model": name, "rank": rank, "experts": experts, "routed_layers": layers, "dense": dense_n,
        "stored": stored, "stored_ratio": round(stored / dense_n, 4), "trainable": trainable,
        "trainable_share": round(trainable / stored, 4), "deltas": deltas,
        "deltas_per_expert_per_layer": deltas // (experts * layers), "full_experts_ratio": round(full / dense_n, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    rows = [count(name, args.rank, args.experts) for name in args.models]
    header = f"{'model':<14}{'dense':>15}{'stored':>15}{'x dense':>9}{'trainable':>14}{'share':>8}{'/exp/layer':>12}" \
             f"{'full x':>8}"
    print(header)
    for r in rows:
        print(f"{r['model']:<14}{r['dense']:>15,}{r['stored']:>15,}{r['stored_ratio']:>9.4f}{r['trainable']:>14,}"
              f"{100 * r['trainable_share']:>7.2f}%{r['deltas_per_expert_per_layer']:>12,}"
              f"{r['full_experts_ratio']:>8.3f}")
    print(json.dumps({"rank": args.rank, "experts": args.experts, "results": rows}))


if __name__ == "__main__":
    main()
