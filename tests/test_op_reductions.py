"""The op-count reductions of issue 34 compute what the code before them computed (`benchmarks/op_count.py`,
docs/benchmarks.md "Operations per training step"): each test runs a written-out copy of the earlier computation
beside the layer and compares values and gradients."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from hf_taskmoe import BertPALsConfig, BertTaskMoEConfig, BertWithPALs, CAMTLConfig, CAMTLModel, TaskSpec
from hf_taskmoe.layers import moe as moe_module
from hf_taskmoe.layers.conditional import (
    ConditionalAlignment,
    ConditionalAttentionBias,
    ConditionalBottleneck,
    ConditionalLayerNorm,
    Conditioning,
)
from hf_taskmoe.layers.moe import TaskMoE
from hf_taskmoe.layers.pals import PALAttention, explicit_attention, explicit_attention_wins, pal_key_mask
from hf_taskmoe.models.pals import modeling_pals

from .conftest import TINY, random_batch

B, S, D, F_, N, T = 3, 5, 16, 24, 4, 3


# ----------------------------------------------------------------------------------------------------- MT-TaG


def _moe(top_k, weighting, seed=0):
    torch.manual_seed(seed)
    config = BertTaskMoEConfig(
        tasks=[TaskSpec(name=f"t{i}", num_labels=2) for i in range(T)], hidden_size=D, intermediate_size=F_,
        num_hidden_layers=1, num_attention_heads=2, num_experts=N, top_k=top_k, expert_weighting=weighting,
    )
    moe = TaskMoE(config)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    with torch.no_grad():
        moe.router.weight[:, 3] = -50.0  # expert 3 gets no token: it still runs, on its empty slice
    return moe


def _earlier_forward(moe: TaskMoE, hidden: torch.Tensor, task_ids: torch.Tensor, dispatch: str) -> torch.Tensor:
    """`TaskMoE.forward`'s output as the layer computed it before the reductions: counts by `scatter_add_`, their
    `cumsum` as the grouped GEMM's offsets, the experts' ids gathered by the sort order, the weights gathered in
    sorted order, the top-1 straight-through weight as `renormalised + (p - sg(p))`."""
    batch, seq, hidden_size = hidden.shape
    logits = moe.route(hidden, task_ids)
    top_p, top_e = logits.softmax(dim=-1).topk(moe.top_k, dim=-1)
    if moe.expert_weighting == "gate":
        weights = top_p
    else:
        weights = (top_p / top_p.sum(dim=-1, keepdim=True)).detach() + (top_p - top_p.detach())
    x, flat_expert, flat_weight = hidden.reshape(-1, hidden_size), top_e.reshape(-1), weights.reshape(-1)
    order = torch.argsort(flat_expert, stable=True)
    counts = torch.zeros(moe.num_experts, dtype=torch.long).scatter_add_(0, flat_expert, torch.ones_like(flat_expert))
    token_of_slot = order // moe.top_k if moe.top_k > 1 else order
    x_sorted = x.index_select(0, token_of_slot)
    if dispatch == "grouped_mm":
        ends = counts.cumsum(0).to(torch.int32)
        sorted_expert = flat_expert.index_select(0, order)
        bank = moe.experts  # the experts' weights, stacked (they were stacked for the call before)
        h = F.grouped_mm(x_sorted, bank.up_proj.transpose(1, 2), offs=ends)
        h = bank.act_fn(h + bank.up_proj_bias.index_select(0, sorted_expert))
        y_sorted = F.grouped_mm(h, bank.down_proj.transpose(1, 2), offs=ends)
        y_sorted = y_sorted + bank.down_proj_bias.index_select(0, sorted_expert)
    else:
        chunks = x_sorted.split(counts.tolist())
        y_sorted = torch.cat([expert(chunk) for expert, chunk in zip(moe.experts, chunks)])
    y_sorted = y_sorted * flat_weight.index_select(0, order).unsqueeze(-1)
    if moe.top_k == 1:
        y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)
    else:
        y = torch.zeros_like(x).index_add_(0, token_of_slot, y_sorted)
    return y.view(batch, seq, hidden_size)


@pytest.mark.parametrize("dispatch", ["sorted_loop", "grouped_mm"])
@pytest.mark.parametrize("weighting", ["gate", "straight_through"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_dispatch_computes_what_it_computed_before(top_k, weighting, dispatch, monkeypatch):
    # MT-TaG's sorted implementation with its loop (this CPU's) or its grouped GEMMs (off the CPU, under compile)
    monkeypatch.setattr(moe_module, "loops_over_experts", lambda x: dispatch == "sorted_loop")
    g = torch.Generator().manual_seed(1)
    hidden, task_ids = torch.randn(B, S, D, generator=g), torch.tensor([0, 2, 1])
    target = torch.randn(B, S, D, generator=g)
    now, before = _moe(top_k, weighting), _moe(top_k, weighting)
    out = now(hidden, task_ids).hidden_states
    expected = _earlier_forward(before, hidden, task_ids, dispatch)
    assert torch.equal(out, expected)  # the same operations on the same values: bit for bit
    (out * target).sum().backward()
    (expected * target).sum().backward()
    for (name, p), q in zip(now.named_parameters(), before.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-6, msg=name)
    assert all(p.grad is not None for p in now.experts.parameters())  # every expert's slices are on the graph


def test_top1_straight_through_weight_is_exactly_one_with_the_gate_gradient():
    moe = _moe(1, "straight_through")
    top_p = (torch.rand(B, S, 1) + 0.25).requires_grad_()
    weights = moe._combine_weights(top_p)
    assert torch.equal(weights, torch.ones_like(weights))
    weights.sum().backward()
    assert torch.equal(top_p.grad, torch.ones_like(top_p))


# ----------------------------------------------------------------------------------------------------- CA-MTL


def _randomised(module, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return module


def _conditionings():
    g = torch.Generator().manual_seed(2)
    table = torch.randn(3, 8, generator=g, requires_grad=True)
    task_ids = torch.tensor([0, 2, 1, 2])
    return table, Conditioning(table, task_ids), Conditioning.gathered(table, task_ids)


@pytest.mark.parametrize(
    "make", [
        lambda: ConditionalLayerNorm(12, 8),
        lambda: ConditionalAlignment(12, 8),
        lambda: ConditionalBottleneck(12, 5, 8),
    ],
    ids=["layer_norm", "alignment", "bottleneck"],
)
def test_rows_gathered_once_give_each_films_per_task_values_and_gradients(make):
    module = _randomised(make())
    hidden = torch.randn(4, 6, 12, generator=torch.Generator().manual_seed(3))
    results = []
    for index in (1, 2):  # per task then gathered, and gathered first
        table, *conds = _conditionings()
        module.zero_grad()
        out = module(hidden, conds[index - 1])
        out.square().sum().backward()
        results.append((out, table.grad, [p.grad.clone() for p in module.parameters()]))
    (a, ga, pa), (b, gb, pb) = results
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ga, gb, atol=1e-5, rtol=1e-5)
    for x, y in zip(pa, pb, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_conditional_layer_norm_is_eq3():
    """The norm's weight inside the fused layer norm, times gamma(z): eq. 3 up to rounding."""
    cln = _randomised(ConditionalLayerNorm(12, 8))
    table, cond, _ = _conditionings()
    hidden = torch.randn(4, 6, 12, generator=torch.Generator().manual_seed(3))
    gamma, beta = cln.film(table)
    gamma, beta = gamma[cond.task_ids].unsqueeze(1), beta[cond.task_ids].unsqueeze(1)
    expected = F.layer_norm(hidden, (12,), eps=cln.eps) * (cln.weight * gamma) + (cln.bias + beta)
    torch.testing.assert_close(cln(hidden, cond), expected, atol=1e-6, rtol=1e-6)


