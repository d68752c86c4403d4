"""PAL attention written out (`explicit_attention`, what `PALAttention` runs on a CPU in training with dropout, where
`scaled_dot_product_attention` would run its composite math fallback) against sdpa and against the attention
written from its definition: the same numbers, the same dropout draws, the same masks, gradients to q, k and v."""

import pytest
import torch
import torch.nn.functional as F

from hf_taskmoe.layers import pals
from hf_taskmoe.layers.pals import (
    PALAttention,
    explicit_attention,
    explicit_attention_wins,
    explicit_packed_attention,
    pal_key_mask,
)

BATCH, HEADS, SEQ, HEAD = 3, 2, 5, 4


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    # (B, h, T, s/h) views of one (B, T, 3, h, s/h) tensor, as `attend_packed` makes them (not contiguous)
    qkv = torch.randn(BATCH, SEQ, 3, HEADS, HEAD, generator=g)
    return [t.requires_grad_() for t in qkv.permute(2, 0, 3, 1, 4).clone().unbind(0)]


def _masks(all_padded_row=False):
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    attention_mask[0, 3:] = 0
    attention_mask[1, 1:] = 0
    if all_padded_row:
        attention_mask[2] = 0
    return {
        "none": None,
        "bool": pal_key_mask(attention_mask, attention_mask),  # True = attend
        "additive": pal_key_mask(attention_mask, attention_mask, dtype=torch.float32),  # 0 / -inf
    }


def _reference(q, k, v, key_mask, dropout):
    """The attention from its definition: softmax(q k^T / sqrt(d) + mask), `F.dropout` on the probabilities, @ v."""
    scores = q @ k.transpose(-1, -2) / HEAD**0.5
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask, float("-inf")) if key_mask.dtype == torch.bool else scores + key_mask
    return F.dropout(scores.softmax(-1), dropout) @ v


@pytest.mark.parametrize("mask", ["none", "bool", "additive"])
def test_without_dropout_it_is_sdpa(mask):
    q, k, v = _qkv()
    key_mask = _masks()[mask]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
    assert torch.allclose(explicit_attention(q, k, v, key_mask, 0.0), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("mask", ["none", "bool", "additive"])
def test_with_dropout_it_is_the_written_out_attention_with_the_same_draws(mask):
    q, k, v = _qkv()
    key_mask = _masks()[mask]
    torch.manual_seed(7)
    out = explicit_attention(q, k, v, key_mask, 0.3)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    torch.manual_seed(7)
    expected = _reference(q, k, v, key_mask, 0.3)
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    assert torch.allclose(out, expected, atol=1e-6, rtol=0)
    assert (out == 0).any() or mask == "none"  # dropout did drop (padded keys' zeros aside, some probabilities)
    for grad, expected_grad in zip(grads, expected_grads):
        assert grad.abs().sum() > 0 and torch.allclose(grad, expected_grad, atol=1e-5, rtol=0)
    # sdpa's math fallback draws its dropout mask the same way: the same numbers for the same seed
    torch.manual_seed(7)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, dropout_p=0.3)
    assert torch.allclose(out, sdpa, atol=1e-6, rtol=0)


def test_bool_and_additive_masks_give_the_same_attention_and_gradients():
    q, k, v = _qkv()
    masks = _masks()
    runs = []
    for mask in ("bool", "additive"):
        torch.manual_seed(3)
        out = explicit_attention(q, k, v, masks[mask], 0.5)
        runs.append((out, torch.autograd.grad(out.sum(), (q, k, v))))
    (out_a, grads_a), (out_b, grads_b) = runs
    assert torch.equal(out_a, out_b)
    for a, b in zip(grads_a, grads_b):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mask", ["bool", "additive"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_a_row_with_every_key_masked_attends_to_nothing_as_with_sdpa(mask, dropout):
    q, k, v = _qkv()
    key_mask = _masks(all_padded_row=True)[mask]
    torch.manual_seed(1)
    out = explicit_attention(q, k, v, key_mask, dropout)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    torch.manual_seed(1)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, dropout_p=dropout)
    assert not out.isnan().any() and torch.equal(out[2], torch.zeros_like(out[2]))
    assert torch.allclose(out, expected, atol=1e-6, rtol=0)
    for grad in grads:
        assert torch.isfinite(grad).all() and torch.equal(grad[2], torch.zeros_like(grad[2]))


