"""Task-routed generation at the dense model's cost under hard routes (issue 46 item 5): `generate` of a
`TaskRoutedForCausalLM` runs, in each routed layer, only the experts the rows use. With `group_hard_routes=True` (the
default off the CPU) a layer whose rows use several experts runs them as one layer (`layers.grouped_routes`: one
grouped GEMM per linear over the experts' row segments, one cache slot holding every row sorted by expert); with
`False` (the CPU's default) each expert runs on its own rows, each keeping its own rows in its cache slot
(`ExpertRowsCache`). Both tested token for token against the every-expert path (`every_expert=True`, what a forward
runs) and against `export_task`, for one task, mixed tasks with left padding and beam search, on GPT-2, Llama and
Qwen2 (a sliding-window layer); soft routes keep the every-expert path."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_taskmoe.compat import CACHE_ARG
from hf_taskmoe.layers.routing import ExpertRowsCache

from .test_host_syncs import host_reads
from .test_task_routed_lm import MIXED, prompts, routed, train

ARCHS = ["gpt2", "llama", "qwen2"]
ONE_TASK = torch.tensor([1, 1, 1, 1])


@pytest.fixture(scope="module", params=ARCHS)
def hard_model(request):
    """A model trained a few steps under hard routes: the tasks' routes differ and the experts learned apart."""
    torch.manual_seed(0)
    model = train(routed(request.param, selection="hard", num_experts=3))
    routes = model.task_routing().argmax(-1)  # (tasks, layers)
    assert len({tuple(r) for r in routes[MIXED.unique()].tolist()}) > 1, routes  # a mixed batch takes several routes
    return model


def rows_per_expert(model):
    """Counts, per (layer, expert), of the rows each expert computed: forward pre-hooks on every expert."""
    seen = Counter()
    handles = []
    for i, layer in enumerate(model.routed_layers()):
        for j, expert in enumerate(layer.experts):
            handles.append(expert.register_forward_pre_hook(
                lambda _m, args, kwargs, key=(i, j): seen.update({key: (args[0] if args else kwargs["hidden_states"])
                                                                  .shape[0]}), with_kwargs=True))
    return seen, handles


def generate(model, task_ids, **kwargs):
    ids, mask = prompts(len(task_ids))
    return counted_generate(model, ids, mask, task_ids,
                            **{"max_new_tokens": 6, "do_sample": False, "eos_token_id": None, **kwargs})


