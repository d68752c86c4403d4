import pytest
import torch

from hf_taskmoe import BertTaskMoEConfig, TaskSpec
from hf_taskmoe.layers import moe as moe_module
from hf_taskmoe.layers.moe import EXPERT_WEIGHTINGS, TaskMoE

B, S, D, F_, N, T = 3, 5, 16, 24, 4, 3


def _config(num_tasks=T, expert_weighting="gate", compute_aux_loss=False, compute_z_loss=False, **kwargs):
    """The layer reads its config (as transformers' sparse MLPs do); the sizes of this file's tests."""
    return BertTaskMoEConfig(
        tasks=[TaskSpec(name=f"t{i}", num_labels=2) for i in range(num_tasks)],
        hidden_size=D,
        intermediate_size=F_,
        num_hidden_layers=1,
        num_attention_heads=2,
        expert_weighting=expert_weighting,
        router_aux_loss_coef=1.0 if compute_aux_loss else 0.0,
        router_z_loss_coef=1.0 if compute_z_loss else 0.0,
        **kwargs,
    )


def _moe(seed=0, **kwargs):
    torch.manual_seed(seed)
    kwargs = {"num_experts": N, **kwargs}
    moe = TaskMoE(_config(**kwargs))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def _dispatch(monkeypatch, dispatch):
    """MT-TaG's sorted implementation (`"taskmoe_sorted"`, the default on a CPU) on this CPU as it runs here, with its
    loop over the experts (`"sorted_loop"`), or as it runs off the CPU and under torch.compile, with one grouped GEMM
    per projection (`"grouped_mm"`)."""
    monkeypatch.setattr(moe_module, "loops_over_experts", lambda x: dispatch == "sorted_loop")


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, D, generator=g), torch.tensor([0, 2, 1])


def _reference(moe, x, task_ids):
    """Every expert on every token, then the eq. 2-6 mixture: an oracle, not how the layer runs."""
    if moe.gating == "task":
        logits = torch.einsum("bsd,bnd->bsn", x, moe.router.weight[task_ids])
    else:
        logits = x @ moe.router.weight.T
    probs = logits.softmax(-1)
    top_p, top_e = probs.topk(moe.top_k, dim=-1)
    all_out = torch.stack([e(x) for e in moe.experts], dim=2)  # (B, S, N, D)
    chosen = torch.gather(all_out, 2, top_e.unsqueeze(-1).expand(*top_e.shape, D))  # (B, S, k, D)
    return (chosen * top_p.unsqueeze(-1)).sum(2), top_e