def test_the_module_writes_it_out_only_on_a_cpu_in_training_with_dropout(monkeypatch):
    query = torch.zeros(1, 1, 2, 2)
    assert explicit_attention_wins(query, 0.1)
    assert not explicit_attention_wins(query, 0.0)  # eval, or no dropout: sdpa's fused CPU kernel
    assert not explicit_attention_wins(query.to("meta"), 0.1)  # not a CPU: an accelerator's fused kernel takes dropout
    monkeypatch.setattr(pals, "is_capturing", lambda: True)
    assert not explicit_attention_wins(query, 0.1)  # captured for export: the one sdpa operator
    monkeypatch.undo()

    attention = PALAttention(HEADS * HEAD, HEADS, dropout=0.25)
    qkv = torch.randn(BATCH, SEQ, 3 * HEADS * HEAD, generator=torch.Generator().manual_seed(2))
    key_mask = _masks()["additive"]
    q, k, v = qkv.view(BATCH, SEQ, 3, HEADS, HEAD).permute(2, 0, 3, 1, 4)
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(kw) or sdpa(*a, **kw))
    for training, expected_calls in ((True, 0), (False, 1)):
        attention.train(training)
        torch.manual_seed(4)
        out = attention.attend_packed(qkv, key_mask)
        torch.manual_seed(4)
        expected = _reference(q, k, v, key_mask == 0, 0.25 if training else 0.0)
        assert len(calls) == expected_calls
        assert torch.allclose(out, expected.transpose(1, 2).reshape(BATCH, SEQ, -1), atol=1e-6, rtol=0)


def test_it_compiles_in_one_graph_with_the_eager_draws():
    torch._dynamo.reset()
    attention = PALAttention(HEADS * HEAD, HEADS, dropout=0.3).train()
    qkv = torch.randn(BATCH, SEQ, 3 * HEADS * HEAD, generator=torch.Generator().manual_seed(5), requires_grad=True)
    key_mask = _masks()["additive"]
    compiled = torch.compile(attention.attend_packed, fullgraph=True, backend="aot_eager")
    runs = []
    for fn in (attention.attend_packed, compiled):
        torch.manual_seed(6)
        out = fn(qkv, key_mask)
        runs.append((out, torch.autograd.grad(out.square().sum(), qkv)[0]))
    (eager, eager_grad), (out, grad) = runs
    assert torch.allclose(out, eager, atol=1e-6, rtol=0) and (eager == 0).any()
    assert torch.allclose(grad, eager_grad, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", ["none", "bool", "additive", "all_padded_row"])
def test_packed_heads_give_the_written_out_attention_bit_for_bit(mask, dtype):
    """`explicit_packed_attention` (what `attend_packed` runs on a CPU in training: the heads copied out of the
    packed `(B, T, 3s)` projection at once, and `softmax` where no key is masked) against `explicit_attention` of the
    heads split, viewed and transposed one by one (what it ran before): the same output, dropout draws and gradient
    of the packed projection, bit for bit."""
    masks = _masks(all_padded_row=mask == "all_padded_row")
    key_mask = masks["additive" if mask == "all_padded_row" else mask]
    if key_mask is not None and key_mask.dtype != torch.bool:
        key_mask = key_mask.to(dtype)
    g = torch.Generator().manual_seed(8)
    qkv = torch.randn(BATCH, SEQ, 3 * HEADS * HEAD, generator=g).to(dtype).requires_grad_()
    runs = []
    for packed in (True, False):
        torch.manual_seed(9)
        if packed:
            out = explicit_packed_attention(qkv, HEADS, key_mask, 0.3)
        else:
            heads = [part.view(BATCH, SEQ, HEADS, HEAD).transpose(1, 2) for part in qkv.split(HEADS * HEAD, -1)]
            out = explicit_attention(*heads, key_mask, 0.3).transpose(1, 2).reshape(BATCH, SEQ, HEADS * HEAD)
        runs.append((out, torch.autograd.grad(out.float().square().sum(), qkv)[0]))
    (out, grad), (expected, expected_grad) = runs
    assert out.shape == (BATCH, SEQ, HEADS * HEAD) and out.dtype == dtype
    assert not torch.equal(out, explicit_packed_attention(qkv, HEADS, key_mask, 0.0))  # dropout did drop
    assert torch.equal(out, expected) and torch.equal(grad, expected_grad)
    assert not out.isnan().any() and grad.abs().sum() > 0


@pytest.mark.parametrize("mask", ["none", "bool", "additive"])
def test_written_out_attention_of_a_group_without_rows(mask):
    """A group with no rows (ZeRO-3's every-group forward runs each group's PALs, an absent one on zero rows) goes
    through the written-out attention with a padding mask of zero rows: an empty output, and a zero gradient."""
    key_mask = _masks()[mask]
    key_mask = None if key_mask is None else key_mask[:0]
    qkv = torch.randn(0, SEQ, 3 * HEADS * HEAD, requires_grad=True)
    out = explicit_packed_attention(qkv, HEADS, key_mask, 0.3)
    assert out.shape == (0, SEQ, HEADS * HEAD)
    heads = [part.view(0, SEQ, HEADS, HEAD).transpose(1, 2) for part in qkv.split(HEADS * HEAD, -1)]
    assert explicit_attention(*heads, key_mask, 0.3).shape == (0, HEADS, SEQ, HEAD)
    (grad,) = torch.autograd.grad(out.sum(), qkv)
    assert grad.shape == qkv.shape
