"""`export_task_adapters`: a task-routed model written as one dense base plus one peft LoRA adapter per task, loaded
back with plain transformers + peft and run on mixed-task batches (`adapter_names`), on tiny random checkpoints whose
experts differ everywhere (weights, norms, biases) and whose tasks take different routes.

Documented error (docs/serving-adapters.md): at full rank the peft model's logits equal the routed model's within
1e-4 (float32; measured ~1e-6), and greedy generation agrees token for token."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    MT5Config,
    Qwen2Config,
    T5Config,
)

from hf_taskmoe import TaskRoutedForCausalLM, TaskRoutedForSeq2SeqLM, TaskSpec
from hf_taskmoe.lora_export import AdapterExport, export_task_adapters, routed_layer_experts

VOCAB = 40
TASKS = [TaskSpec(name=n, problem_type="seq2seq") for n in ("x", "y", "z", "w")]
SPECIAL = dict(bos_token_id=2, eos_token_id=3, pad_token_id=0)
#: the documented bound on |logits(peft export) - logits(routed)| at full rank, float32
FULL_RANK_ATOL = 1e-4


def dense_config(arch: str, hidden: int = 32):
    if arch == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=2, n_head=2, n_positions=64, vocab_size=VOCAB, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, **SPECIAL)
    small = dict(hidden_size=hidden, intermediate_size=hidden * 3 // 2, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, **SPECIAL)
    if arch == "llama":
        return LlamaConfig(**small)
    if arch == "qwen2":  # q/k/v carry biases
        return Qwen2Config(**small, use_sliding_window=False)
    if arch == "mistral":
        return MistralConfig(**small, sliding_window=None)
    if arch in ("t5", "mt5"):  # mT5: gated-GELU FFN (wi_0, wi_1), untied LM head
        t5 = dict(d_model=hidden, d_kv=8, d_ff=hidden, num_layers=2, num_decoder_layers=2, num_heads=2,
                  vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        return T5Config(**t5) if arch == "t5" else MT5Config(**t5, feed_forward_proj="gated-gelu",
                                                              tie_word_embeddings=False)
    raise ValueError(arch)


def distinct_routes(model, shared: bool = False) -> list[list[int]]:
    """Set task representations so that the tasks take pairwise different routes (as many as there are; `shared`:
    and two tasks take the same expert at some routed layer, so the majority base leaves a zero delta there)."""
    n, dim = model.config.num_tasks, model.config.task_dim
    wanted = min(n, model.config.num_experts ** model.config.num_routed_layers)
    for seed in range(200):
        generator = torch.Generator().manual_seed(seed)
        model.set_task_embeddings(torch.randn(n, dim, generator=generator) * 3)
        routes = [model.hard_route(t) for t in model.config.task_names]
        if len({tuple(r) for r in routes}) == wanted and (not shared or any(
            len({r[i] for r in routes}) < n for i in range(len(routes[0]))
        )):
            return routes
    raise AssertionError("no seed gave distinct routes")


def routed(arch: str, hidden: int = 32, selection: str = "gumbel_softmax_st", seed: int = 0, scale: float = 0.05,
           num_experts: int = 3):
    """A tiny routed model whose every parameter (each expert's weights, norms and biases) was moved apart, as
    training moves them, and whose tasks take different routes."""
    torch.manual_seed(seed)
    if arch in ("t5", "mt5"):
        dense = AutoModelForSeq2SeqLM.from_config(dense_config(arch, hidden)).eval()
        model = TaskRoutedForSeq2SeqLM.from_dense(dense, TASKS, expert_noise_variance=0.0, selection=selection,
                                                  num_experts=num_experts)
    else:
        dense = AutoModelForCausalLM.from_config(dense_config(arch, hidden)).eval()
        model = TaskRoutedForCausalLM.from_dense(dense, TASKS, expert_noise_variance=0.0, selection=selection,
                                                 num_experts=num_experts)
    return move_apart(model, seed + 1, scale, routes=selection in ("gumbel_softmax_st", "hard"))


def move_apart(model, seed: int = 1, scale: float = 0.05, routes: bool = True):
    """`model` with every parameter (each expert's weights, norms and biases) moved apart, as training moves them,
    in eval mode, its tasks on pairwise different routes (`routes`: a hard-routed model)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)
    model.eval()
    if routes:
        distinct_routes(model)
    return model


def load_peft(folder, tasks, auto=AutoModelForCausalLM):
    """Plain transformers + peft: the base, then each task's adapter under its name."""
    base = auto.from_pretrained(folder / "base")
    model = PeftModel.from_pretrained(base, folder / tasks[0], adapter_name=tasks[0])
    for task in tasks[1:]:
        model.load_adapter(folder / task, adapter_name=task)
    return model.eval()


MIXED = torch.tensor([0, 1, 2, 3, 2, 0])


def mixed_logits(model, peft_model, tasks=None, seed: int = 0):
    """Both models' logits on one batch mixing the tasks (`tasks`: the exported ones, default all)."""
    names = list(model.config.task_names)
    tasks = tasks or names
    task_ids = torch.tensor([names.index(tasks[i % len(tasks)]) for i in MIXED])
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (len(task_ids), 9), generator=generator)
    with torch.no_grad():
        return (model(input_ids=ids, task_ids=task_ids).logits,
                peft_model(input_ids=ids, adapter_names=[names[i] for i in task_ids]).logits)