@pytest.mark.parametrize("gating", ["task", "shared"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_dispatch_matches_reference(gating, top_k):
    moe = _moe(gating=gating, top_k=top_k)
    x, task_ids = _inputs()
    out = moe(x, task_ids)
    expected, top_e = _reference(moe, x, task_ids)
    torch.testing.assert_close(out.hidden_states, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out.expert_index, top_e)
    assert out.router_logits.dtype == torch.float32 and out.router_logits.shape == (B, S, N)


@pytest.mark.parametrize("dispatch", ["sorted_loop", "grouped_mm"])
def test_top1_routes_each_token_to_one_expert_and_each_expert_sees_only_its_tokens(dispatch, monkeypatch):
    _dispatch(monkeypatch, dispatch)
    moe = _moe()
    seen = {}
    slices = moe_module._experts_on_slices
    def spy(bank, x, ends, *args, **kwargs):
        seen.update(x=x, ends=ends.tolist())
        return slices(bank, x, ends, *args, **kwargs)

    monkeypatch.setattr(moe_module, "_experts_on_slices", spy)
    x, task_ids = _inputs()
    out = moe(x, task_ids)
    assert out.expert_index.shape == (B, S, 1)
    chosen = out.expert_index.flatten()
    counts = torch.bincount(chosen, minlength=N).tolist()
    ends = seen["ends"]
    assert [end - start for start, end in zip([0, *ends[:-1]], ends)] == counts
    assert seen["x"].shape[0] == B * S  # each token once, not every expert on every token
    start = 0
    for e, end in enumerate(ends):  # each expert's slice holds exactly the tokens routed to it, in token order
        assert torch.equal(seen["x"][start:end], x.reshape(-1, D)[chosen == e])
        start = end


def test_task_gates_route_differently_and_shared_gate_ignores_task():
    x = torch.randn(1, S, D).expand(T, S, D)  # the same tokens for every task
    task_ids = torch.arange(T)
    task_moe, shared_moe = _moe(gating="task"), _moe(gating="shared")
    routed = task_moe(x, task_ids).router_logits
    assert not torch.allclose(routed[0], routed[1])
    shared = shared_moe(x, task_ids).router_logits
    assert torch.equal(shared[0], shared[1]) and torch.equal(shared[1], shared[2])


@pytest.mark.parametrize("dispatch", ["sorted_loop", "grouped_mm"])
def test_straight_through_value_is_the_expert_and_gradient_is_the_gates(dispatch, monkeypatch):
    _dispatch(monkeypatch, dispatch)
    gate = _moe(expert_weighting="gate")
    st = _moe(expert_weighting="straight_through")
    x, task_ids = _inputs()
    out = st(x, task_ids)
    experts_only = torch.stack(
        [st.experts[e](x[b, s]) for b in range(B) for s in range(S) for e in [out.expert_index[b, s, 0]]]
    )
    torch.testing.assert_close(out.hidden_states.reshape(-1, D), experts_only, atol=1e-6, rtol=1e-6)

    # d loss / d gate weights: identical for both weightings (only the forward value differs, by g*)
    target = torch.randn(B, S, D)
    for moe in (gate, st):
        (moe(x, task_ids).hidden_states * target).sum().backward()
    assert st.router.weight.grad.abs().sum() > 0
    # chain rule through g*: dL/dg* = <target, E*(x)> under both weightings
    torch.testing.assert_close(st.router.weight.grad, gate.router.weight.grad, atol=1e-5, rtol=1e-4)


def test_dense_layer_has_no_router():
    moe = _moe(num_experts=1)
    x, task_ids = _inputs()
    assert moe.router is None
    torch.testing.assert_close(moe(x, task_ids).hidden_states, moe.experts[0](x))


@pytest.mark.parametrize("gating", ["task", "shared"])
def test_router_runs_in_fp32_under_bf16_autocast(gating, monkeypatch):
    """Under autocast the router turns it off around itself and computes what it computes in fp32, bit for bit;
    where autocast is off it enters no context at all (a dozen Python calls a layer of host time)."""
    autocast = torch.autocast
    entered = []

    class Counting(autocast):
        def __enter__(self):
            entered.append(self.device)
            return super().__enter__()

    monkeypatch.setattr(torch, "autocast", Counting)
    moe = _moe(gating=gating)
    x, task_ids = _inputs()
    fp32 = moe(x, task_ids)
    assert entered == []
    with autocast("cpu", dtype=torch.bfloat16):
        out = moe(x, task_ids)
    assert entered == ["cpu"]
    assert out.router_logits.dtype == torch.float32
    assert torch.equal(out.router_logits, fp32.router_logits) and torch.equal(out.expert_index, fp32.expert_index)
    assert out.hidden_states.shape == (B, S, D)


def test_routing_counts_exclude_padding():
    moe = _moe()
    x, task_ids = _inputs()
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, 3:] = False
    out = moe(x, task_ids, token_mask=mask, output_routing=True)
    expected = torch.zeros(T, N, dtype=torch.long)
    for b in range(B):
        for s in range(S):
            if mask[b, s]:
                expected[task_ids[b], out.expert_index[b, s, 0]] += 1
    assert torch.equal(out.routing_counts, expected)
    assert out.routing_counts.sum() == mask.sum()


def test_aux_and_z_losses_off_by_default_and_match_formulas():
    x, task_ids = _inputs()
    assert _moe()(x, task_ids).aux_loss is None
    moe = _moe(compute_aux_loss=True, compute_z_loss=True)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, -2:] = False
    out = moe(x, task_ids, token_mask=mask)
    logits = out.router_logits[mask]  # (real tokens, N)
    probs = logits.softmax(-1)
    fraction = torch.bincount(probs.argmax(-1), minlength=N).float() / len(probs)
    torch.testing.assert_close(out.aux_loss, N * (fraction * probs.mean(0)).sum())
    torch.testing.assert_close(out.z_loss, (torch.logsumexp(logits, -1) ** 2).mean())


