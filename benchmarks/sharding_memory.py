"""Training memory per GPU of a routed Llama-3-8B (3 experts per routed layer) under DDP, ZeRO-2 and ZeRO-3 / FSDP2:
parameters, gradients and Adam states only (activations and buffers come on top).

The parameter count is the model's own: `TaskRoutedForCausalLM` built on the meta device (no memory, no
download) over Llama-3-8B's configuration (hidden 4096, 32 layers, 32 heads / 8 key-value heads, FFN 14336, vocabulary
128256, untied embeddings), every layer routed. Bytes per parameter:

- mixed precision (bf16 compute, fp32 master weights, the usual Trainer / DeepSpeed / FSDP2 set-up): bf16 weights 2 +
  gradients 2 (bf16; FSDP2 keeps them in fp32, 4, in place of the bf16 weights' copy) + fp32 master weights 4 + Adam's
  two moments 8 = 16 bytes;
- pure bf16 (weights, gradients and Adam moments in bf16, no fp32 copy): 2 + 2 + 4 = 8 bytes.

DDP keeps everything on every GPU; ZeRO-2 shards the gradients and the optimizer's fp32 state over the GPUs and keeps
the bf16 weights whole; ZeRO-3 and FSDP2 shard all of it, and gather one unit at a time (here a routed layer with its
3 experts, in bf16) for its forward and backward.

    python benchmarks/sharding_memory.py [--gpus 8] [--experts 3]

Prints the table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json

import torch
import transformers

from hf_taskmoe import TaskRoutedForCausalLM, TaskRoutedLMConfig, TaskSpec

GB = 1e9


def count(experts: int) -> dict:
    config = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False)
    with torch.device("meta"):
        dense = transformers.LlamaForCausalLM(config)
        tasks = [TaskSpec(name=f"task{i}", problem_type="seq2seq") for i in range(3)]
        routed = TaskRoutedForCausalLM(TaskRoutedLMConfig.from_dense_config(config, tasks, num_experts=experts))
    layer = sum(p.numel() for p in dense.model.layers[0].parameters())
    return {
        "dense": sum(p.numel() for p in dense.parameters()),
        "routed": sum(p.numel() for p in routed.parameters()),
        "router": sum(p.numel() for n, p in routed.named_parameters() if n.startswith("router.")),
        "layer": layer,
        "unit": layer * experts,  # one routed layer, the unit gathered at a time
    }


def per_gpu(n: int, gpus: int, unit: int) -> dict:
    """GB per GPU of weights + gradients + optimizer state for `n` parameters."""
    mixed = {"ddp": 16 * n, "zero2": 2 * n + 14 * n / gpus, "zero3_fsdp2": 16 * n / gpus + 2 * 2 * unit}
    pure = {"ddp": 8 * n, "zero2": 2 * n + 6 * n / gpus, "zero3_fsdp2": 8 * n / gpus + 2 * 2 * unit}
    return {"mixed": {k: round(v / GB, 1) for k, v in mixed.items()},
            "bf16": {k: round(v / GB, 1) for k, v in pure.items()}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--experts", type=int, default=3)
    args = parser.parse_args()
    counts = count(args.experts)
    result = {"gpus": args.gpus, "experts": args.experts, **counts}
    for name in ("dense", "routed"):
        result[f"{name}_gb"] = per_gpu(counts[name], args.gpus, counts["unit"] if name == "routed" else counts["layer"])
    print(f"parameters: dense {counts['dense']:,}, routed ({args.experts} experts per layer) {counts['routed']:,}; "
          f"one layer {counts['layer']:,}, one routed layer (the unit) {counts['unit']:,}, router {counts['router']:,}")
    print(f"GB per GPU over {args.gpus} GPUs (weights + gradients + optimizer state; the unit gathered twice for "
          "prefetch under ZeRO-3/FSDP2):")
    print("| model | precision | DDP | ZeRO-2 | ZeRO-3 / FSDP2 |\n|---|---|---|---|---|")
    for name in ("dense", "routed"):
        for precision in ("mixed", "bf16"):
            row = result[f"{name}_gb"][precision]
            print(f"| {name} | {precision} | {row['ddp']} | {row['zero2']} | {row['zero3_fsdp2']} |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
