"""Dense cost where users train and serve: every family against its dense model on one device, side by side.

Run this first on any machine with a GPU. On CUDA it times BERT-base shapes (768 wide, 12 layers, FFN 3072, random
weights) on a batch of 32 x 128 tokens mixing 8 binary tasks, checked on the host as the Trainer's collator does
(`values_checked=True`, `task_counts`), against transformers' `BertForSequenceClassification` on the same batch:

- `train`: a training step (forward + backward, no optimizer step) in fp32, fp16 autocast with a `GradScaler`, and
  bf16 autocast; median milliseconds over `--steps` steps, the models alternating round by round;
- `infer`: inference with bf16 weights, eager and replayed as a CUDA graph (a family whose forward reads the device
  back cannot be captured: it says so), at `--batch` x `--seq` and at 256 x 128;
- `profile`: kernels launched and GPU kernel time per bf16 training step (`torch.profiler`), and peak memory;
- `compile`: `torch.compile(model, fullgraph=True)` of a bf16 training step with labels: compile seconds, step time,
  and whether a second task mix recompiles (it must not);
- `backbones`: the backbone-generic families on RoBERTa- and ModernBERT-base shapes against their own dense model
  (`...ForSequenceClassification`), bf16 training and inference;
- `generate`: task-routed generation under hard routes (a Llama of 16 layers x 1024, bf16, batch 16, 64-token
  prompts, 64 new tokens greedy; a T5 and a BART of base-like shapes) against the dense model and `export_task`; a
  mixed batch both with grouped layers (the default on a GPU) and with each expert on its own rows;
- `peft`: peft's mixed-adapter batch (8 LoRA adapters, `adapter_names` per row) on the dense model, the anchor.

Without CUDA it runs every section at tiny shapes on the CPU (a smoke run: `tests/test_gpu_benchmark.py`); those
timings mean nothing. Each finished section is written to `--out` (JSON) at once, so a run cut short keeps what it
measured; `--max-seconds` skips the sections that would start after that much wall time.

    python benchmarks/gpu.py [--sections train,infer,profile,compile,backbones,generate,peft] [--steps 15]
                             [--out gpu.json] [--max-seconds 600] [--compile-families mt_tag_grouped_mm,...]

The last line printed is one JSON object: every figure, with ratios to the dense model measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
import traceback

import torch

import hf_taskmoe
from hf_taskmoe import (
    BertForTaskMoE,
    BertWithPALs,
    CAMTLModel,
    TaskSpec,
)
from hf_taskmoe.training.batches import BatchChecker

SECTIONS = ("train", "infer", "profile", "compile", "backbones", "generate", "peft")
DENSE = "bert_seq_cls"
FEWER_EXPERTS = "mt_tag_grouped_mm_one_expert_fewer"
BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
BERT_TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def log(*args):
    print(*args, file=sys.stderr, flush=True)


class Bench:
    """The device, the shapes and the timing rules of one run."""

    def __init__(self, args):
        self.cuda = torch.cuda.is_available() and args.device != "cpu"
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.tiny = not self.cuda
        self.args = args
        if self.tiny:  # a smoke run: every path, nothing measured
            args.batch, args.seq = min(args.batch, 8), min(args.seq, 16)
        self.steps = args.steps if self.cuda else 2
        self.warmup = args.warmup if self.cuda else 1

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def side_by_side(self, steps: dict) -> dict[str, float]:
        """Median milliseconds of each callable, warmed up, alternating who goes first every round."""
        for fn in steps.values():
            for _ in range(self.warmup):
                fn()
        self.sync()
        times = {name: [] for name in steps}
        names = list(steps)
        for r in range(self.steps):
            for name in names if r % 2 == 0 else names[::-1]:
                self.sync()
                start = time.perf_counter()
                steps[name]()
                self.sync()
                times[name].append(1000 * (time.perf_counter() - start))
        return {name: round(statistics.median(t), 3) for name, t in times.items()}


def ratios(ms: dict[str, float], dense: str = DENSE) -> dict[str, float]:
    return {name: round(value / ms[dense], 3) for name, value in ms.items() if dense in ms and ms[dense]}


# ------------------------------------------------------------------------------------------------------- BERT families
def encoder_tasks(n: int) -> list[TaskSpec]:
    return [TaskSpec(name=f"task{i}", num_labels=2) for i in range(n)]


def bert_models(bench: Bench, families: str | None = None) -> dict[str, torch.nn.Module]:
    """The dense reference and every BERT family upcycled from the same dense weights (random), on the device;
    `families` (comma-separated) instead of the run's `--families`."""
    shapes = BERT_TINY if bench.tiny else BERT_BASE
    families = bench.args.families if families is None else families
    models = bert_family_models(shapes, bench.args.num_tasks, bench.args.num_experts, families,
                                pal_size=204 if not bench.tiny else 12,
                                camtl_max_length=128 if not bench.tiny else 16)
    return {name: m.to(bench.device) for name, m in models.items()}