def test_add_task_copies_or_draws_a_gate():
    moe = _moe()
    moe.add_task(init_from=2, std=0.001)
    assert moe.router.weight.shape == (T + 1, N, D)
    assert torch.equal(moe.router.weight[T], moe.router.weight[2])
    moe.add_task(init_from=None, std=0.001)
    assert moe.router.weight[T + 1].std() < 0.01


def test_bad_top_k():
    with pytest.raises(ValueError, match="top_k"):
        TaskMoE(_config(num_experts=2, top_k=3))
    with pytest.raises(ValueError, match="gating"):
        TaskMoE(_config(num_experts=2, gating="per-token"))
    with pytest.raises(ValueError, match="expert_weighting"):
        TaskMoE(_config(num_experts=2, expert_weighting="soft"))


@pytest.mark.parametrize("top_k", [1, 2])
def test_grouped_gemm_dispatch_computes_what_the_sorted_loop_computes(top_k, monkeypatch):
    """MT-TaG's sorted implementation with one grouped GEMM per projection (no host sync: off the CPU and under
    torch.compile) gives its loop's outputs and gradients, with experts that get no token too."""
    x, task_ids = _inputs()
    loop = _moe(top_k=top_k)
    grouped = _moe(top_k=top_k)
    grouped.load_state_dict(loop.state_dict())
    for moe in (loop, grouped):
        with torch.no_grad():
            moe.router.weight[:, 3] = -50.0  # expert 3 gets no token
    a = loop(x, task_ids)
    _dispatch(monkeypatch, "grouped_mm")
    b = grouped(x, task_ids)
    torch.testing.assert_close(a.hidden_states, b.hidden_states, atol=1e-5, rtol=1e-5)
    a.hidden_states.square().sum().backward()
    b.hidden_states.square().sum().backward()
    for (name, p), q in zip(loop.named_parameters(), grouped.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=name)


def _aten_ops(fn) -> set[str]:
    """The aten operators `fn` dispatches, its backward included."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Seen() as seen:
        fn()
    return seen.ops


def test_put_back_off_the_cpu_is_the_copy_with_its_own_gather_backward(monkeypatch):
    """Off the CPU, `put_back_rows` is the copy to the rows alone: `index_copy_`'s own backward is the gather by the
    permutation, so no autograd Function (Python on every step) runs; the same gradient as the Function's."""
    rows, order = torch.randn(6, 4, requires_grad=True), torch.tensor([3, 0, 5, 1, 4, 2])
    target = torch.randn(6, 4)
    monkeypatch.setattr(moe_module, "copy_puts_back", lambda rows: True)
    out = moe_module.put_back_rows(rows, order)
    assert type(out.grad_fn).__name__.startswith("IndexCopy")
    (grad,) = torch.autograd.grad((out * target).sum(), rows)
    function = moe_module._PutBack.apply(rows, order)
    (expected,) = torch.autograd.grad((function * target).sum(), rows)
    assert torch.equal(out, function) and torch.equal(grad, expected)
    assert torch.equal(grad, target.index_select(0, order))