def max_error(model, folder, tasks=None) -> float:
    tasks = tasks or model.config.task_names
    ref, out = mixed_logits(model, load_peft(folder, tasks), tasks)
    return float((ref - out).abs().max())


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2", "mistral"])
def test_full_rank_export_matches_the_routed_model_on_a_mixed_batch(arch, tmp_path):
    model = routed(arch)
    result = model.export_task_adapters(tmp_path / "out", rank="full", lossless=True)  # the models' method
    assert result.exact and result.rank == 32 and set(result.weight_error.values()) == {0.0}
    # every task off the base somewhere had its norms folded; GPT-2's LayerNorm biases and Qwen2's q/k/v
    # biases travel in lora_bias
    assert any(result.folded.values())
    assert bool(result.lora_bias) == (arch in ("gpt2", "qwen2"))
    error = max_error(model, tmp_path / "out")
    assert error < FULL_RANK_ATOL, error
    config = json.loads((tmp_path / "out" / "x" / "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] == 32 and config["peft_type"] == "LORA"
    assert config["fan_in_fan_out"] == (arch == "gpt2")
    # every layer routed: the linears' own names, as engines expect them
    assert sorted(config["target_modules"]) == (
        ["c_attn", "c_fc", "c_proj"] if arch == "gpt2"
        else ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    )
    manifest = json.loads((tmp_path / "out" / "hf_taskmoe_adapters.json").read_text())
    assert manifest["routes"] == {t: model.hard_route(t) for t in model.config.task_names}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_greedy_generation_agrees_token_for_token(arch, tmp_path):
    model = routed(arch)
    export_task_adapters(model, tmp_path, rank="full")
    peft_model = load_peft(tmp_path, model.config.task_names)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(4, VOCAB, (len(MIXED), 6), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    mask[3, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    names = [model.config.task_names[i] for i in MIXED]
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ours = model.generate(ids, task_ids=MIXED, **kwargs)
        theirs = peft_model.generate(input_ids=ids, adapter_names=names, **kwargs)
    assert torch.equal(ours, theirs)
    # and the tasks do generate differently (the adapters matter)
    with torch.no_grad():
        plain = peft_model.get_base_model().generate(ids, **kwargs)
    assert not torch.equal(plain, theirs)


@pytest.mark.parametrize("base", ["mean", "majority", "expert0"])
def test_every_base_choice_is_exact_at_full_rank(base, tmp_path):
    model = routed("llama")
    result = export_task_adapters(model, tmp_path, base=base)
    assert result.base == base and result.exact
    assert max_error(model, tmp_path) < FULL_RANK_ATOL
    if base != "mean":
        assert all(isinstance(j, int) for j in result.base_experts.values())


def test_majority_base_leaves_zero_adapters_where_a_task_takes_the_base_expert(tmp_path):
    from safetensors.torch import load_file

    model = routed("llama", seed=1)
    routes = distinct_routes(model, shared=True)
    result = export_task_adapters(model, tmp_path, rank=4, base="majority")
    layers = routed_layer_experts(model)
    checked = 0
    for t, task in enumerate(model.config.task_names):
        weights = load_file(str(tmp_path / task / "adapter_model.safetensors"))
        for name, index, _ in layers:
            on_base = routes[t][index] == result.base_experts[name]
            lora = [v for k, v in weights.items() if f"{name}." in k]
            assert lora and all(bool((v == 0).all()) == on_base for v in lora)
            checked += on_base
    assert checked  # some task sat on the majority expert somewhere


def test_a_bf16_model_exports_in_bf16_within_its_rounding(tmp_path):
    model = routed("llama").to(torch.bfloat16)
    result = export_task_adapters(model, tmp_path)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    assert base.dtype == torch.bfloat16 and result.exact
    ref, out = mixed_logits(model, load_peft(tmp_path, model.config.task_names))
    assert float((ref.float() - out.float()).abs().max()) < 0.05  # bf16 rounding of logits of size ~1


def test_a_dense_model_as_the_base(tmp_path):
    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(dense_config("llama")).eval()
    model = routed("llama")
    result = export_task_adapters(model, tmp_path, base=dense)
    assert result.base.startswith("dense:") and result.exact
    assert max_error(model, tmp_path) < FULL_RANK_ATOL


def test_a_partly_routed_model_targets_its_routed_layers_by_full_name(tmp_path):
    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(dense_config("llama")).eval()
    model = TaskRoutedForCausalLM.from_dense(dense, TASKS, expert_noise_variance=0.0, routed_layers=[1])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval()
    distinct_routes(model)
    result = export_task_adapters(model, tmp_path, lossless=True)
    assert result.target_modules and all(t.startswith("model.layers.1.") for t in result.target_modules)
    assert max_error(model, tmp_path) < FULL_RANK_ATOL


# ---------------------------------------------------------------------------------------------- the rank's cost
def test_error_decreases_with_the_rank(tmp_path):
    model = routed("llama", hidden=64, scale=0.02)  # full rank 64
    mean_errors, max_errors, weight_errors = [], [], []
    for rank in (8, 16, 32, "full"):
        result = export_task_adapters(model, tmp_path / str(rank), rank=rank)
        ref, out = mixed_logits(model, load_peft(tmp_path / str(rank), model.config.task_names))
        mean_errors.append(float((ref - out).abs().mean()))
        max_errors.append(float((ref - out).abs().max()))
        weight_errors.append(max(result.weight_error.values()))
    assert result.rank == 64
    assert mean_errors[0] > mean_errors[1] > mean_errors[2] > mean_errors[3], mean_errors
    assert max_errors[2] > 1e-2 and max_errors[3] < FULL_RANK_ATOL, max_errors
    assert weight_errors[0] > weight_errors[1] > weight_errors[2] > weight_errors[3] == 0.0, weight_errors


# ---------------------------------------------------------------------------------------------- the truncation's method
def spectrum_deltas(kind: str, batch: int, out_f: int, in_f: int, rank_of: int | None = None) -> list[torch.Tensor]:
    """Float64 deltas: `decaying` (singular values i^-1 on random singular vectors: a trained delta's shape), `flat`
    (the difference of two noisy copies: a random matrix), or exactly of rank `rank_of`."""
    generator = torch.Generator().manual_seed(out_f * 7 + in_f)
    k = min(out_f, in_f)
    if kind == "flat":
        return list(torch.randn(batch, out_f, in_f, generator=generator, dtype=torch.float64).unbind())
    u, _ = torch.linalg.qr(torch.randn(batch, out_f, k, generator=generator, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(batch, in_f, k, generator=generator, dtype=torch.float64))
    s = torch.arange(1, k + 1, dtype=torch.float64) ** -1.0
    if rank_of is not None:
        s[rank_of:] = 0
    return list(((u * s) @ v.mT).unbind())


@pytest.mark.parametrize("shape", [(120, 80), (80, 120)])  # both sides iterated (a transposed batch)
def test_the_subspace_iteration_matches_the_exact_svd(shape):
    from hf_taskmoe.low_rank_svd import truncated_svds, uses_subspace

    for rank in (4, 8):
        assert uses_subspace("auto", rank, shape, "cuda") and not uses_subspace("exact", rank, shape, "cuda")
        assert not uses_subspace("auto", rank, shape, "cpu")  # LAPACK's SVD is as fast there
        for kind in ("decaying", "flat"):
            deltas = spectrum_deltas(kind, 3, *shape)
            exact, none = truncated_svds(deltas, rank, "exact")
            fast, iterations = truncated_svds(deltas, rank, "subspace")
            assert none == 0 and 4 <= iterations <= 64
            for d, (a, b, error), (ax, bx, error_x) in zip(deltas, fast, exact):
                assert a.shape == ax.shape == (rank, shape[1]) and b.shape == bx.shape == (shape[0], rank)
                assert abs(error - float((d - b @ a).norm())) < 1e-9 * float(d.norm())  # the error it reports
                assert error >= error_x * (1 - 1e-12)  # the SVD's truncation is the optimum
                if kind == "decaying":  # a gap in the spectrum: the same reconstruction as the exact SVD's
                    assert float((b @ a - bx @ ax).norm() / (bx @ ax).norm()) < 1e-6, (rank, iterations)
                else:  # flat: the rank-r subspace is barely determined, the truncation error is still the optimum's
                    assert error < error_x * (1 + 1e-6), (error, error_x)


def test_the_subspace_iteration_on_a_rank_deficient_delta_and_at_full_rank():
    from hf_taskmoe.low_rank_svd import truncated_svds, uses_subspace

    deltas = spectrum_deltas("decaying", 2, 100, 90, rank_of=3)  # rank 3 < the rank 8 < the block 24
    fast, iterations = truncated_svds(deltas, 8, "subspace")
    for d, (a, b, error) in zip(deltas, fast):
        assert error < 1e-12 and float((b @ a - d).abs().max()) < 1e-12 and iterations <= 8
    # where the rank carries the whole matrix every method is the exact SVD
    assert not uses_subspace("subspace", 90, (100, 90)) and not uses_subspace("auto", 200, (100, 90))
    # a small matrix ("auto": the exact SVD is as cheap) still iterates under "subspace": a block as wide as it
    assert not uses_subspace("auto", 8, (20, 20), "cuda") and uses_subspace("subspace", 8, (20, 20))
    small = spectrum_deltas("decaying", 2, 20, 20)
    for (a, b, _), (ax, bx, _) in zip(truncated_svds(small, 8, "subspace")[0], truncated_svds(small, 8, "exact")[0]):
        assert float((b @ a - bx @ ax).norm() / (bx @ ax).norm()) < 1e-9


def test_a_failed_iteration_falls_back_to_the_exact_svd(monkeypatch):
    from hf_taskmoe import low_rank_svd

    deltas = spectrum_deltas("decaying", 2, 60, 50)
    exact, _ = low_rank_svd.truncated_svds(deltas, 4, "exact")
    nan = torch.full((2, 50, 4), float("nan"), dtype=torch.float64)
    broken = {  # a factorisation that raises (LAPACK on NaN), one that returns NaN factors (as cuSOLVER may)
        "raises": lambda y: torch.full_like(y, float("nan")),
        "nan": lambda x, q, rank: nan[: x.shape[0], : x.shape[-1], :rank],
    }
    for name, fake in broken.items():
        with monkeypatch.context() as patch:
            patch.setattr(low_rank_svd, "_orthonormalize" if name == "raises" else "_rayleigh_ritz", fake)
            fallen, _ = low_rank_svd.truncated_svds(deltas, 4, "subspace")
        for (a, b, error), (ax, bx, error_x) in zip(fallen, exact):
            assert torch.equal(a, ax) and torch.equal(b, bx) and error == error_x, name


def test_an_export_by_subspace_iteration_agrees_with_the_exact_one(tmp_path):
    model = routed("llama", hidden=64, scale=0.02)  # linears 64 wide (k/v 32): rank 8 iterates on every one
    exact = export_task_adapters(model, tmp_path / "exact", rank=8, svd="exact")
    fast = export_task_adapters(model, tmp_path / "fast", rank=8, svd="subspace")  # "auto" does so on a GPU
    assert (exact.svd, fast.svd) == ("exact", "subspace") and set(exact.svd_iterations.values()) == {0}
    assert all(4 <= i <= 64 for i in fast.svd_iterations.values())
    manifest = json.loads((tmp_path / "fast" / "hf_taskmoe_adapters.json").read_text())
    assert manifest["svd"] == "subspace" and manifest["svd_iterations"] == fast.svd_iterations
    for task in model.config.task_names:  # the optimum's truncation error, to the iteration's tolerance
        assert exact.weight_error[task] * (1 - 1e-12) <= fast.weight_error[task] < exact.weight_error[task] * (1 + 1e-6)
    ref_exact, out_exact = mixed_logits(model, load_peft(tmp_path / "exact", model.config.task_names))
    ref, out = mixed_logits(model, load_peft(tmp_path / "fast", model.config.task_names))
    assert float((out - out_exact).abs().max()) < 1e-4 * float((ref_exact - out_exact).abs().max())
    # lossless: the exact SVD (the optimal truncation) whatever `svd` says
    lossless = export_task_adapters(model, tmp_path / "lossless", rank=8, lossless=True, svd="subspace")
    assert lossless.svd == "exact" and lossless.weight_error == exact.weight_error
    with pytest.raises(ValueError, match="`svd` must be one of"):
        export_task_adapters(model, tmp_path / "bad", svd="randomized")


def test_a_rank_above_the_full_rank_is_capped(tmp_path):
    result = export_task_adapters(routed("llama"), tmp_path, rank=500, tasks=["x"])
    assert (result.rank, result.requested_rank) == (32, 500)


# ---------------------------------------------------------------------------------------------- what LoRA cannot carry
def test_dropped_biases_are_measured_and_lossless_refuses_them(tmp_path):
    model = routed("gpt2")
    with pytest.raises(ValueError, match="lossless=True.*carry_biases=False"):
        export_task_adapters(model, tmp_path / "refused", lossless=True, carry_biases=False)
    assert not (tmp_path / "refused").exists()  # refused before anything was written
    result = export_task_adapters(model, tmp_path / "out", carry_biases=False)
    assert not result.exact and not result.lora_bias
    assert all(v > 0 for task in result.tasks for v in result.dropped[task].values())
    assert any(k.endswith(".bias") for d in result.dropped.values() for k in d)
    assert max_error(model, tmp_path / "out") > 1e-3  # the cost is real and measured


def test_a_norm_with_a_zero_base_weight_is_dropped_not_folded(tmp_path):
    model = routed("llama")
    name, index, experts = routed_layer_experts(model)[0]
    with torch.no_grad():
        experts[0].input_layernorm.weight[0] = 0.0  # the base (expert 0) loses that direction: nothing to fold through
    off_base = [t for t in model.config.task_names if model.hard_route(t)[index] != 0]
    assert off_base
    with pytest.raises(ValueError, match="input_layernorm"):
        export_task_adapters(model, tmp_path / "refused", base="expert0", lossless=True)
    result = export_task_adapters(model, tmp_path / "lossy", base="expert0")
    for task in off_base:
        assert f"{name}.input_layernorm" in result.dropped[task]
        assert f"{name}.input_layernorm" not in result.folded[task]


@pytest.mark.parametrize("arch", ["t5", "mt5"])
def test_t5_exports_and_its_routed_relative_position_table_is_the_cost(arch, tmp_path):
    model = routed(arch)
    with pytest.raises(ValueError, match="relative_attention_bias"):
        export_task_adapters(model, tmp_path / "refused", lossless=True)
    result = export_task_adapters(model, tmp_path / "lossy")
    assert any("relative_attention_bias" in k for d in result.dropped.values() for k in d)
    # shared across experts (what a training option would keep shared), the export is exact
    with torch.no_grad():
        for _, _, experts in routed_layer_experts(model):
            for expert in experts[1:]:
                for a, b in zip(expert.parameters(), experts[0].parameters()):
                    if a.dim() == 2 and a.shape[0] == model.config.dense_config.relative_attention_num_buckets:
                        a.copy_(b)
    result = export_task_adapters(model, tmp_path / "exact", lossless=True)
    assert result.exact
    peft_model = load_peft(tmp_path / "exact", model.config.task_names, AutoModelForSeq2SeqLM)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, VOCAB, (len(MIXED), 7), generator=generator)
    decoder = torch.randint(4, VOCAB, (len(MIXED), 5), generator=generator)
    names = [model.config.task_names[i] for i in MIXED]
    with torch.no_grad():
        ref = model(input_ids=ids, decoder_input_ids=decoder, task_ids=MIXED).logits
        out = peft_model(input_ids=ids, decoder_input_ids=decoder, adapter_names=names).logits
    assert float((ref - out).abs().max()) < FULL_RANK_ATOL
    assert any(result.folded.values())  # the blocks' layer norms, folded into q/k/v, EncDecAttention.q and wi(_0, _1)
    kwargs = dict(max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        ours = model.generate(ids, task_ids=MIXED, **kwargs)
        theirs = peft_model.generate(input_ids=ids, adapter_names=names, **kwargs)
    assert torch.equal(ours, theirs)


# ---------------------------------------------------------------------------------------------- refusals
def test_soft_routes_are_refused_by_name_and_force_argmax_exports_them(tmp_path):
    model = routed("llama", selection="softmax")
    with pytest.raises(ValueError, match=r"soft route \(selection 'softmax'\).*force_argmax=True"):
        export_task_adapters(model, tmp_path / "soft")
    assert not (tmp_path / "soft").exists()
    result = export_task_adapters(model, tmp_path / "argmax", force_argmax=True, tasks=["x"])
    assert result.force_argmax and result.routes["x"] == model.hard_route("x", force_argmax=True)


def test_bad_inputs_are_refused(tmp_path):
    model = routed("llama")
    for rank in (0, -1, True, 2.0, "half"):
        with pytest.raises(ValueError, match="`rank` must be a positive int or 'full'"):
            export_task_adapters(model, tmp_path / "r", rank=rank)
    with pytest.raises(ValueError, match=r"Unknown task\(s\) \['nope'\]"):
        export_task_adapters(model, tmp_path / "t", tasks=["x", "nope"])
    with pytest.raises(ValueError, match="names a task twice"):
        export_task_adapters(model, tmp_path / "t", tasks=["x", "x"])
    with pytest.raises(ValueError, match="non-empty list"):
        export_task_adapters(model, tmp_path / "t", tasks="x")
    with pytest.raises(ValueError, match="`base` must be one of"):
        export_task_adapters(model, tmp_path / "b", base="median")
    with pytest.raises(ValueError, match="must be a LlamaForCausalLM"):
        export_task_adapters(model, tmp_path / "b", base=AutoModelForCausalLM.from_config(dense_config("gpt2")))
    with pytest.raises(ValueError, match="`lossless` must be a bool"):
        export_task_adapters(model, tmp_path / "b", lossless="yes")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="exists and is not empty; pass overwrite=True"):
        export_task_adapters(model, full)
    assert (full / "keep.txt").exists()
    result = export_task_adapters(model, full, overwrite=True, tasks=["y"], rank=2)
    assert isinstance(result, AdapterExport) and not (full / "keep.txt").exists()
    assert sorted(p.name for p in full.iterdir()) == ["README.md", "base", "hf_taskmoe_adapters.json", "y"]
    assert "PeftModel.from_pretrained" in (full / "README.md").read_text()
    with pytest.raises(TypeError, match="task-routed model"):
        export_task_adapters(AutoModelForCausalLM.from_config(dense_config("llama")), tmp_path / "d")


def seq2seq_logits(model, peft_model, seed: int = 0):
    """Both encoder-decoders' logits on one batch mixing the tasks (`MIXED`), and the adapter names of its rows."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (len(MIXED), 7), generator=generator)
    decoder = torch.randint(4, VOCAB, (len(MIXED), 5), generator=generator)
    names = [model.config.task_names[i] for i in MIXED]
    with torch.no_grad():
        return (model(input_ids=ids, decoder_input_ids=decoder, task_ids=MIXED).logits,
                peft_model(input_ids=ids, decoder_input_ids=decoder, adapter_names=names).logits, ids, names)


def test_bart_exports_and_its_post_norm_layer_norms_are_the_cost(tmp_path):
    from transformers import BartConfig, BartForConditionalGeneration

    from hf_taskmoe import BartTaskRouted

    torch.manual_seed(0)
    dense = BartForConditionalGeneration(BartConfig(
        vocab_size=60, d_model=16, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        encoder_attention_heads=2, decoder_attention_heads=2, max_position_embeddings=40, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0,
    )).eval()
    model = move_apart(BartTaskRouted.from_dense(dense, TASKS, expert_noise_variance=0.0,
                                                 selection="gumbel_softmax_st"))
    # BART normalises after the residual: a norm that differs per expert feeds the residual stream, not only the next
    # linears, so it cannot be folded; lossless refuses by name, before writing anything
    with pytest.raises(ValueError, match=r"layer_norm.*post-norm layer's norm feeds the residual stream"):
        model.export_task_adapters(tmp_path / "refused", lossless=True)
    assert not (tmp_path / "refused").exists()
    result = model.export_task_adapters(tmp_path / "lossy")
    dropped = {k.rsplit(".", 2)[-2] for d in result.dropped.values() for k in d}
    assert dropped == {"self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm"}
    assert not any(result.folded.values()) and all(v > 0 for d in result.dropped.values() for v in d.values())
    lossy = load_peft(tmp_path / "lossy", model.config.task_names, AutoModelForSeq2SeqLM)
    ref, out, _, _ = seq2seq_logits(model, lossy)
    assert float((ref - out).abs().max()) > 1e-3  # the cost is real and measured
    # the norms shared across experts (trained so): the export is exact, BART's linear biases in lora_bias
    with torch.no_grad():
        for _, _, experts in routed_layer_experts(model):
            for expert in experts[1:]:
                for name, module in expert.named_modules():
                    if isinstance(module, torch.nn.LayerNorm):
                        module.load_state_dict(experts[0].get_submodule(name).state_dict())
    result = model.export_task_adapters(tmp_path / "exact", lossless=True)
    assert result.exact and result.lora_bias == list(model.config.task_names)
    assert sorted(result.target_modules) == ["fc1", "fc2", "k_proj", "out_proj", "q_proj", "v_proj"]
    peft_model = load_peft(tmp_path / "exact", model.config.task_names, AutoModelForSeq2SeqLM)
    ref, out, ids, names = seq2seq_logits(model, peft_model)
    assert float((ref - out).abs().max()) < FULL_RANK_ATOL
    kwargs = dict(max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        ours = model.generate(ids, task_ids=MIXED, **kwargs)
        theirs = peft_model.generate(input_ids=ids, adapter_names=names, **kwargs)
    assert torch.equal(ours, theirs)


# ---------------------------------------------------------------------------------------------- the declarations
def _declared_folding() -> list[str]:
    from hf_taskmoe.backbones import get_backbone

    from .backbone_matrix import NEW_CONFIGS

    return sorted(a for a in NEW_CONFIGS if get_backbone(a).supports("task-routing")
                  and (get_backbone(a).norm_consumers or get_backbone(a).decoder_norm_consumers))


@pytest.mark.parametrize("arch", _declared_folding())
def test_a_later_architecture_folds_the_norms_its_declaration_names_and_exports_exactly(arch, tmp_path):
    """Each expert's linears and the norms its declaration says feed them (`Backbone.norm_consumers`, an encoder-
    decoder's decoder layers' `decoder_norm_consumers`, Gemma's `1 + w` through `norm_weight_offset`) moved apart, the
    rest shared (Gemma's norms after the sub-layers, Qwen3's q/k norms, UMT5's position tables): every declared norm is
    folded, nothing is dropped, and the peft model gives the routed model's logits at full rank -- the declared
    consumers are each norm's only readers."""
    from hf_taskmoe.backbones import get_backbone

    from .backbone_matrix import NEW_CONFIGS

    declared = get_backbone(arch)
    seq2seq = declared.decoder_layers is not None
    torch.manual_seed(0)
    auto, family = ((AutoModelForSeq2SeqLM, TaskRoutedForSeq2SeqLM) if seq2seq
                    else (AutoModelForCausalLM, TaskRoutedForCausalLM))
    model = family.from_dense(auto.from_config(NEW_CONFIGS[arch]()).eval(), TASKS, expert_noise_variance=0.0,
                              selection="gumbel_softmax_st", num_experts=3)
    generator = torch.Generator().manual_seed(1)
    expected = set()
    with torch.no_grad():
        for name, index, experts in routed_layer_experts(model):
            norms = declared.layer_norm_consumers(seq2seq and f".{declared.decoder_layers}." in f".{name}.")
            expected |= {(name, index, norm) for norm in norms}
            for expert in experts:
                for n, module in expert.named_modules():
                    if isinstance(module, torch.nn.Linear) or n in norms:
                        for p in module.parameters(recurse=False):
                            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    model.eval()
    distinct_routes(model)
    result = model.export_task_adapters(tmp_path / "out", rank="full", lossless=True)
    assert result.exact
    # the mean base differs from every expert: a layer where the tasks take different experts folds each declared norm
    mixed = {i for i in range(model.config.num_routed_layers) if len({r[i] for r in result.routes.values()}) > 1}
    assert mixed and {f for folded in result.folded.values() for f in folded} == {
        f"{name}.{norm}" for name, index, norm in expected if index in mixed}
    peft_model = load_peft(tmp_path / "out", model.config.task_names, auto)
    ref, out = seq2seq_logits(model, peft_model)[:2] if seq2seq else mixed_logits(model, peft_model)
    assert float((ref - out).abs().max()) < FULL_RANK_ATOL


def test_the_method_and_the_package_name_are_the_function():
    import hf_taskmoe

    assert hf_taskmoe.export_task_adapters is export_task_adapters
    for cls in (TaskRoutedForCausalLM, TaskRoutedForSeq2SeqLM, hf_taskmoe.BartTaskRouted):
        assert callable(cls.export_task_adapters) and "LoRA adapter" in cls.export_task_adapters.__doc__
