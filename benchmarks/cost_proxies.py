"""CPU proxies of the GPU cost (issue 46 item 2): what a bf16 training step of each BERT family costs a GPU, against
transformers' `BertForSequenceClassification`, measured on a CPU so that the work goes on without one.

The models and the batch are `benchmarks/gpu.py`'s: BERT-base shapes (768 wide, 12 layers, 12 heads, FFN 3072,
random weights), 32 x 128 tokens mixing 8 binary tasks, checked on the host as the Trainer's collator does
(`values_checked=True`, `task_counts`), MT-TaG with 4 experts, PALs with `pal_dispatch="batched"` (what a GPU runs).

(a) *Device work*: one training step (forward under bf16 autocast, backward; no optimizer step) with no arithmetic:
the models are built and run under `FakeTensorMode` (fake CPU tensors: shapes, dtypes and strides, no data), and a
`TorchDispatchMode` below autograd counts, per aten operator: calls that launch a kernel (views, allocations and
host reads launch none), FLOPs of the matrix products (`torch.utils.flop_counter`'s formulas; `_grouped_mm`'s
written here: 2 x rows x in x out), and bytes read + written (each input and output tensor once, a broadcast
operand at its stored size; views move nothing). What a GPU would do differently is emulated, and only that:

- autocast: CPU autocast to bf16 (fake CUDA tensors cannot run a backward on a build without CUDA). Its lists
  differ from CUDA's: CUDA also runs `layer_norm`, `softmax`, `log_softmax`, `nll_loss` in fp32 where CPU autocast
  leaves them in their input's dtype; matrix products, `linear` and `scaled_dot_product_attention` are bf16 in both,
  and both cache the casts of weights within a step;
- attention: `scaled_dot_product_attention` is run as `_scaled_dot_product_efficient_attention` (what an H100/H200
  picks for bf16 with a mask and dropout: one fused kernel, no (batch, heads, seq, seq) tensor), not the CPU's
  composite fallback; the models' own CPU branches (PALs' written-out attention on a CPU) are not taken;
- data-dependent reads (`.tolist()` of the expert offsets in MT-TaG's sorted loop) read an even split of the
  tokens among the experts: the FLOPs and bytes of the per-expert products do not depend on the split, only on
  the total, as long as no expert is empty.

Operators that accumulate with atomics on a GPU (`index_add`, `scatter_add`, `index_put(accumulate=True)`,
`embedding_dense_backward`, ...) are listed apart; `--top k` lists each family's k operators moving most bytes.

(b) *Host overhead*: the real step time on this CPU at tiny widths (BERT-base's 12 layers and 12 heads, 48 wide,
FFN 96, PALs s = 12; `--host-batch` x `--host-seq` tokens, 8 x 16 by default), fp32, one thread, where the
arithmetic vanishes and what is left is Python, dispatch and the allocator; median over `--rounds` rounds, the
models alternating, ratios to dense.

Each proxy is printed beside the H200 figures of the same code (`H200` below) with its Spearman rank correlation
over the families against each GPU column.

    python benchmarks/cost_proxies.py [--families mt_dense,...] [--batch 32] [--seq 128] [--top 8] [--rounds 15]
                                      [--smoke]

The last line printed is one JSON object: `{"device_work": {...}, "host": {...}, "goals": ..., "goals_met": ...,
"rank_correlation": ...}`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from collections import defaultdict

import torch
import torch.nn.functional as F
from gpu import BERT_BASE, BERT_TINY, DENSE, bert_family_models, encoder_batch, model_batch, train_step
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

FAMILIES = ("mt_dense", "mt_tag_grouped_mm", "mt_tag_sorted_loop", "pals", "camtl")
#: the issue's goals (issue 46): a family's bf16 training step at most this multiple of the dense model's on a GPU
GOALS = {"mt_dense": 1.02, "mt_tag_grouped_mm": 1.10, "mt_tag_sorted_loop": 1.10, "camtl": 1.15, "pals": 1.30}
#: ratios to `BertForSequenceClassification` of a bf16 training step, BERT-base, 32 x 128 tokens, 8 tasks mixed
H200_SOURCE = "benchmarks/results/gpu-h200-0e2d75d.json, H200, torch 2.11"
H200 = {
    "step": {"mt_dense": 0.996, "mt_tag_grouped_mm": 1.321, "mt_tag_sorted_loop": 2.692, "pals": 1.614,
             "camtl": 1.167},
    "kernel_time": {"mt_dense": 1.005, "mt_tag_grouped_mm": 1.626, "mt_tag_sorted_loop": 1.603, "pals": 1.81,
                    "camtl": 1.076},
    "kernels": {"mt_dense": 1.033, "mt_tag_grouped_mm": 1.407, "mt_tag_sorted_loop": 1.972, "pals": 1.654,
                "camtl": 1.284},
}
HOST_SHAPES = dict(hidden_size=48, num_hidden_layers=12, num_attention_heads=12, intermediate_size=96)
SMOKE_HOST_SHAPES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
#: operators that launch no kernel: allocations, metadata, host reads (counted apart), and `_unsafe_view` (the view
#: `matmul` returns its product as: its schema declares no alias, so `_is_view` does not see it)
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense",
             "device", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "lift_fresh",
             "_unsafe_view"}
#: operators that accumulate with atomic adds on a GPU (many writers to one address)
#: the roofline of `device_roofline_ms`: an H200 SXM's nominal bf16 dense peak and memory bandwidth, and a floor per
#: kernel (a launch on the device and its tail); a priori figures, not fitted to the measured ratios
H200_PEAK_FLOPS, H200_BANDWIDTH, KERNEL_FLOOR_S = 989e12, 4.8e12, 2e-6
ATOMIC = {"index_add", "index_add_", "scatter_add", "scatter_add_", "embedding_dense_backward", "index_reduce",
          "index_reduce_", "scatter_reduce", "scatter_reduce_", "_embedding_bag_backward", "index_put_with_accumulate"}


def log(*args):
    print(*args, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------- (a) device work
def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


def _bytes(t: torch.Tensor) -> int:
    """What reading or writing `t` moves: its elements once each (a broadcast dimension, stride 0, not repeated)."""
    if t.layout != torch.strided:
        return 0
    repeated = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride == 0:
            repeated *= size
    return t.numel() // max(repeated, 1) * t.element_size()


def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """`_grouped_mm(a, b, offs)`: each group's product; in all, 2 x out elements x the contracted size (2-D x 2-D:
    the groups split the contracted rows, so each output matrix contracts over its own share of `a`'s columns)."""
    if len(a_shape) == 2 and len(b_shape) == 2:  # (M, K) x (K, N) -> (G, M, N), K split among the groups
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * torch.Size(out_shape).numel() * a_shape[-1]