@pytest.mark.parametrize("copy", [True, False], ids=["copy_as_on_a_gpu", "gather_as_on_a_cpu"])
@pytest.mark.parametrize("dispatch", ["sorted_loop", "grouped_mm"])
def test_top1_training_step_scatters_nothing(dispatch, copy, monkeypatch):
    """A top-1 layer's tokens are a permutation of its slots: sorted by a gather and put back by a copy to their rows
    (`index_copy_`, off the CPU) or a gather by the inverse permutation (on a CPU, where the copy is the slower), the
    backward the same two the other way round, and the grouped GEMM's biases reach the slots by a product, so neither
    the forward nor the backward scatters with `index_add_` (atomic adds on a GPU, the put-back's 2.4 ms of a bf16
    training step on an H200 before); the copy builds no inverse permutation (`scatter_`). Both give the same
    numbers."""
    monkeypatch.setattr(moe_module, "copy_puts_back", lambda rows: copy)
    _dispatch(monkeypatch, dispatch)
    x, task_ids = _inputs()
    x.requires_grad_(True)
    moe = _moe()
    ops = _aten_ops(lambda: moe(x, task_ids).hidden_states.square().sum().backward())
    assert not ops & {"index_add", "index_add_", "scatter_add", "scatter_add_", "index_put", "index_put_"}
    assert ("index_copy_" in ops) == copy and ("scatter_" in ops) != copy
    assert ("_grouped_mm" in ops) == (dispatch == "grouped_mm")
    assert all(p.grad is not None for p in moe.parameters()) and x.grad is not None
    grads = [x.grad] + [p.grad for p in moe.parameters()]
    monkeypatch.setattr(moe_module, "copy_puts_back", lambda rows: not copy)
    x.grad = None
    moe.zero_grad(set_to_none=True)
    moe(x, task_ids).hidden_states.square().sum().backward()
    for a, b in zip(grads, [x.grad] + [p.grad for p in moe.parameters()], strict=True):
        assert torch.equal(a, b)


def test_the_default_implementation_per_device_and_dtype():
    """`"taskmoe_auto"` (the default): MT-TaG's sorted implementation on a CPU in every dtype and on an accelerator in
    bf16 and fp32 (its grouped GEMMs there); on an accelerator in fp16 with at most 4 experts transformers' `eager`
    (every expert on every token: torch's grouped GEMM has no fast fp16 kernel and reads its offsets back)."""
    from hf_taskmoe.layers.moe import default_experts_implementation as default

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert default("cpu", dtype, 4) == default(torch.device("cpu"), dtype, 64) == "taskmoe_sorted"
    for device in ("cuda", torch.device("cuda", 1), "xpu"):
        assert default(device, torch.bfloat16, 4) == default(device, torch.float32, 4) == "taskmoe_sorted"
        assert default(device, torch.float16, 4) == default(device, torch.float16, 2) == "eager"
        assert default(device, torch.float16, 8) == "taskmoe_sorted"


def test_the_default_runs_the_sorted_loop_on_a_cpu_and_grouped_gemms_under_compile():
    """On a CPU the default is MT-TaG's sorted implementation with its loop in eager code and its grouped GEMMs
    under torch.compile (no graph break); the same values as naming it."""
    moe = _moe()
    assert moe.config._experts_implementation == "taskmoe_auto"
    x, task_ids = _inputs()
    assert moe_module.loops_over_experts(x)
    named = _moe(experts_implementation="taskmoe_sorted")
    torch.testing.assert_close(moe(x, task_ids).hidden_states, named(x, task_ids).hidden_states, atol=0, rtol=0)
    decisions = []
    torch.compile(lambda x: decisions.append(moe_module.loops_over_experts(x)) or x, fullgraph=True,
                  backend="eager")(x)
    assert decisions == [False]