def counted_generate(model, ids, mask, task_ids, **kwargs):
    """`model.generate(ids, ...)` and the rows each expert computed (`rows_per_expert`)."""
    seen, handles = rows_per_expert(model)
    try:
        out = model.generate(ids, attention_mask=mask, task_ids=task_ids, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return out, seen


@pytest.fixture
def per_expert(hard_model, monkeypatch):
    """`hard_model` running each expert on its own rows (no grouped layers)."""
    monkeypatch.setattr(hard_model, "group_hard_routes", False)
    return hard_model


@pytest.mark.parametrize("task_ids", [ONE_TASK, MIXED], ids=["one_task", "mixed"])
def test_greedy_generation_equals_the_every_expert_path(per_expert, task_ids):
    hard_model = per_expert
    got, seen = generate(hard_model, task_ids)
    expected, every = generate(hard_model, task_ids, every_expert=True)
    assert torch.equal(got, expected)
    routes = hard_model.task_routing().argmax(-1)[task_ids]  # (batch, layers): each row's expert per layer
    steps = 6  # the prompt, then one token per step but the last
    for (layer, expert), count in seen.items():
        assert count == steps * int((routes[:, layer] == expert).sum()), (layer, expert)  # its own rows only
    assert sum(seen.values()) == steps * len(task_ids) * len(routes[0])  # each row: one expert per layer
    assert sum(every.values()) == hard_model.config.num_experts * sum(seen.values())


def test_one_task_generation_equals_the_exported_model(hard_model):
    ids, mask = prompts()
    for t, task in enumerate(hard_model.config.task_names):
        rows = torch.full((len(ids),), t)
        got = hard_model.generate(ids, attention_mask=mask, task_ids=rows, max_new_tokens=6, do_sample=False,
                                  eos_token_id=None)
        expected = hard_model.export_task(task).generate(ids, attention_mask=mask, max_new_tokens=6,
                                                         do_sample=False, eos_token_id=None)
        assert torch.equal(got, expected), task


def test_beam_search_reorders_each_experts_rows(per_expert):
    hard_model = per_expert
    cache = hard_model.new_cache()
    got, _ = generate(hard_model, MIXED, num_beams=2, max_new_tokens=5, **{CACHE_ARG: cache})
    expected, _ = generate(hard_model, MIXED, num_beams=2, max_new_tokens=5, every_expert=True)
    assert torch.equal(got, expected)
    assert cache.slot_rows, "a mixed batch keeps some experts' rows only"
    beams = torch.arange(2 * len(MIXED)) // 2  # the example of each beam row
    routes = hard_model.task_routing().argmax(-1)[MIXED[beams]]  # (beam rows, layers)
    for layer in hard_model.routed_layers():
        for j, slot in enumerate(layer.cache_slots):
            rows = cache.slot_rows.get(slot)
            if rows is not None:
                assert torch.equal(rows, (routes[:, layer.route_index] == j).nonzero().squeeze(-1))
                assert cache.layers[slot].keys.shape[0] == len(rows)


def test_the_plan_is_read_once_per_generation(hard_model):
    with host_reads() as calls:
        generate(hard_model, MIXED)
    plan_reads = [c for c in calls if c.startswith("routing.py") and c.endswith(" cpu")]
    assert len(plan_reads) == 1, Counter(calls)


def test_a_generation_reads_the_device_back_as_often_for_two_new_tokens_as_for_six(hard_model):
    """The plan once, the task ids and the prompt's token ids once, before the first step: no decoding step reads
    anything back (each step read the task ids' range and its input ids' before)."""
    reads = {}
    for new_tokens in (2, 6):
        with host_reads() as calls:
            generate(hard_model, MIXED, max_new_tokens=new_tokens)
        reads[new_tokens] = Counter(calls)
    assert reads[2] == reads[6], reads


class _KernelOps(TorchDispatchMode):
    """Counts the aten operators dispatched that are not views (a view launches nothing on a GPU; nor does
    `_unsafe_view`, the view a 3-D `matmul` returns its 2-D product as)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        returns = func._schema.returns
        view = returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        if not view and func.overloadpacket is not torch.ops.aten._unsafe_view:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def step_ops(model, **kwargs) -> Counter:
    """The operators of 4 decoding steps: a generation of 6 new tokens less one of 2 (prompt and set-up cancel),
    after one of 2 (what runs once per process: the grouped norms' probe)."""
    ops = []
    for new_tokens in (2, 2, 6):
        ids, mask = prompts()
        with _KernelOps() as counter, torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, eos_token_id=None, **kwargs)
        ops.append(counter.ops)
    return ops[2] - ops[1]


def test_a_decoding_step_dispatches_the_dense_models_operations(hard_model, monkeypatch):
    """Under a hard route a decoding step runs what the dense model's runs: the router's decisions are the first
    step's (kept on the cache with the plan), no decision is read or cast in a layer whose expert is not scaled. One
    task: the exported model's operators, one for one. A mixed batch through the grouped layers: a grouped GEMM in the
    place of each product, and the norms hold each row's own weights (no product more); a linear with a bias adds it
    apart (GPT-2's, Qwen2's query/key/value)."""
    dense = step_ops(hard_model.export_task(hard_model.config.task_names[1]))
    assert step_ops(hard_model, task_ids=ONE_TASK) == dense
    monkeypatch.setattr(hard_model, "group_hard_routes", True)
    mixed = step_ops(hard_model, task_ids=MIXED)
    products = ("_grouped_mm", "mm", "addmm")
    assert mixed["_grouped_mm"] > 0
    assert sum(mixed[op] for op in products) == sum(dense[op] for op in products)  # the LM head stays a product
    others = Counter({op: n for op, n in mixed.items() if op not in products})
    expected = Counter({op: n for op, n in dense.items() if op not in products})
    biased = dense["addmm"] - mixed["addmm"]  # grouped products whose bias is added apart
    assert (hard_model.config.dense_config.model_type == "llama") == (biased == 0)
    # GPT-2's LayerNorms: unit weight, then one `addcmul` per norm (each row's weight and bias); RMSNorms: nothing
    layer_norms = 4 * sum(isinstance(m, torch.nn.LayerNorm) for layer in hard_model.routed_layers()
                          if len(layer.experts) > 1 for m in layer.experts[0].modules())
    assert others - expected == +Counter({"add": biased, "addcmul": layer_norms}) and not expected - others, (
        others - expected, expected - others)


def test_the_router_runs_once_per_generation_under_hard_routes(hard_model):
    calls = []
    handle = hard_model.router.register_forward_hook(lambda *_: calls.append(1))
    try:
        generate(hard_model, MIXED)
        assert len(calls) == 1
        calls.clear()
        generate(hard_model, MIXED, every_expert=True)  # no plan: every step routes its rows
        assert len(calls) == 6
    finally:
        handle.remove()


def test_bad_task_ids_and_token_ids_are_still_refused_by_generate(hard_model):
    ids, mask = prompts()
    with pytest.raises(ValueError, match="task"):
        hard_model.generate(ids, attention_mask=mask, task_ids=torch.full((ids.shape[0],), 99), max_new_tokens=2)
    with pytest.raises(ValueError, match="vocabulary"):
        hard_model.generate(ids + 10_000, attention_mask=mask, task_ids=MIXED, max_new_tokens=2)


def test_soft_routes_run_every_expert_on_every_row():
    torch.manual_seed(0)
    model = train(routed("llama", selection="softmax", num_experts=2, router_init_std=0.05))
    got, seen = generate(model, MIXED)
    expected, _ = generate(model, MIXED, every_expert=True)
    assert torch.equal(got, expected)
    layers, experts = model.config.num_routed_layers, model.config.num_experts
    assert seen == Counter({(i, j): 6 * len(MIXED) for i in range(layers) for j in range(experts)})


def test_a_routed_cache_continues_only_with_its_rows(hard_model):
    ids, mask = prompts()
    cache = hard_model.new_cache()
    hard_model.generate(ids, attention_mask=mask, task_ids=MIXED, max_new_tokens=2, **{CACHE_ARG: cache})
    assert isinstance(cache, ExpertRowsCache) and cache.routing_plan is not None
    with pytest.raises(ValueError, match="filled for 4 rows"), torch.no_grad():
        hard_model(ids[:2, -1:], task_ids=MIXED[:2], **{CACHE_ARG: cache})


def grouped_rows(monkeypatch):
    """Counts, per routed layer's grouped copy built, of the rows it computed (pre-hooks on what `grouped_layer`
    returns), in build order; and the `GroupedRoute`s made."""
    from hf_taskmoe.layers import grouped_routes

    built, made = grouped_routes.grouped_layer, grouped_routes.grouped_route
    counts, routes = [], []

    def counting(experts, segments, device, *unused):
        layer = built(experts, segments, device, *unused)
        if layer is not None:
            counts.append(0)
            index = len(counts) - 1
            layer.register_forward_pre_hook(lambda _m, args, kwargs: counts.__setitem__(
                index, counts[index] + (args[0] if args else kwargs["hidden_states"]).shape[0]), with_kwargs=True)
        return layer

    def making(*args):
        route = made(*args)
        if isinstance(route, grouped_routes.GroupedRoute):
            routes.append(route)
        return route

    monkeypatch.setattr(grouped_routes, "grouped_layer", counting)
    monkeypatch.setattr(grouped_routes, "grouped_route", making)
    return counts, routes


#: a batch whose rows alternate between routes: more runs of one expert than a run-per-segment layer takes, so the
#: grouped layers sort their rows by expert (gather them and put them back)
ALTERNATING = torch.tensor([0, 1, 2, 1] * 4)


@pytest.mark.parametrize("beams", [1, 2])
@pytest.mark.parametrize("task_ids", [MIXED, ALTERNATING], ids=["mixed", "alternating"])
def test_grouped_generation_equals_the_every_expert_path(hard_model, monkeypatch, beams, task_ids):
    """A mixed batch under hard routes: each layer whose rows use several experts runs one grouped copy on every row
    (no expert is called there), the tokens those of the every-expert path and of the per-expert path; `generate`
    sorted the rows by task, so no layer gathers them."""
    counts, made = grouped_rows(monkeypatch)
    monkeypatch.setattr(hard_model, "group_hard_routes", True)
    got, seen = generate(hard_model, task_ids, num_beams=beams)
    expected, _ = generate(hard_model, task_ids, num_beams=beams, every_expert=True)
    monkeypatch.setattr(hard_model, "group_hard_routes", False)
    per_expert, _ = generate(hard_model, task_ids, num_beams=beams)
    assert torch.equal(got, expected) and torch.equal(got, per_expert)
    routes = hard_model.task_routing().argmax(-1)[task_ids]  # (batch, layers)
    mixed_layers = [i for i in range(routes.shape[1]) if len(routes[:, i].unique()) > 1]
    assert mixed_layers and len(counts) == len(mixed_layers)
    rows, steps = beams * len(task_ids), 6
    assert counts == [steps * rows] * len(mixed_layers)  # every row, every step, once
    assert not any(layer in mixed_layers for layer, _ in seen)  # no expert of a grouped layer ran on its own
    assert sum(seen.values()) == steps * rows * (routes.shape[1] - len(mixed_layers))
    gathered = [route.order is not None for route in made]
    assert gathered == [False] * len(mixed_layers), gathered  # generate sorted the rows by task


@pytest.mark.parametrize("task_ids", [MIXED, ALTERNATING], ids=["runs", "sorted_by_expert"])
def test_grouped_layers_keep_every_row_in_one_slot(hard_model, monkeypatch, task_ids):
    """Expert 0's slot of a grouped layer holds every row: in the batch's order (runs), or sorted by expert."""
    monkeypatch.setattr(hard_model, "group_hard_routes", True)
    cache = hard_model.new_cache()
    # a dict output: `generate` keeps the batch's order, the alternating batch's layers sort their rows by expert
    generate(hard_model, task_ids, num_beams=2, max_new_tokens=4, return_dict_in_generate=True,
                   **{CACHE_ARG: cache})
    routes = hard_model.task_routing().argmax(-1)[task_ids[torch.arange(2 * len(task_ids)) // 2]]  # (beam rows, layers)
    for layer in hard_model.routed_layers():
        column = routes[:, layer.route_index]
        if len(column.unique()) < 2:
            continue
        rows = cache.slot_rows.get(layer.cache_slots[0])
        if task_ids is MIXED:
            assert rows is None  # the batch's own order
        else:
            assert sorted(rows.tolist()) == list(range(len(column)))  # every row once
            assert torch.equal(column[rows], column.sort().values)  # sorted by expert
        assert cache.layers[layer.cache_slots[0]].keys.shape[0] == len(column)
        assert all(cache.layers[slot].get_seq_length() == 0 for slot in layer.cache_slots[1:])


def test_grouped_norms_take_each_rows_parameters_or_keep_the_per_expert_path():
    """A norm whose forward broadcasts its parameters element-wise (Gemma's `x * (1 + weight)` here, RMSNorm) holds
    each row's own expert's parameters, `(rows, 1, width)`: exactly the per-expert numbers. A `LayerNorm` (its weight
    must have the normalised shape) runs with a unit weight and is scaled and shifted per row. A norm that is neither
    (`layer_norm` with `1 + weight`) keeps the layer on the per-expert path."""
    from torch import nn

    from hf_taskmoe.layers.grouped_routes import grouped_layer

    class OnePlusNorm(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(width))

        def forward(self, x):
            return x * (1.0 + self.weight)

    class OnePlusLayerNorm(OnePlusNorm):
        def forward(self, x):
            return nn.functional.layer_norm(x, x.shape[-1:], 1.0 + self.weight)

    class Layer(nn.Module):
        def __init__(self, norm=OnePlusNorm):
            super().__init__()
            self.norm, self.proj = norm(8), nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(self.norm(x))

    x = torch.randn(4, 3, 8)
    segments = [(1, 2), (0, 1), (1, 1)]

    def per_expert(experts):
        return torch.cat([experts[1](x[:2]), experts[0](x[2:3]), experts[1](x[3:])])

    experts = [Layer(), Layer()]
    with torch.no_grad():
        experts[1].norm.weight.add_(0.75)
    layer = grouped_layer(experts, segments, torch.device("cpu"))
    assert tuple(layer.norm.weight.shape) == (4, 1, 8)  # each row's own weight
    assert torch.equal(layer(x), per_expert(experts))
    assert torch.equal(experts[1].norm.weight, torch.full((8,), 0.75))  # the experts' own modules untouched

    assert grouped_layer([Layer(OnePlusLayerNorm), Layer(OnePlusLayerNorm)], segments, torch.device("cpu")) is None

    experts[0].norm, experts[1].norm = nn.LayerNorm(8), nn.LayerNorm(8)
    with torch.no_grad():
        experts[1].norm.weight.mul_(2.0)
        experts[1].norm.bias.add_(0.5)
    layer = grouped_layer(experts, segments, torch.device("cpu"))
    assert tuple(layer.norm.weight.shape) == (8,)  # unit weight, scaled per row after it
    torch.testing.assert_close(layer(x), per_expert(experts))
    assert torch.equal(experts[1].norm.weight, torch.full((8,), 2.0))


@pytest.mark.parametrize("task_ids", [MIXED, ALTERNATING], ids=["few_runs", "alternating"])
@pytest.mark.parametrize("kwargs", [{}, {"num_beams": 2, "num_return_sequences": 2}], ids=["greedy", "beams"])
def test_generate_sorts_the_rows_by_task_for_the_grouped_layers(hard_model, monkeypatch, task_ids, kwargs):
    """With grouped layers `generate` runs the batch sorted by task (every grouped layer then runs in the batch's own
    order: nothing gathered) and returns the sequences in the caller's order, equal to the per-expert path's."""
    _, made = grouped_rows(monkeypatch)
    monkeypatch.setattr(hard_model, "group_hard_routes", True)
    got, _ = generate(hard_model, task_ids, **kwargs)
    assert made and all(route.order is None for route in made)  # runs of the sorted batch: no layer gathers
    monkeypatch.setattr(hard_model, "group_hard_routes", False)
    expected, _ = generate(hard_model, task_ids, **kwargs)
    assert torch.equal(got, expected)


def test_a_dict_output_keeps_the_batch_order(hard_model, monkeypatch):
    """Asked for scores (a dict output), `generate` leaves the rows in their order: the grouped layers gather them."""
    _, made = grouped_rows(monkeypatch)
    monkeypatch.setattr(hard_model, "group_hard_routes", True)
    got, _ = generate(hard_model, ALTERNATING, return_dict_in_generate=True, output_scores=True)
    assert made and all(route.order is not None for route in made)
    monkeypatch.setattr(hard_model, "group_hard_routes", False)
    expected, _ = generate(hard_model, ALTERNATING, return_dict_in_generate=True, output_scores=True)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(expected.scores))


@pytest.mark.parametrize("beams", [1, 3])
def test_bart_decoder_layers_grouped_on_the_batch_sorted_by_task(monkeypatch, beams):
    """BART's routed decoder layers (`TaskRoutedForSeq2SeqLM`) grouped under hard routes: the batch sorted by task,
    nothing gathered, the tokens those of the per-expert path, in the caller's order."""
    import transformers

    from hf_taskmoe import TaskRoutedForSeq2SeqLM, TaskSpec

    torch.manual_seed(0)
    config = transformers.BartConfig(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                     decoder_start_token_id=2)
    tasks = [TaskSpec(name=f"t{i}", problem_type="seq2seq") for i in range(4)]
    model = TaskRoutedForSeq2SeqLM.from_dense(transformers.BartForConditionalGeneration(config), tasks, num_experts=3,
                                              selection="hard", expert_noise_variance=1e-2).eval()
    ids = torch.randint(5, 100, (8, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    task_ids = torch.tensor([3, 0, 1, 2, 0, 3, 2, 1])
    kwargs = dict(attention_mask=mask, task_ids=task_ids, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                  num_beams=beams)
    _, made = grouped_rows(monkeypatch)
    monkeypatch.setattr(model, "group_hard_routes", True)
    got = model.generate(ids, **kwargs)
    assert made and all(route.order is None for route in made)
    monkeypatch.setattr(model, "group_hard_routes", False)
    assert torch.equal(got, model.generate(ids, **kwargs))