def _flops(func, args, kwargs, out) -> int:
    packet = func.overloadpacket
    if packet in flop_registry:
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    if packet is getattr(torch.ops.aten, "_grouped_mm", None):
        b = args[1]
        return _grouped_mm_flop(args[0].shape, b.shape, out_shape=out.shape)
    return 0


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


#: in-place operators that write their destination (`self`) without reading it
OVERWRITE_IN_PLACE = {"copy_", "index_copy_", "fill_", "zero_"}


def _read(name: str, args: tuple, kwargs: dict) -> tuple:
    """The operands an operator reads: all but a destination it only writes, an `out=` tensor or `self` of
    `OVERWRITE_IN_PLACE` (`index_copy_` of a permutation writes every row; of fewer rows the write is over-counted)."""
    if name in OVERWRITE_IN_PLACE:
        args = args[1:]
    return args, {k: v for k, v in kwargs.items() if k != "out"}


class WorkCounter(TorchDispatchMode):
    """Per aten operator below autograd (forward and backward): calls, kernels, FLOPs, bytes read + written.

    Data-dependent host reads (`_local_scalar_dense`, what `.item()` / `.tolist()` dispatch) of a fake tensor get
    a planned value where one is known: the offsets `searchsorted` finds in a sorted sequence are planned as an even
    split of the sequence among the boundaries. Any other read raises (the family is then reported uncounted)."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.kernels: dict[str, int] = defaultdict(int)
        self.flops: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.host_reads = 0
        self.roofline_s = 0.0
        self._planned = torch.utils.weak.WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.host_reads += 1
            if args[0] in self._planned:
                return self._planned[args[0]]
        out = func(*args, **kwargs)
        self._plan(name, args, out)
        if name == "index_put_" or name == "index_put" or name == "_index_put_impl_":
            accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 else False)
            name = "index_put_with_accumulate" if accumulate else name
        self.calls[name] += 1
        if name in NO_KERNEL or _is_view(func):
            return out
        flops = _flops(func, args, kwargs, out)
        moved = sum(_bytes(t) for t in _tensors(_read(name, args, kwargs))) + sum(_bytes(t) for t in _tensors(out))
        self.kernels[name] += 1
        self.flops[name] += flops
        self.bytes[name] += moved
        self.roofline_s += max(flops / H200_PEAK_FLOPS, moved / H200_BANDWIDTH, KERNEL_FLOOR_S)
        return out

    def _plan(self, name, args, out):
        if name == "searchsorted" and isinstance(args[0], torch.Tensor) and args[0].dim() == 1:
            total, n = args[0].shape[0], out.numel()  # (n,) offsets into `total` sorted slots
            self._planned[out] = [round((i + 1) * total / n) for i in range(n)]
        elif name in ("unbind", "select") and args[0] in self._planned:
            values = self._planned[args[0]]
            if name == "unbind":
                for value, piece in zip(values, out):
                    self._planned[piece] = value
            else:
                self._planned[out] = values[args[2]]


class GpuAttention(TorchFunctionMode):
    """`scaled_dot_product_attention` as an H100/H200 runs it in bf16 with a mask and dropout: the fused
    memory-efficient kernel (`_scaled_dot_product_efficient_attention`), the bool mask made additive first."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        given = dict(zip(names, args), **kwargs)
        query, key, value = given["query"], given["key"], given["value"]
        mask = given.get("attn_mask")
        if mask is not None and mask.dtype == torch.bool:  # as sdpa does: where(~mask, -inf, 0)
            mask = torch.zeros_like(mask, dtype=query.dtype).masked_fill_(mask.logical_not(), float("-inf"))
        if mask is not None:
            batch, heads, seq_q, _ = query.shape
            mask = mask.to(query.dtype).expand(batch, heads, seq_q, key.shape[-2])  # (batch, heads, q, k) a view
        grad = any(t.requires_grad for t in (query, key, value))
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, mask, grad, given.get("dropout_p", 0.0), given.get("is_causal", False),
            scale=given.get("scale"))[0]