def fewer_experts(bench: Bench, models: dict) -> dict[str, torch.nn.Module]:
    """MT-TaG (grouped GEMM) with one expert fewer, for the profile's experts' floor, when the run has MT-TaG."""
    if "mt_tag_grouped_mm" not in models or FEWER_EXPERTS in models or bench.args.num_experts < 2:
        return {}
    return {FEWER_EXPERTS: bert_models(bench, FEWER_EXPERTS)[FEWER_EXPERTS]}


def bert_family_models(shapes: dict, num_tasks: int, num_experts: int, families: str = "", pal_size: int = 204,
                       camtl_max_length: int = 128, pal_dispatch: str = "auto") -> dict[str, torch.nn.Module]:
    """`bert_models` of any `shapes` (a `BertConfig`'s sizes), where they are made (also under a `FakeTensorMode`:
    `benchmarks/cost_proxies.py`); `families` comma-separated, empty for all (the dense model always)."""
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    torch.manual_seed(0)
    dense = BertModel(BertConfig(**shapes))
    tasks = encoder_tasks(num_tasks)
    reference = BertForSequenceClassification(BertConfig(**shapes, num_labels=2))
    reference.bert.load_state_dict(dense.state_dict())
    build = {
        DENSE: lambda: reference,
        "mt_dense": lambda: BertForTaskMoE.from_dense(dense, tasks=tasks, num_experts=1),
        "mt_tag": lambda: BertForTaskMoE.from_dense(dense, tasks=tasks, num_experts=num_experts, gating="task"),
        "mt_tag_grouped_mm": lambda: BertForTaskMoE.from_dense(
            dense, tasks=tasks, num_experts=num_experts, gating="task",
            experts_implementation="taskmoe_sorted_grouped"),
        "mt_tag_sorted_loop": lambda: BertForTaskMoE.from_dense(
            dense, tasks=tasks, num_experts=num_experts, gating="task", experts_implementation="taskmoe_sorted_loop"),
        # one expert fewer: the profile's experts' floor (`section_profile`); built only when named
        FEWER_EXPERTS: lambda: BertForTaskMoE.from_dense(
            dense, tasks=tasks, num_experts=num_experts - 1, gating="task",
            experts_implementation="taskmoe_sorted_grouped"),
        "pals": lambda: BertWithPALs.from_dense(dense, tasks=tasks, pal_size=pal_size, pal_dispatch=pal_dispatch),
        "camtl": lambda: CAMTLModel.from_dense(dense, tasks=tasks, conditional_attention_max_length=camtl_max_length),
    }
    keep = set(families.split(",")) | {DENSE} if families else set(build) - {FEWER_EXPERTS}
    return {name: make() for name, make in build.items() if name in keep}