def test_attention_bias_gathers_each_rows_task_matrix_cropped():
    bias = _randomised(ConditionalAttentionBias(max_length=10, num_blocks=3, task_dim=8))
    table, cond, _ = _conditionings()
    key_mask = torch.ones(4, 7, dtype=torch.long)
    key_mask[1, 5:] = 0
    out = bias(cond, key_mask, 7, torch.float32)
    full = bias.task_matrices(table, 7)  # (tasks, 7, 7)
    expected = full[cond.task_ids].unsqueeze(1).masked_fill(~key_mask.bool()[:, None, None, :],
                                                            torch.finfo(torch.float32).min)
    assert out.shape == (4, 1, 7, 7)
    assert torch.equal(out, expected)


def test_camtl_training_step_is_the_per_task_conditioned_one():
    """A whole CA-MTL forward and backward with the rows gathered once and every FiLM's output made in one product
    of the rows (or of the table, the attention biases'), as `_run_encoder` does, against the same model with every
    FiLM gathering its own per-task output: loss and every gradient agree, on the same parameters."""
    tasks = [TaskSpec(name="a", num_labels=2), TaskSpec(name="b", num_labels=3), TaskSpec(name="c", num_labels=2)]
    torch.manual_seed(0)
    model = CAMTLModel(CAMTLConfig(tasks=tasks, **dict(TINY, num_hidden_layers=4),
                                   conditional_attention_max_length=16))
    _randomised_conditioning(model)
    model.train()
    batch = random_batch(model.config, batch=5, task_ids=torch.tensor([0, 1, 2, 1, 0]))
    batch["labels"] = torch.tensor([1, 2, 0, 0, 1])
    runs = []
    for gathered in (True, False):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)  # the same dropout masks
        if gathered:
            loss = model(**batch).loss
        else:
            original = Conditioning.gathered
            Conditioning.gathered = classmethod(lambda cls, table, task_ids, *films: cls(table, task_ids))
            try:
                loss = model(**batch).loss
            finally:
                Conditioning.gathered = original
        loss.backward()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = runs
    torch.testing.assert_close(loss_a, loss_b, atol=1e-6, rtol=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=1e-5, rtol=1e-4, msg=name)