class _UpcyclingCheck(TorchDispatchMode):
    """Upcycling re-reads every copied weight (`torch.equal`); fake tensors hold no values, so the copy is taken as
    exact (it is: `copy_`), only while the models are built."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.equal.default:
            return True
        return func(*args, **(kwargs or {}))


def _cpu_branches_as_on_a_gpu():
    """The models' own CPU-only paths switched to what they run on an accelerator (fake tensors are CPU tensors)."""
    from hf_taskmoe.layers import moe, pals

    saved = pals.explicit_attention_wins, moe.copy_puts_back
    pals.explicit_attention_wins = lambda query, dropout: False  # sdpa, as on a GPU
    moe.copy_puts_back = lambda rows: True  # MT-TaG's top-1 put-back by a copy, as on a GPU

    def restore():
        pals.explicit_attention_wins, moe.copy_puts_back = saved
    return restore


def device_work(args, shapes: dict, families: list[str]) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, _UpcyclingCheck():
        models = bert_family_models(shapes, args.num_tasks, args.num_experts, ",".join(families),
                                    pal_size=args.pal_size, camtl_max_length=args.seq, pal_dispatch="batched")
    bench = types.SimpleNamespace(device=torch.device("cpu"), args=args)
    cpu_batch = encoder_batch(bench, args.batch, args.seq, 1000)
    fields = ("kernels", "gflops", "gbytes", "roofline_ms", "host_reads", "atomic", "top", "errors", "exact")
    result = {field: {} for field in fields}
    restore = _cpu_branches_as_on_a_gpu()
    try:
        for name, model in models.items():
            model.train()
            batch = model_batch(bench, name, model, cpu_batch, dense=name == DENSE)  # checked on the host, real
            counter = WorkCounter()
            try:
                with mode:
                    fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                    with GpuAttention(), counter:
                        train_step(model, fake, "bf16")
            except Exception as error:  # a read of the device no plan covers, an operator fake tensors lack
                result["errors"][name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                log(f"device work: {name} not counted: {result['errors'][name]}")
                continue
            result["kernels"][name] = sum(counter.kernels.values())
            result["gflops"][name] = round(sum(counter.flops.values()) / 1e9, 2)
            result["gbytes"][name] = round(sum(counter.bytes.values()) / 1e9, 3)
            result["roofline_ms"][name] = round(1000 * counter.roofline_s, 3)
            result["host_reads"][name] = counter.host_reads
            result["exact"][name] = {"kernels": result["kernels"][name], "gbytes": sum(counter.bytes.values()) / 1e9,
                                     "roofline_ms": 1000 * counter.roofline_s}  # unrounded
            result["atomic"][name] = {op: counter.kernels[op] for op in sorted(ATOMIC) if counter.kernels.get(op)}
            top = sorted(counter.bytes.items(), key=lambda item: -item[1])[: args.top]
            result["top"][name] = [{"op": op, "MB": round(b / 1e6, 1), "kernels": counter.kernels[op],
                                    "GFLOP": round(counter.flops[op] / 1e9, 2)} for op, b in top]
            log(f"device work: {name} {result['kernels'][name]} kernels, {result['gflops'][name]} GFLOP, "
                f"{result['gbytes'][name]} GB, roofline {result['roofline_ms'][name]} ms")
    finally:
        restore()
    for field in ("kernels", "gflops", "gbytes", "roofline_ms"):
        result[f"{field}_ratio"] = ratios(result[field])
    return result


def experts_floor(args, shapes: dict, families: list[str], work: dict) -> dict:
    """What no implementation of MT-TaG's routing can go below: the device work its experts' parameters alone add.

    Each MoE family is counted again with one expert fewer; the difference is one expert's work per step (under
    autocast its weights cast to bf16 and read by the products, its gradients written and cast back to fp32, each
    in proportion to its parameters). The floor is the dense model's count plus `num_experts - 1` such experts: the
    step of a router that cost nothing. What a family counts above its floor is its routing. The sorted loop's
    difference also holds its per-expert launches: its floor is that dispatch's, the grouped one's the method's."""
    moe = [f for f in families if f.startswith("mt_tag") and f in work["gbytes"]]
    if not moe or args.num_experts < 2:
        return {}
    fewer = device_work(argparse.Namespace(**{**vars(args), "num_experts": args.num_experts - 1}), shapes, moe)
    floor = {}
    for family in moe:
        if family not in fewer["exact"]:
            continue
        row = {}
        exact, fewer_exact = work["exact"], fewer["exact"][family]
        for field in ("kernels", "gbytes", "roofline_ms"):
            dense, per_expert = exact[DENSE][field], exact[family][field] - fewer_exact[field]
            row[f"per_expert_{field}"] = round(per_expert, 6)
            row[f"{field}_floor_ratio"] = round((dense + (args.num_experts - 1) * per_expert) / dense, 3)
        floor[family] = row
        log(f"experts' floor: {family} {row}")
    return floor


# ---------------------------------------------------------------------------------------------- (b) host overhead
def host_overhead(args, shapes: dict, families: list[str]) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        models = bert_family_models(shapes, args.num_tasks, args.num_experts, ",".join(families),
                                    pal_size=args.host_pal_size, camtl_max_length=args.host_seq,
                                    pal_dispatch="batched")
        bench = types.SimpleNamespace(device=torch.device("cpu"), args=args)
        cpu_batch = encoder_batch(bench, args.host_batch, args.host_seq, 1000)
        batches = {name: model_batch(bench, name, m, cpu_batch, dense=name == DENSE) for name, m in models.items()}
        for name, model in models.items():
            model.train()
            for _ in range(args.warmup):
                train_step(model, batches[name], "fp32")
        times = {name: [] for name in models}
        names = list(models)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:  # alternate who goes first
                start = time.perf_counter()
                train_step(models[name], batches[name], "fp32")
                times[name].append(1000 * (time.perf_counter() - start))
    finally:
        torch.set_num_threads(threads)
    ms = {name: round(statistics.median(t), 3) for name, t in times.items()}
    log(f"host: {ms}")
    return {"ms": ms, "ratio": ratios(ms)}


# ----------------------------------------------------------------------------------------------------- validation
def ratios(values: dict, dense: str = DENSE) -> dict:
    return {name: round(v / values[dense], 3) for name, v in values.items() if name != dense and values.get(dense)}


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1  # ties share their mean rank
        i = j + 1
    return ranks


def spearman(a: dict, b: dict) -> float | None:
    """Spearman's rank correlation of two `{family: value}` over the families both have (None under 3)."""
    common = sorted(set(a) & set(b))
    if len(common) < 3:
        return None
    ra, rb = _ranks([a[k] for k in common]), _ranks([b[k] for k in common])
    mean_a, mean_b = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - mean_a) * (y - mean_b) for x, y in zip(ra, rb))
    var = (sum((x - mean_a) ** 2 for x in ra) * sum((y - mean_b) ** 2 for y in rb)) ** 0.5
    return round(cov / var, 3) if var else None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"Comma-separated, of {FAMILIES}.")
    parser.add_argument("--batch", type=int, default=32, help="Device work: rows (BERT-base shapes).")
    parser.add_argument("--seq", type=int, default=128, help="Device work: tokens per row.")
    parser.add_argument("--host-batch", type=int, default=8, help="Host overhead: rows (tiny widths).")
    parser.add_argument("--host-seq", type=int, default=16, help="Host overhead: tokens per row.")
    parser.add_argument("--num-tasks", type=int, default=8)
    parser.add_argument("--num-experts", type=int, default=4)
    parser.add_argument("--top", type=int, default=0, help="List each family's k operators moving most bytes.")
    parser.add_argument("--rounds", type=int, default=15, help="Host overhead: timed steps per model.")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--proxies", default="device,host", help="Of device,host.")
    parser.add_argument("--smoke", action="store_true", help="Tiny shapes, 2 rounds: every path, nothing measured.")
    parser.add_argument("--floor", action="store_true",
                        help="Device work: also MT-TaG's experts' floor (counted again with one expert fewer).")
    args = parser.parse_args()
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {list(FAMILIES)}")
    device_shapes, host_shapes = BERT_BASE, HOST_SHAPES
    args.pal_size, args.host_pal_size = 204, 12
    if args.smoke:
        device_shapes, host_shapes = BERT_TINY, SMOKE_HOST_SHAPES
        args.batch, args.seq, args.host_batch, args.host_seq = 4, 16, 4, 8
        args.pal_size, args.rounds, args.warmup, args.num_tasks = 12, 2, 1, 4
    import transformers

    result = {"torch": torch.__version__, "transformers": transformers.__version__, "smoke": args.smoke,
              "device_work": None, "host": None}
    proxies = {}
    if "device" in args.proxies:
        work = device_work(args, device_shapes, families)
        result["device_work"] = work
        proxies.update({"device_kernels": work["kernels_ratio"], "device_gflops": work["gflops_ratio"],
                        "device_bytes": work["gbytes_ratio"], "device_roofline": work["roofline_ms_ratio"]})
        if args.floor:
            work["experts_floor"] = experts_floor(args, device_shapes, families, work)
    if "host" in args.proxies:
        result["host"] = host_overhead(args, host_shapes, families)
        proxies["host_time"] = result["host"]["ratio"]

    width = 12
    print(f"ratios to {DENSE}; H200 columns from {H200_SOURCE}")
    columns = [*proxies, *(f"h200_{c}" for c in H200)]
    print(f"{'family':<20}" + "".join(f"{c:>{max(width, len(c) + 1)}}" for c in columns) + f"{'goal':>8}")
    for family in families:
        cells = [proxies[p].get(family) for p in proxies] + [H200[c].get(family) for c in H200]
        print(f"{family:<20}" + "".join(f"{('-' if v is None else f'{v:.3f}'):>{max(width, len(c) + 1)}}"
                                        for v, c in zip(cells, columns)) + f"{'<=' + str(GOALS[family]):>8}")
    if result["device_work"] and args.top:
        for family, rows in result["device_work"]["top"].items():
            print(f"{family}: " + ", ".join(f"{r['op']} {r['MB']} MB/{r['kernels']}" for r in rows))
    for family, row in ((result["device_work"] or {}).get("experts_floor") or {}).items():
        print(f"{family}: experts' floor (a router that cost nothing): bytes {row.get('gbytes_floor_ratio')}, "
              f"roofline {row.get('roofline_ms_floor_ratio')}, kernels {row.get('kernels_floor_ratio')}; one expert "
              f"{row.get('per_expert_gbytes')} GB, {row.get('per_expert_roofline_ms')} ms, "
              f"{row.get('per_expert_kernels')} kernels")
    if result["device_work"]:
        for family, ops in result["device_work"]["atomic"].items():
            if ops:
                print(f"{family}: atomic scatters {ops}")
    correlation = {p: {c: spearman(values, H200[c]) for c in H200} for p, values in proxies.items()}
    for p, row in correlation.items():
        print(f"Spearman {p}: " + ", ".join(f"{c} {v}" for c, v in row.items()))
    result["goals"] = GOALS
    result["goals_met"] = {p: {f: v <= GOALS[f] for f, v in values.items() if f in GOALS}
                           for p, values in proxies.items()}
    result["rank_correlation"] = correlation
    result["h200"] = {"source": H200_SOURCE, **H200}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
