"""`LowRankExperts` (hf_taskmoe/layers/low_rank.py): the two paths of the deltas give the same values on one-hot
decisions and the same gradients, the dense output exactly while every B is zero, peft's init, Conv1D's layout."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_taskmoe.backbones import TaskContext
from hf_taskmoe.layers.low_rank import LowRankExperts, LowRankSpec, expert_path, wrap_linears

E, R, IN, OUT, BATCH, T = 3, 4, 12, 10, 5, 6


def _module(kind: str = "linear", randomise_b: bool = True, seed: int = 0) -> LowRankExperts:
    torch.manual_seed(seed)
    base = nn.Linear(IN, OUT) if kind == "linear" else Conv1D(OUT, IN)
    module = LowRankExperts(base, E, R, alpha=2 * R, context=TaskContext()).double()
    if randomise_b:
        with torch.no_grad():
            module.lora_B.normal_()
    return module


def _reference(module: LowRankExperts, x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The definition, one row and one expert at a time: `base(x_b) + s * sum_j d_bj B_j A_j x_b`."""
    rows = []
    for b in range(x.shape[0]):
        y = module.base_layer(x[b])
        for j in range(E):
            y = y + module.scaling * d[b, j] * (x[b] @ module.lora_A[j].T @ module.lora_B[j].T)
        rows.append(y)
    return torch.stack(rows)


def _one_hot(choice) -> torch.Tensor:
    return nn.functional.one_hot(torch.tensor(choice), E).double()


def _run(module, x, d, path):
    module.context.begin(torch.zeros(x.shape[0], dtype=torch.long), routing_weights=d[:, None, :], expert_path=path)
    try:
        return module(x)
    finally:
        module.context.end()


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_both_paths_match_the_definition_on_one_hot_decisions(kind):
    module = _module(kind)
    x = torch.randn(BATCH, T, IN, dtype=torch.float64)
    d = _one_hot([0, 2, 1, 2, 0])
    reference = _reference(module, x, d)
    for path in ("mix", "one"):
        torch.testing.assert_close(_run(module, x, d, path), reference, rtol=1e-10, atol=1e-10)


def test_mix_path_matches_the_definition_on_soft_decisions():
    module = _module()
    x = torch.randn(BATCH, T, IN, dtype=torch.float64)
    d = torch.softmax(torch.randn(BATCH, E, dtype=torch.float64), -1)
    torch.testing.assert_close(_run(module, x, d, "mix"), _reference(module, x, d), rtol=1e-10, atol=1e-10)
    # the one-expert path takes each row's arg-max expert times its decision: not the mixture
    assert not torch.allclose(_run(module, x, d, "one"), _reference(module, x, d))


def test_paths_give_the_same_gradients_under_a_hard_route():
    """The `hard` selection's decisions: one-hot in value, `p / sg(p)` gradient; both paths send the same gradients to
    x, A, B and the router's logits."""
    module = _module()
    x0 = torch.randn(BATCH, T, IN, dtype=torch.float64)
    logits0 = torch.randn(BATCH, E, dtype=torch.float64)
    choice = torch.tensor([1, 0, 2, 2, 1])
    grads = {}
    for path in ("mix", "one"):
        module.zero_grad()
        x, logits = x0.clone().requires_grad_(), logits0.clone().requires_grad_()
        hard = nn.functional.one_hot(choice, E).double()
        p = (torch.softmax(logits, -1) * hard).sum(-1, keepdim=True)
        d = hard * (p / p.detach())
        _run(module, x, d, path).square().sum().backward()
        grads[path] = [x.grad, logits.grad, module.lora_A.grad.clone(), module.lora_B.grad.clone()]
    for a, b in zip(grads["mix"], grads["one"]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert grads["one"][1].abs().sum() > 0  # the router learns through the chosen expert


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("path", ["mix", "one"])
def test_zero_b_gives_the_dense_output_exactly_under_any_decisions(kind, path):
    module = _module(kind, randomise_b=False).float()
    x = torch.randn(BATCH, T, IN)
    for d in (torch.rand(BATCH, E) * 5 - 2, _one_hot([2, 2, 0, 1, 0]).float(), torch.zeros(BATCH, E)):
        assert torch.equal(_run(module, x, d, path), module.base_layer(x))


def test_init_follows_peft():
    module = _module(randomise_b=False)
    assert torch.equal(module.lora_B, torch.zeros_like(module.lora_B))
    bound = 1 / math.sqrt(IN)  # Kaiming-uniform with a = sqrt(5): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert module.lora_A.abs().max() <= bound
    assert module.lora_A.abs().max() > 0.5 * bound
    assert not torch.equal(module.lora_A[0], module.lora_A[1])  # each expert its own draw
    assert module.scaling == 2.0


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_delta_weight_is_the_delta_in_the_base_layout(kind):
    module = _module(kind)
    x = torch.randn(BATCH, T, IN, dtype=torch.float64)
    merged = module.base_layer.weight + module.delta_weight(2)
    dense = nn.functional.linear(x, merged, module.base_layer.bias) if kind == "linear" else \
        x @ merged + module.base_layer.bias
    torch.testing.assert_close(_run(module, x, _one_hot([2] * BATCH), "one"), dense, rtol=1e-10, atol=1e-10)


def test_outside_a_forward_it_asks_for_task_ids():
    module = _module()
    with pytest.raises(RuntimeError, match="task ids"):
        module(torch.randn(2, 3, IN, dtype=torch.float64))


def test_expert_path_is_chosen_from_the_configuration():
    assert expert_path("hard", needs_every_expert=False, decisions_given=False) == "one"
    assert expert_path("gumbel_softmax_st", needs_every_expert=False, decisions_given=False) == "one"
    assert expert_path("gumbel_softmax_st", needs_every_expert=True, decisions_given=False) == "mix"
    for soft in ("softmax", "average", "gumbel_softmax"):
        assert expert_path(soft, needs_every_expert=False, decisions_given=False) == "mix"
    assert expert_path("hard", needs_every_expert=False, decisions_given=True) == "mix"


def test_wrap_linears_takes_the_targets_by_suffix():
    layer = nn.Module()
    layer.attn = nn.Module()
    layer.attn.q_proj, layer.attn.k_proj = nn.Linear(4, 4), nn.Linear(4, 4)
    layer.mlp = nn.Linear(4, 8)
    layer.norm = nn.LayerNorm(4)
    assert wrap_linears(layer, LowRankSpec(2, 2, 2.0, targets=("q_proj", "mlp")), 0, TaskContext()) == [
        "attn.q_proj", "mlp"]
    assert isinstance(layer.attn.q_proj, LowRankExperts) and isinstance(layer.attn.k_proj, nn.Linear)