def test_camtl_makes_its_films_and_attention_biases_together_unless_a_sharding_engine_holds_the_weights(monkeypatch):
    """Every FiLM of the model but the attention biases' is made by one `many_films` call per forward, and every
    layer's attention bias (FiLM included) by one `many_biases` call. A weight held by a sharding engine (here a
    parameter swapped in after the first forward and marked as ZeRO-3 marks its partitions) turns that off: each
    module then runs itself, inside its layer, with the same numbers."""
    from hf_taskmoe.layers import conditional
    from hf_taskmoe.layers.conditional import FiLM

    tasks = [TaskSpec(name="a", num_labels=2), TaskSpec(name="b", num_labels=3)]
    torch.manual_seed(0)
    model = CAMTLModel(CAMTLConfig(tasks=tasks, **dict(TINY, num_hidden_layers=4),
                                   conditional_attention_max_length=16)).eval()
    _randomised_conditioning(model)
    batch = random_batch(model.config, batch=4, task_ids=torch.tensor([0, 1, 1, 0]))
    batch["attention_mask"][1, -2:] = 0
    calls = []
    for name in ("many_films", "many_biases"):
        original = getattr(conditional, name)
        monkeypatch.setattr(conditional, name, lambda modules, *args, f=original, n=name: calls.append(
            (n, modules)) or f(modules, *args))
    together = model(**batch).logits
    films = {m for m in model.modules() if isinstance(m, FiLM)}
    biases = [m for m in model.modules() if isinstance(m, ConditionalAttentionBias)]
    made = dict(calls)
    assert len(calls) == 2 and len(biases) > 1
    assert set(made["many_films"]) == films - {bias.film for bias in biases} and list(made["many_biases"]) == biases
    calls.clear()
    # an engine's own parameter swapped in after the model's first forward (as FSDP2 and ZeRO-3 do)
    biases[0].blocks = torch.nn.Parameter(biases[0].blocks.detach().clone())
    biases[0].blocks.ds_id = 0
    apart = model(**batch).logits
    assert calls == []
    torch.testing.assert_close(apart, together, atol=1e-6, rtol=1e-6)