@pytest.mark.parametrize("dispatch", ["sorted_loop", "grouped_mm"])
@pytest.mark.parametrize("weighting", EXPERT_WEIGHTINGS)
@pytest.mark.parametrize("gating", ["task", "shared"])
def test_inference_without_gradients_computes_what_training_computes(dispatch, weighting, gating, monkeypatch):
    """Without gradients a top-1 layer sorts by a gather and puts back by a copy, with the biases and the task gates
    gathered (the cheaper ops when nothing is differentiated); with them, gathers both ways and one-hot products: the
    same values."""
    _dispatch(monkeypatch, dispatch)
    moe = _moe(expert_weighting=weighting, gating=gating).eval()
    x, task_ids = _inputs()
    with torch.no_grad():
        plain = moe(x, task_ids).hidden_states
    differentiable = moe(x.requires_grad_(True), task_ids).hidden_states
    torch.testing.assert_close(plain, differentiable.detach(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dispatch", ["sorted_loop", "grouped_mm"])
def test_top2_trains_under_bf16_autocast_summing_a_tokens_experts_in_its_dtype(dispatch, monkeypatch):
    """Under autocast a top-2 layer's experts compute in bf16 and a token's two weighted outputs are summed in the
    input's dtype (fp32), forward and backward (only a top-1 layer casts its tokens before the permutation, which
    then sums nothing): the same routes as in fp32 (the router runs in fp32) and its outputs within bf16's rounding."""
    _dispatch(monkeypatch, dispatch)
    moe = _moe(top_k=2)
    x, task_ids = _inputs()
    x.requires_grad_(True)
    fp32 = moe(x, task_ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = moe(x, task_ids)
    out = mixed.hidden_states
    assert out.dtype == torch.float32 and torch.equal(mixed.expert_index, fp32.expert_index)
    torch.testing.assert_close(out, fp32.hidden_states, atol=5e-2, rtol=2e-2)
    out.square().sum().backward()
    assert x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in moe.parameters())


def test_moe_layers_of_a_forward_share_the_task_one_hot_and_the_expert_range(monkeypatch):
    """The rows' tasks as one-hot rows and `arange(num_experts)` are made once per model forward, by the first MoE
    layer (`BackboneTaskMoE.shared_tensor`): a model of three MoE layers runs as many `arange`s as one of one layer
    (with the put-back of an accelerator, which builds no inverse permutation), and the same numbers with activation
    checkpointing (the recomputed layers read the forward's)."""
    from hf_taskmoe import BertForTaskMoE
    monkeypatch.setattr(moe_module, "copy_puts_back", lambda rows: True)
    _dispatch(monkeypatch, "grouped_mm")

    def step(layers, checkpointing=False):
        torch.manual_seed(0)
        config = BertTaskMoEConfig(tasks=[TaskSpec(name=f"t{i}", num_labels=2) for i in range(T)], hidden_size=D,
                                   intermediate_size=F_, num_hidden_layers=layers, num_attention_heads=2,
                                   num_experts=N, vocab_size=64)
        model = BertForTaskMoE(config).train()
        for name, p in model.named_parameters():
            if "router" in name:
                torch.nn.init.normal_(p, std=0.5)
        if checkpointing:
            # (transformers 5 renamed it; the task model makes the checkpoint non-reentrant itself)
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        ids = torch.randint(1, 64, (3, 6), generator=torch.Generator().manual_seed(2))
        ops = []

        def run():
            torch.manual_seed(1)
            out = model(input_ids=ids, task_ids=torch.tensor([0, 2, 1]), labels=torch.tensor([0, 1, 1]))
            out.loss.backward()
            ops.append(out.loss.detach())

        aranges = _aten_op_calls(run).count("arange")
        return aranges, ops[0], [p.grad for p in model.parameters()]

    one, _, _ = step(1)
    three, loss, grads = step(3)
    assert three == one
    _, loss_ckpt, grads_ckpt = step(3, checkpointing=True)
    assert torch.equal(loss, loss_ckpt)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ckpt, strict=True))


def _aten_op_calls(fn) -> list[str]:
    """Every aten operator call `fn` dispatches, in order, its backward included."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Seen():
        fn()
    return calls