def encoder_batch(bench: Bench, batch: int, seq: int, vocab: int) -> dict:
    """A padded batch mixing the tasks row by row, on the CPU."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    lengths[0] = seq
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    return {
        "input_ids": torch.randint(5, vocab, (batch, seq), generator=g) * mask,
        "attention_mask": mask,
        "task_ids": torch.arange(batch) % bench.args.num_tasks,
        "labels": torch.randint(0, 2, (batch,), generator=g),
    }


def model_batch(bench: Bench, name: str, model, batch: dict, dense: bool, labels: bool = True) -> dict:
    """What the Trainer hands `model`: the dense model gets no task ids; a family gets the collator's marks."""
    batch = {k: v for k, v in batch.items() if labels or k != "labels"}
    if dense:
        batch = {k: v for k, v in batch.items() if k != "task_ids"}
    else:
        marks = BatchChecker.for_model(model).check(batch)
        if marks is None:
            raise RuntimeError(f"{name}: the batch could not be checked on the host")
        batch = {**batch, **marks}
    return {k: v.to(bench.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def train_step(model, batch, precision: str, scaler=None):
    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device.type
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
        loss = model(**batch).loss
    (scaler.scale(loss) if scaler is not None else loss).backward()


@torch.no_grad()
def infer_step(model, batch):
    model(**batch)


def section_train(bench: Bench, models: dict, batches: dict) -> dict:
    out = {}
    precisions = ["fp32", "fp16", "bf16"] if bench.cuda else ["fp32", "bf16"]
    for precision in precisions:
        scaler = torch.amp.GradScaler(bench.device.type) if precision == "fp16" else None
        for m in models.values():
            m.train()
        steps = {name: (lambda m=m, b=batches[name], p=precision, s=scaler: train_step(m, b, p, s))
                 for name, m in models.items()}
        ms = bench.side_by_side(steps)
        out[f"train_{precision}_ms"] = ms
        out[f"train_{precision}_ratio"] = ratios(ms)
        log(f"train {precision}: {ms} ratio {out[f'train_{precision}_ratio']}")
    return out


def graph_replay(bench: Bench, model, batch):
    """The forward captured as a CUDA graph, replayed; `None` with the reason when it cannot be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(3):
            model(**batch)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        model(**batch)
    return graph.replay


def section_infer(bench: Bench, models: dict, make_batches) -> dict:
    out = {}
    shapes = [(bench.args.batch, bench.args.seq), (256, 128)] if bench.cuda else [(4, 16)]
    infer_models = {name: copy.deepcopy(m).to(torch.bfloat16).eval() for name, m in models.items()}
    for batch_size, seq in shapes:
        key = f"{batch_size}x{seq}"
        batches = make_batches(batch_size, seq, infer_models, labels=False)
        steps = {}
        for name, m in infer_models.items():
            steps[name] = (lambda m=m, b=batches[name]: infer_step(m, b))
        ms = bench.side_by_side(steps)
        out[f"infer_bf16_{key}_ms"], out[f"infer_bf16_{key}_ratio"] = ms, ratios(ms)
        log(f"infer bf16 {key}: {ms} ratio {ratios(ms)}")
        if bench.cuda and (batch_size, seq) == shapes[0]:
            graphs, refused = {}, {}
            for name, m in infer_models.items():
                try:
                    graphs[name] = graph_replay(bench, m, batches[name])
                except Exception as error:  # a forward that reads the device back cannot be captured
                    refused[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                    torch.cuda.synchronize()
            ms = bench.side_by_side(graphs)
            out[f"infer_bf16_{key}_cuda_graph_ms"], out[f"infer_bf16_{key}_cuda_graph_ratio"] = ms, ratios(ms)
            out[f"infer_bf16_{key}_cuda_graph_refused"] = refused
            log(f"infer bf16 {key} CUDA graphs: {ms} ratio {ratios(ms)} refused {list(refused)}")
    del infer_models
    return out


def section_profile(bench: Bench, models: dict, batches: dict) -> dict:
    """Kernels and GPU kernel time of one bf16 training step (CUDA), or aten ops dispatched (CPU); peak memory."""
    # peak_mem_MiB: everything allocated at the step's peak (every model of the run is resident: compare the next two);
    # step_MiB: what the step added to what was allocated before it (activations and the gradients);
    # activations_MiB: step_MiB less the gradients (one fp32 gradient per trainable parameter)
    out = {"kernels": {}, "kernel_ms": {}, "peak_mem_MiB": {}, "step_MiB": {}, "activations_MiB": {}, "params_M": {}}
    for name, m in models.items():
        m.train()
        out["params_M"][name] = round(sum(p.numel() for p in m.parameters()) / 1e6, 2)
        train_step(m, batches[name], "bf16")  # warm-up
        if bench.cuda:
            from torch.autograd import DeviceType
            from torch.profiler import ProfilerActivity, profile

            bench.sync()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                train_step(m, batches[name], "bf16")
                bench.sync()
            kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
            out["kernels"][name] = len(kernels)
            by_kernel: dict[str, list[float]] = {}
            for e in kernels:
                entry = by_kernel.setdefault(e.name[:100], [0.0, 0])
                entry[0] += e.time_range.elapsed_us()
                entry[1] += 1
            top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[: bench.args.top_kernels]
            out.setdefault("top_kernels_us_calls", {})[name] = [[k, round(us, 1), n] for k, (us, n) in top]
            out["kernel_ms"][name] = round(sum(e.time_range.elapsed_us() for e in kernels) / 1000, 3)
            m.zero_grad(set_to_none=True)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            train_step(m, batches[name], "bf16")
            bench.sync()
            out["peak_mem_MiB"][name] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
            step = torch.cuda.max_memory_allocated() - base
            grads = sum(p.numel() * p.element_size() for p in m.parameters() if p.requires_grad)
            out["step_MiB"][name] = round(step / 2**20, 1)
            out["activations_MiB"][name] = round((step - grads) / 2**20, 1)
            m.zero_grad(set_to_none=True)
        else:
            from op_count import OpCounter

            with OpCounter() as counter:
                train_step(m, batches[name], "bf16")
            out["kernels"][name] = sum(counter.ops.values())
    for field in ("kernels", "kernel_ms", "step_MiB", "activations_MiB"):
        if out.get(field):
            out[f"{field}_ratio"] = ratios(out[field])
    out["experts_floor"] = experts_floor(out, bench.args.num_experts)
    log(f"profile: { {k: v for k, v in out.items() if k != 'top_kernels_us_calls'} }")
    return out


def experts_floor(profile: dict, num_experts: int) -> dict:
    """MT-TaG's experts' floor from the profile of the grouped GEMM with `num_experts` and with one expert fewer: one
    expert's kernel time (and kernels) per step, and the dense model's plus `num_experts - 1` experts', as a ratio to
    the dense model's: the step of a router that cost nothing (`benchmarks/cost_proxies.py --floor` counts the same
    on a CPU). Empty unless both were profiled."""
    floor = {}
    for field in ("kernel_ms", "kernels"):
        values = profile.get(field) or {}
        if not all(name in values for name in (DENSE, "mt_tag_grouped_mm", FEWER_EXPERTS)) or not values[DENSE]:
            continue
        per_expert = values["mt_tag_grouped_mm"] - values[FEWER_EXPERTS]
        floor[f"per_expert_{field}"] = round(per_expert, 3)
        floor[f"{field}_floor_ratio"] = round((values[DENSE] + (num_experts - 1) * per_expert) / values[DENSE], 3)
    return floor


def section_compile(bench: Bench, models: dict, make_batches) -> dict:
    """`torch.compile(fullgraph=True)` of a bf16 training step with labels; a second task mix must not recompile."""
    out = {}
    names = bench.args.compile_families.split(",") if bench.args.compile_families else list(models)
    backend = "inductor" if bench.cuda else "aot_eager"
    first = make_batches(bench.args.batch, bench.args.seq, models)
    # the same shapes, another task mix: the rows' tasks rotated, so the per-task row counts change
    second = make_batches(bench.args.batch, bench.args.seq, models, rotate=3)
    for name in names:
        if name not in models:
            continue
        model = models[name].train()
        torch._dynamo.reset()
        try:
            compiled = torch.compile(model, fullgraph=True, backend=backend)
            start = time.perf_counter()
            train_step(compiled, first[name], "bf16")
            bench.sync()
            compile_s = time.perf_counter() - start
            with torch._dynamo.config.patch(error_on_recompile=True):
                train_step(compiled, second[name], "bf16")
                ms = bench.side_by_side({name: lambda c=compiled, b=first[name]: train_step(c, b, "bf16")})[name]
            out[name] = {"ok": True, "compile_s": round(compile_s, 1), "step_ms": ms}
        except Exception as error:
            out[name] = {"ok": False, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
        log(f"compile {name}: {out[name]}")
    steps = {n: v["step_ms"] for n, v in out.items() if v.get("ok")}
    if DENSE in steps:
        out["step_ratio"] = ratios(steps)
    torch._dynamo.reset()
    return out


# ------------------------------------------------------------------------------------------ backbone-generic families
def section_backbones(bench: Bench) -> dict:
    import transformers
    from transformers import AutoModel, AutoModelForSequenceClassification

    from hf_taskmoe import CAMTLForMultiTask, PALsForMultiTask, TaskMoEForMultiTask

    out = {}
    tasks = encoder_tasks(bench.args.num_tasks)
    base = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
    if bench.tiny:
        base = dict(BERT_TINY)
    for arch in ("roberta", "modernbert"):
        if arch == "modernbert":
            config = transformers.ModernBertConfig(**base, vocab_size=50368, pad_token_id=0, bos_token_id=1,
                                                   eos_token_id=2, cls_token_id=1, sep_token_id=2, num_labels=2)
        else:
            config = transformers.RobertaConfig(**base, vocab_size=50265, max_position_embeddings=514, num_labels=2)
        torch.manual_seed(0)
        dense = AutoModel.from_config(config)
        reference = AutoModelForSequenceClassification.from_config(config)
        missing = getattr(reference, reference.base_model_prefix).load_state_dict(dense.state_dict(), strict=False)
        assert not missing.missing_keys, missing  # only the pooler, which the classifier does not use, is left over
        models = {
            "dense": reference,
            "mt_dense": TaskMoEForMultiTask.from_dense(dense, tasks=tasks, num_experts=1),
            "mt_tag": TaskMoEForMultiTask.from_dense(dense, tasks=tasks, num_experts=bench.args.num_experts),
            "pals": PALsForMultiTask.from_dense(dense, tasks=tasks, pal_size=204 if not bench.tiny else 12),
            "camtl": CAMTLForMultiTask.from_dense(dense, tasks=tasks),
        }
        models = {n: m.to(bench.device) for n, m in models.items()}
        cpu_batch = encoder_batch(bench, bench.args.batch, bench.args.seq, 1000)
        batches = {n: model_batch(bench, n, m, cpu_batch, dense=n == "dense") for n, m in models.items()}
        for m in models.values():
            m.train()
        ms = bench.side_by_side({n: (lambda m=m, b=batches[n]: train_step(m, b, "bf16")) for n, m in models.items()})
        out[f"{arch}_train_bf16_ms"], out[f"{arch}_train_bf16_ratio"] = ms, ratios(ms, "dense")
        infer = {n: copy.deepcopy(m).to(torch.bfloat16).eval() for n, m in models.items()}
        unlabelled = {n: {k: v for k, v in b.items() if k != "labels"} for n, b in batches.items()}
        ms = bench.side_by_side({n: (lambda m=m, b=unlabelled[n]: infer_step(m, b)) for n, m in infer.items()})
        out[f"{arch}_infer_bf16_ms"], out[f"{arch}_infer_bf16_ratio"] = ms, ratios(ms, "dense")
        log(f"{arch}: train {out[f'{arch}_train_bf16_ratio']} infer {out[f'{arch}_infer_bf16_ratio']}")
        del models, infer
    return out


# ---------------------------------------------------------------------------------------------------------- generation
def section_generate(bench: Bench) -> dict:
    import transformers

    from hf_taskmoe import BartTaskRouted, TaskRoutedForCausalLM, TaskRoutedForSeq2SeqLM

    out = {}
    tiny = bench.tiny
    tasks = [TaskSpec(name=f"t{i}", problem_type="seq2seq") for i in range(4)]
    batch, prompt, new = (16, 64, 64) if not tiny else (4, 8, 4)
    dtype = torch.bfloat16 if bench.cuda else torch.float32
    if tiny:
        llama = transformers.LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)
        t5 = transformers.T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0)
        bart = transformers.BartConfig(vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2,
                                       encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=4,
                                       decoder_attention_heads=4, max_position_embeddings=64)
    else:
        llama = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                         num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8)
        t5 = transformers.T5Config(vocab_size=32128, d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_heads=12,
                                   feed_forward_proj="gated-gelu", decoder_start_token_id=0)
        bart = transformers.BartConfig(vocab_size=50265, d_model=768, encoder_layers=6, decoder_layers=6,
                                       encoder_ffn_dim=3072, decoder_ffn_dim=3072, encoder_attention_heads=12,
                                       decoder_attention_heads=12, max_position_embeddings=1024)
    g = torch.Generator().manual_seed(0)
    kinds = [("llama", transformers.LlamaForCausalLM, llama, TaskRoutedForCausalLM),
             ("t5", transformers.T5ForConditionalGeneration, t5, TaskRoutedForSeq2SeqLM),
             ("bart", transformers.BartForConditionalGeneration, bart, BartTaskRouted)]
    for name, dense_class, config, routed_class in kinds:
        if bench.args.generate_models and name not in bench.args.generate_models.split(","):
            continue
        try:
            torch.manual_seed(0)
            dense = dense_class(config).eval()
            routed = routed_class.from_dense(dense, tasks, selection="hard").eval()
            exported = routed.export_task("t1")
            dense, routed, exported = (m.to(bench.device, dtype) for m in (dense, routed, exported))
            ids = torch.randint(5, config.vocab_size, (batch, prompt), generator=g).to(bench.device)
            mask = torch.ones_like(ids)
            common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False)
            one = torch.full((batch,), 1, dtype=torch.long, device=bench.device)
            mixed = torch.arange(batch, device=bench.device) % len(tasks)
            steps = {
                "dense": lambda d=dense, c=common: d.generate(**c),
                "routed_one_task": lambda r=routed, c=common, t=one: r.generate(**c, task_ids=t),
                "routed_mixed": lambda r=routed, c=common, t=mixed: r.generate(**c, task_ids=t),
                "routed_mixed_per_expert": lambda r=routed, c=common, t=mixed: _per_expert(r, c, t),
                "export_task": lambda e=exported, c=common: e.generate(**c),
            }
            with torch.no_grad():
                ms = _few(bench, steps)
            out[f"{name}_generate_ms"], out[f"{name}_generate_ratio"] = ms, ratios(ms, "dense")
            log(f"generate {name}: {ms} ratio {ratios(ms, 'dense')}")
            del dense, routed, exported
        except Exception as error:
            out[f"{name}_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            log(f"generate {name} failed: {traceback.format_exc()}")
    out["shape"] = {"batch": batch, "prompt": prompt, "new_tokens": new, "llama": llama.to_diff_dict()}
    return out


def _per_expert(routed, common: dict, task_ids):
    """Hard-route generation with each expert on its own rows (`group_hard_routes=False`), beside the grouped layers
    (`"auto"`: grouped off the CPU)."""
    saved, routed.group_hard_routes = routed.group_hard_routes, False
    try:
        return routed.generate(**common, task_ids=task_ids)
    finally:
        routed.group_hard_routes = saved


def _few(bench: Bench, steps: dict) -> dict:
    """Generation is long: 1 warm-up and 3 alternating rounds on a GPU."""
    saved = bench.steps, bench.warmup
    bench.steps, bench.warmup = (3, 1) if bench.cuda else (1, 1)
    try:
        return bench.side_by_side(steps)
    finally:
        bench.steps, bench.warmup = saved


# ------------------------------------------------------------------------------------------------------------ peft
def section_peft(bench: Bench) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import BertConfig, BertForSequenceClassification

    shapes = BERT_TINY if bench.tiny else BERT_BASE
    torch.manual_seed(0)
    dense = BertForSequenceClassification(BertConfig(**shapes, num_labels=2)).eval()
    lora = get_peft_model(copy.deepcopy(dense), LoraConfig(r=8, target_modules=["query", "value"]),
                          adapter_name="a0")
    for i in range(1, 8):
        lora.add_adapter(f"a{i}", LoraConfig(r=8, target_modules=["query", "value"]))
    dtype = torch.bfloat16 if bench.cuda else torch.float32
    dense, lora = dense.to(bench.device, dtype), lora.to(bench.device, dtype).eval()
    out = {}
    for batch_size, seq in ([(bench.args.batch, bench.args.seq), (256, 128)] if bench.cuda else [(4, 16)]):
        b = encoder_batch(bench, batch_size, seq, 1000)
        inputs = {k: b[k].to(bench.device) for k in ("input_ids", "attention_mask")}
        names = [f"a{i % 8}" for i in range(batch_size)]
        with torch.no_grad():
            ms = bench.side_by_side({
                "dense": lambda i=inputs: dense(**i),
                "peft_lora_8_adapters_mixed": lambda i=inputs, n=names: lora(**i, adapter_names=n),
            })
        out[f"infer_{batch_size}x{seq}_ms"], out[f"infer_{batch_size}x{seq}_ratio"] = ms, ratios(ms, "dense")
        log(f"peft {batch_size}x{seq}: {ms} ratio {ratios(ms, 'dense')}")
    return out


# ----------------------------------------------------------------------------------------------------------- report
def report(paths: list[str]) -> str:
    """Markdown tables of saved runs (`--out` files), side by side: one column per run, each figure a ratio to the
    dense model measured in that run (what docs/benchmarks.md shows)."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append((path, json.load(f)))
    rows: dict[str, dict[str, list]] = {}
    for i, (_, run) in enumerate(runs):
        for section, figures in run["sections"].items():
            for key, value in figures.items():
                if not (key.endswith("_ratio") or key == "step_ratio") or not isinstance(value, dict):
                    continue
                for model, ratio in value.items():
                    if model in (DENSE, "dense"):
                        continue
                    rows.setdefault(f"{section}: {key.removesuffix('_ratio')}", {}).setdefault(
                        model, [None] * len(runs))[i] = ratio
    head = " | ".join(f"run {i + 1}" for i in range(len(runs)))
    lines = [f"| figure | model | {head} |", "|---|---|" + "---|" * len(runs)]
    for figure, models in rows.items():
        for model, values in models.items():
            cells = " | ".join("-" if v is None else f"{v:.3f}" for v in values)
            lines.append(f"| {figure} | {model} | {cells} |")
    legend = [f"- run {i + 1}: `{path}`: {run['device']}, torch {run['torch']}, transformers {run['transformers']}"
              for i, (path, run) in enumerate(runs)]
    return "\n".join(legend + [""] + lines)


# ----------------------------------------------------------------------------------------------------------- driver
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"Comma-separated, of {SECTIONS}.")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu"))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--num-tasks", type=int, default=8)
    parser.add_argument("--num-experts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=15, help="Timed steps per model (CUDA; 2 on the CPU).")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--families", default="", help="Only these BERT families (and the dense model).")
    parser.add_argument("--compile-families", default="",
                        help="Families to compile (default: all of the run's, the dense model included).")
    parser.add_argument("--generate-models", default="", help="Of llama,t5,bart (default: all).")
    parser.add_argument("--top-kernels", type=int, default=25,
                        help="profile: the kernels of most GPU time per model (name, microseconds, calls).")
    parser.add_argument("--out", default="", help="Write the results here (JSON) after every section.")
    parser.add_argument("--max-seconds", type=float, default=0, help="Start no section after this much wall time.")
    parser.add_argument("--report", nargs="+", metavar="JSON",
                        help="Print the ratios of saved runs (--out files) as one markdown table, and run nothing.")
    args = parser.parse_args()
    if args.report:
        print(report(args.report))
        return
    sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")

    bench = Bench(args)
    start = time.perf_counter()
    import transformers

    result = {
        "device": torch.cuda.get_device_name() if bench.cuda else "cpu (tiny shapes: a smoke run, not a measurement)",
        "torch": torch.__version__, "transformers": transformers.__version__, "hf_taskmoe": hf_taskmoe.__version__,
        "shapes": "BERT-base" if not bench.tiny else "tiny", "batch": [args.batch, args.seq],
        "num_tasks": args.num_tasks, "num_experts": args.num_experts, "sections": {}, "skipped": [],
    }
    if bench.cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here; bf16/fp16 are asked for by name

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    models = None
    vocab = 1000

    def make_batches(batch_size, seq, which, labels=True, rotate=0):
        cpu = encoder_batch(bench, batch_size, seq, vocab)
        cpu["task_ids"] = (cpu["task_ids"] + rotate * (torch.arange(batch_size) % 2)) % args.num_tasks
        return {n: model_batch(bench, n, m, cpu, dense=n == DENSE, labels=labels) for n, m in which.items()}

    for section in sections:
        if args.max_seconds and time.perf_counter() - start > args.max_seconds:
            result["skipped"].append(section)
            continue
        log(f"== {section} ({time.perf_counter() - start:.0f} s)")
        t0 = time.perf_counter()
        try:
            if section in ("train", "infer", "profile", "compile") and models is None:
                models = bert_models(bench)
            if section == "train":
                out = section_train(bench, models, make_batches(args.batch, args.seq, models))
            elif section == "infer":
                out = section_infer(bench, models, make_batches)
            elif section == "profile":
                profiled = {**models, **fewer_experts(bench, models)}
                out = section_profile(bench, profiled, make_batches(args.batch, args.seq, profiled))
                del profiled
            elif section == "compile":
                out = section_compile(bench, models, make_batches)
            elif section == "backbones":
                out = section_backbones(bench)
            elif section == "generate":
                out = section_generate(bench)
            else:
                out = section_peft(bench)
        except Exception as error:
            log(traceback.format_exc())
            out = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"}
        out["seconds"] = round(time.perf_counter() - t0, 1)
        result["sections"][section] = out
        if bench.cuda:
            torch.cuda.empty_cache()
        save()
    result["seconds"] = round(time.perf_counter() - start, 1)
    save()
    print(json.dumps(result))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