def _randomised_conditioning(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".film." in name or "bottleneck.up" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.05)


# ----------------------------------------------------------------------------------------------------------- PALs


def _pal_inputs(seed=4):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(3, 7, 3 * 12, generator=g)
    attention_mask = torch.ones(3, 7, dtype=torch.long)
    attention_mask[0, 4:] = 0
    return qkv, attention_mask


@pytest.mark.parametrize("training", [False, True])
def test_packed_heads_and_the_additive_mask_give_the_same_attention(training):
    """`attend_packed` splits the heads with one view + permute (the same strides as `attend`'s split, view and
    transposes), and the additive key mask made once is what sdpa makes of the bool one: the same numbers, bit for
    bit, with dropout's draws too."""
    attention = PALAttention(12, 3, dropout=0.2).train(training)
    qkv, attention_mask = _pal_inputs()
    keep = pal_key_mask(attention_mask, encoder_mask=attention_mask)
    additive = pal_key_mask(attention_mask, encoder_mask=attention_mask, dtype=torch.float32)
    assert keep.dtype == torch.bool and additive.dtype == torch.float32
    assert torch.equal(additive, torch.where(keep, 0.0, float("-inf")))
    torch.manual_seed(0)
    # what the separate query / key / value path did: each split into heads by a view and a transpose
    heads = [part.view(3, 7, 3, 4).transpose(1, 2) for part in qkv.chunk(3, dim=-1)]  # (B, h, T, s/h)
    dropout = 0.2 if training else 0.0
    if explicit_attention_wins(heads[0], dropout):  # the written-out attention of the heads, or sdpa's
        before = explicit_attention(*heads, keep, dropout)
    else:
        before = F.scaled_dot_product_attention(*heads, attn_mask=keep, dropout_p=dropout)
    before = before.transpose(1, 2).reshape(3, 7, 12)
    torch.manual_seed(0)
    now = attention.attend_packed(qkv, additive)
    assert torch.equal(before, now)


def test_additive_mask_takes_autocasts_dtype():
    _, attention_mask = _pal_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mask = pal_key_mask(attention_mask, attention_mask, dtype=torch.float32)
    assert mask.dtype == torch.bfloat16
    attention = PALAttention(12, 3).eval()
    qkv = _pal_inputs()[0].bfloat16()  # a mask made for another dtype is cast to the queries'
    out = attention.attend_packed(qkv, pal_key_mask(attention_mask, attention_mask, dtype=torch.float32))
    expected = attention.attend_packed(qkv, pal_key_mask(attention_mask, attention_mask))
    assert torch.equal(out, expected)


def test_pals_training_step_is_the_one_with_the_bool_mask(monkeypatch):
    torch.manual_seed(0)
    model = BertWithPALs(BertPALsConfig(tasks=[TaskSpec(name=n, num_labels=2) for n in "abc"], pal_size=12,
                                        pal_num_heads=3, pal_decoder_init="normal", **TINY)).train()
    batch = random_batch(model.config, batch=5, task_ids=torch.tensor([0, 1, 2, 1, 0]))
    batch["labels"] = torch.tensor([1, 0, 0, 1, 1])
    runs = []
    for additive in (True, False):
        if not additive:  # what the model did before: the bool mask, made additive by sdpa in every layer
            monkeypatch.setattr(modeling_pals, "pal_key_mask", lambda mask, encoder_mask, dtype=None:
                                pal_key_mask(mask, encoder_mask))
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        loss = model(**batch).loss
        loss.backward()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = runs
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


# ------------------------------------------------------------------------------------ host path (issue 46, item 3)


def _earlier_attention_bias(bias: ConditionalAttentionBias, cond: Conditioning, length: int) -> torch.Tensor:
    """`ConditionalAttentionBias.forward` (no key mask) as it computed before its one gather: the rows' task matrices
    by `index_select`, then the crop by one `index_select` of rows and one of columns."""
    keep = torch.arange(length)
    full = bias._full_matrices(cond.table)  # (tasks, 1, N*b, N*b)
    return full.index_select(0, cond.task_ids).index_select(2, keep).index_select(3, keep)


@pytest.mark.parametrize("length", [7, 10, 12])  # shorter than, equal to the maximum, and the full N*b (3 x 4)
def test_attention_bias_one_gather_is_the_three_index_selects(length):
    from hf_taskmoe.layers.conditional import bias_positions

    max_length = 12 if length == 12 else 10
    now, before = (_randomised(ConditionalAttentionBias(max_length=max_length, num_blocks=3, task_dim=8))
                   for _ in range(2))
    table, cond, _ = _conditionings()
    out = now(cond, None, length, torch.float32)
    expected = _earlier_attention_bias(before, cond, length)
    assert out.shape == (4, 1, length, length)
    assert torch.equal(out, expected)
    # the positions the model makes once for every layer give the same matrices
    positions = bias_positions(cond.task_ids, length, now.full_size)
    assert torch.equal(now(cond, None, length, torch.float32, positions=positions), out)
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    (out * target).sum().backward()
    (expected * target).sum().backward()
    for (name, p), q in zip(now.named_parameters(), before.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def _heads_step(model, batch, task_rows_of):
    """Loss, logits, per-task losses and head gradients of the stacked heads on the model's pooled output, with the
    batch split by `task_rows_of(task_ids)`."""
    torch.manual_seed(3)
    pooled = torch.randn(batch["labels"].shape[0], model.config.hidden_size, generator=torch.Generator()
                         .manual_seed(4), requires_grad=True)
    task_rows = task_rows_of(batch["task_ids"])
    prepared = model.heads.check_inputs(task_rows, 6, batch["labels"], None, check_values=False)
    model.zero_grad(set_to_none=True)
    out = model.heads(None, pooled, task_rows, prepared)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.heads.named_parameters() if p.grad is not None}
    return out, grads, pooled.grad


@pytest.mark.parametrize("task_ids", [[0, 2, 1, 2, 0], [1, 2, 2, 1, 1]], ids=["first_tasks", "later_tasks"])
def test_stacked_heads_take_each_rows_position_from_the_sorted_task_ids(task_ids):
    """The stacked heads read each row's position among the tasks present from `split_rows`' sorted task ids when
    the tasks present are the first ones, and fill it per task otherwise (a plain dict of rows): the same numbers."""
    torch.manual_seed(0)
    model = BertWithPALs(BertPALsConfig(tasks=[TaskSpec(name=n, num_labels=2) for n in "abc"], pal_size=12,
                                        pal_num_heads=3, **TINY)).train()
    batch = {"task_ids": torch.tensor(task_ids), "labels": torch.tensor([1, 0, 0, 1, 1])}
    split = model.heads.split_rows
    now = _heads_step(model, batch, split)
    before = _heads_step(model, batch, lambda ids: dict(split(ids)))  # no sorted ids: filled per task
    assert torch.equal(now[0].loss, before[0].loss)
    assert torch.equal(now[0].logits, before[0].logits)
    assert now[0].task_losses.keys() == before[0].task_losses.keys()
    for name in now[0].task_losses:
        assert torch.equal(now[0].task_losses[name], before[0].task_losses[name]), name
    assert now[1].keys() == before[1].keys()
    for name in now[1]:
        assert torch.equal(now[1][name], before[1][name]), name
    assert torch.equal(now[2], before[2])


def test_task_context_casts_the_mask_only_when_read():
    from hf_taskmoe.backbones import TaskContext

    context = TaskContext()
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    context.begin(torch.tensor([0, 1]), mask)
    assert context._token_mask is None  # nothing made until a module reads it
    assert torch.equal(context.token_mask, mask.bool())
    assert context.token_mask is context.token_mask  # made once per forward
    context.end()
    assert context.token_mask is None
