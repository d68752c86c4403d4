"""T5 under hard routes at the dense model's cost (issue 46 item 5): `T5RoutedBlock` follows the routing plan as the
other routed layers do. In generation under hard routes each expert of a block runs only on the rows whose route uses
it (one expert on the whole batch when the batch is one task), keeping its own rows in its cache slots; block 0's
relative position bias is assembled per row from each expert's own table and later blocks take their rows of it;
with `group_hard_routes=True` the blocks whose experts differ only in linears and norms run as one grouped block.
A forward plans its routes likewise (`plans_forward_routes`). Tested token for token against the every-expert path
(`generate(every_expert=True)`), greedy and beam search, one task and mixed tasks with padding, and a forward's
logits, attentions and hidden states against a forward running every expert. Soft routes keep the every-expert path."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from hf_taskmoe.compat import CACHE_ARG, T5_BLOCK_RETURNS_BIASES
from hf_taskmoe.layers.routing import RoutedCache

from .test_host_syncs import host_reads
from .test_routed_generation import counted_generate, grouped_rows, rows_per_expert
from .test_task_routed_t5 import routed, s2s_batch, train

pytestmark = pytest.mark.skipif(not T5_BLOCK_RETURNS_BIASES, reason="this transformers' T5 block is refused")

MIXED = torch.tensor([0, 1, 2, 1, 0, 2])
ONE_TASK = torch.tensor([1, 1, 1, 1, 1, 1])
#: rows whose routes alternate: more runs of an expert than a grouped block runs in place, so it gathers them
ALTERNATING = torch.tensor([0, 1] * 4 + [2, 1])
STEPS = 6


@pytest.fixture(scope="module")
def hard_model():
    """A T5 trained a few steps under hard routes, 3 experts per block: the tasks' routes differ, block 0's experts
    learned their own relative-position tables."""
    torch.manual_seed(0)
    model = train(routed("t5", selection="hard", num_experts=3))
    routes = model.task_routing().argmax(-1)  # (tasks, routed blocks)
    assert len({tuple(r) for r in routes.tolist()}) > 1, routes
    enc0 = model.routed_layers()[0]
    assert len(routes[:, 0].unique()) > 1, routes  # the tasks take different experts of encoder block 0
    tables = [e.layer[0].SelfAttention.relative_attention_bias.weight for e in enc0.experts]
    assert not torch.allclose(tables[0], tables[1]) and not torch.allclose(tables[0], tables[2])
    return model


def inputs(task_ids, seed: int = 3):
    """Rows of `task_ids`, two of them right-padded (the encoder's mask)."""
    batch = s2s_batch(None, task_ids, seed=seed)
    mask = batch["attention_mask"]
    mask[1, -3:] = 0
    return batch["input_ids"].masked_fill(mask == 0, 0), mask


def generate(model, task_ids, **kwargs):
    ids, mask = inputs(task_ids)
    return counted_generate(model, ids, mask, task_ids, **{
        "max_new_tokens": STEPS, "min_new_tokens": STEPS, "do_sample": False, "eos_token_id": None, **kwargs})


@pytest.fixture
def per_expert(hard_model, monkeypatch):
    """`hard_model` running each expert on its own rows (no grouped blocks: the CPU's default)."""
    monkeypatch.setattr(hard_model, "group_hard_routes", False)
    return hard_model


@pytest.mark.parametrize("task_ids", [ONE_TASK, MIXED], ids=["one_task", "mixed"])
def test_greedy_generation_runs_each_expert_on_its_rows_only(per_expert, task_ids):
    model = per_expert
    got, seen = generate(model, task_ids)
    expected, every = generate(model, task_ids, every_expert=True)
    assert torch.equal(got, expected)
    routes = model.task_routing().argmax(-1)[task_ids]  # (batch, routed blocks): each row's expert per block
    encoder_blocks = len(model.config.encoder_route_layers)
    for (block, expert), count in seen.items():
        calls = 1 if block < encoder_blocks else STEPS  # the encoder once, the decoder once per new token
        assert count == calls * int((routes[:, block] == expert).sum()), (block, expert)  # its own rows only
    rows = len(task_ids)
    assert sum(seen.values()) == rows * (encoder_blocks + STEPS * (routes.shape[1] - encoder_blocks))
    assert sum(every.values()) == model.config.num_experts * sum(seen.values())
    if task_ids is ONE_TASK:  # one expert per block, on the whole batch
        assert all(count in (rows, STEPS * rows) for count in seen.values())


@pytest.mark.parametrize("task_ids", [ONE_TASK, MIXED], ids=["one_task", "mixed"])
def test_beam_search_keeps_each_experts_rows_in_its_slots(per_expert, task_ids):
    model = per_expert
    cache = model.new_cache()
    got, _ = generate(model, task_ids, num_beams=3, num_return_sequences=2, max_new_tokens=5, min_new_tokens=5,
                      **{CACHE_ARG: cache})
    expected, _ = generate(model, task_ids, num_beams=3, num_return_sequences=2, max_new_tokens=5, min_new_tokens=5,
                           every_expert=True)
    assert torch.equal(got, expected)
    assert isinstance(cache, RoutedCache)
    beams = torch.arange(3 * len(task_ids)) // 3  # the example of each beam row
    routes = model.task_routing().argmax(-1)[task_ids[beams]]  # (beam rows, routed blocks)
    decoder = model.routed_layers()[len(model.config.encoder_route_layers):]
    assert bool(cache.slot_rows) == (task_ids is MIXED)  # a mixed batch keeps some experts' rows only
    for layer in decoder:
        for j, slot in enumerate(layer.cache_slots):
            mine = (routes[:, layer.route_index] == j).nonzero().squeeze(-1)
            held = cache.slot_rows.get(slot)
            if len(mine) == len(routes):
                assert held is None
            elif len(mine):
                assert torch.equal(held, mine)
            for half in (cache.self_attention_cache, cache.cross_attention_cache):  # both attentions' slots
                if len(mine):
                    assert half.layers[slot].keys.shape[0] == len(mine)
                else:  # an expert no row uses: its slots stay empty
                    assert half.layers[slot].get_seq_length() == 0


@pytest.mark.parametrize("beams", [1, 2])
def test_grouped_blocks_equal_the_every_expert_path(hard_model, monkeypatch, beams):
    """`group_hard_routes=True`: every mixed decoder block runs one grouped copy, block 0 included (each row's
    relative position bias computed from its own expert's table and passed in); no decoder expert runs on its own;
    the tokens those of the every-expert path. The encoder runs once, each expert on its rows."""
    counts, made = grouped_rows(monkeypatch)
    monkeypatch.setattr(hard_model, "group_hard_routes", True)
    got, seen = generate(hard_model, MIXED, num_beams=beams)
    expected, _ = generate(hard_model, MIXED, num_beams=beams, every_expert=True)
    assert torch.equal(got, expected)
    routes = hard_model.task_routing().argmax(-1)[MIXED]
    encoder_blocks = len(hard_model.config.encoder_route_layers)
    mixed = [i for i in range(encoder_blocks, routes.shape[1]) if len(routes[:, i].unique()) > 1]
    assert encoder_blocks in mixed and len(counts) == len(mixed), (mixed, counts)  # decoder block 0 is mixed
    assert counts == [STEPS * beams * len(MIXED)] * len(mixed)  # every row, every step, once
    assert not any(block in mixed for block, _ in seen)  # no expert of a grouped block ran on its own
    assert made and all(route.order is None for route in made)  # generate sorted the rows by task


@pytest.mark.parametrize("group", [False, True], ids=["per_expert", "grouped"])
def test_mixed_generation_gives_each_row_its_tasks_exported_model(hard_model, monkeypatch, group):
    """Each row of a mixed batch generates what the plain T5 of its task's route (`export_task`) generates for it:
    block 0's bias of each row is its own expert's. Greedy (every step's logits too: a dict output, whose rows the
    grouped blocks gather by expert) and beam search."""
    _, made = grouped_rows(monkeypatch)
    monkeypatch.setattr(hard_model, "group_hard_routes", group)
    ids, mask = inputs(ALTERNATING)
    greedy, _ = generate(hard_model, ALTERNATING, return_dict_in_generate=True, output_logits=True)
    assert any(route.order is not None for route in made) == group  # the rows alternate: gathered by expert
    beams, _ = generate(hard_model, ALTERNATING, num_beams=2)
    common = dict(max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, eos_token_id=None)
    for t, task in enumerate(hard_model.config.task_names):
        rows = (ALTERNATING == t).nonzero().squeeze(-1)
        plain = hard_model.export_task(task)
        expected = plain.generate(ids[rows], attention_mask=mask[rows], return_dict_in_generate=True,
                                  output_logits=True, **common)
        assert torch.equal(greedy.sequences[rows], expected.sequences), task
        torch.testing.assert_close(torch.stack(greedy.logits, 1)[rows], torch.stack(expected.logits, 1),
                                   atol=1e-5, rtol=1e-5)
        expected = plain.generate(ids[rows], attention_mask=mask[rows], num_beams=2, **common)
        assert torch.equal(beams[rows], expected), task


def test_soft_routes_run_every_expert_on_every_row():
    torch.manual_seed(0)
    model = train(routed("t5", selection="softmax", num_experts=2, router_init_std=0.05))
    got, seen = generate(model, MIXED)
    expected, _ = generate(model, MIXED, every_expert=True)
    assert torch.equal(got, expected)
    encoder_blocks, blocks = len(model.config.encoder_route_layers), model.config.num_routed_layers
    assert seen == Counter({(i, j): (1 if i < encoder_blocks else STEPS) * len(MIXED)
                            for i in range(blocks) for j in range(2)})


def decoder_inputs(model, task_ids):
    return model._shift_right(s2s_batch(None, task_ids, seed=5)["labels"])


def forward(model, task_ids, use_cache: bool):
    """A forward on a mixed batch with padding: on labels (no cache), or on the same decoder inputs with a fresh
    cache."""
    ids, mask = inputs(task_ids)
    labels = s2s_batch(None, task_ids, seed=5)["labels"]
    target = {"decoder_input_ids": decoder_inputs(model, task_ids), "use_cache": True} if use_cache else \
        {"labels": labels}
    seen, handles = rows_per_expert(model)
    try:
        with torch.no_grad():
            out = model(ids, attention_mask=mask, task_ids=task_ids, output_attentions=True, output_hidden_states=True,
                        **target)
    finally:
        for handle in handles:
            handle.remove()
    return out, seen


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("task_ids", [ONE_TASK, MIXED], ids=["one_task", "mixed"])
def test_a_planned_forward_equals_the_every_expert_forward(hard_model, monkeypatch, task_ids, use_cache):
    """A forward plans its routes (`plans_forward_routes`): each expert on its rows; the logits, loss, attentions
    (each row its expert's) and hidden states those of every expert on every row, mixed by the decisions."""
    hard_model.set_attn_implementation("eager")  # attention probabilities
    try:
        planned, seen = forward(hard_model, task_ids, use_cache)
        monkeypatch.setattr(hard_model, "plans_forward_routes", False)
        every, seen_every = forward(hard_model, task_ids, use_cache)
    finally:
        hard_model.set_attn_implementation("sdpa")
    cross = hard_model.backbone.decoder.block[1].experts[2].layer[1].EncDecAttention
    assert cross.config._attn_implementation == "sdpa"
    torch.testing.assert_close(planned.logits, every.logits, atol=1e-5, rtol=1e-5)
    if not use_cache:
        torch.testing.assert_close(planned.loss, every.loss, atol=1e-5, rtol=1e-5)
    for name in ("encoder_attentions", "decoder_attentions", "cross_attentions", "encoder_hidden_states",
                 "decoder_hidden_states"):
        got, expected = getattr(planned, name), getattr(every, name)
        assert got is not None and len(got) == len(expected), name
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    ids, mask = inputs(task_ids)
    for t, task in enumerate(hard_model.config.task_names):  # each row: the plain T5 of its task's route
        rows = (task_ids == t).nonzero().squeeze(-1)
        if len(rows):
            with torch.no_grad():
                plain = hard_model.export_task(task)(ids[rows], attention_mask=mask[rows],
                                                     decoder_input_ids=decoder_inputs(hard_model, task_ids)[rows])
            torch.testing.assert_close(planned.logits[rows], plain.logits, atol=1e-5, rtol=1e-5)
    routes = hard_model.task_routing().argmax(-1)[task_ids]
    assert seen == Counter({(i, j): int((routes[:, i] == j).sum()) for i in range(routes.shape[1])
                            for j in range(3) if (routes[:, i] == j).any()})
    assert sum(seen_every.values()) == 3 * sum(seen.values())


def test_the_routes_are_read_once_per_stack_and_no_step_reads_anything(hard_model):
    """A generation reads the encoder's plan and the decoder's plan back once each (and the task ids and prompt once,
    before the encoder): as much for two new tokens as for six."""
    reads = {}
    for new_tokens in (2, 6):
        with host_reads() as calls:
            generate(hard_model, MIXED, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        reads[new_tokens] = Counter(calls)
    assert reads[2] == reads[6], reads
    plan_reads = [c for c in reads[2] if c.startswith("routing.py") and c.endswith(" cpu")]
    assert sum(reads[2][c] for c in plan_reads) == 2, reads[2]


def test_bad_ids_are_still_refused_by_generate(hard_model):
    ids, mask = inputs(MIXED)
    with pytest.raises(ValueError, match="task"):
        hard_model.generate(ids, attention_mask=mask, task_ids=torch.full((len(ids),), 9), max_new_tokens=2)
    with pytest.raises(ValueError, match="vocabulary"):
        hard_model.generate(ids + 1000, attention_mask=mask, task_ids=MIXED, max_new_tokens=2)
    with pytest.raises(ValueError, match="vocabulary"):
        hard_model.generate(ids, attention_mask=mask, task_ids=MIXED, max_new_tokens=2,
                            decoder_input_ids=torch.full((len(ids), 1), 1000))


def test_generation_records_each_rows_attentions(hard_model, monkeypatch):
    """`output_attentions` in a planned mixed generation (the blocks record through the `RouteRecorder`, each row its
    expert's probabilities, on the per-expert path): the every-expert path's, step by step."""
    monkeypatch.setattr(hard_model, "group_hard_routes", True)  # recording keeps the per-expert path
    hard_model.set_attn_implementation("eager")
    try:
        kwargs = dict(return_dict_in_generate=True, output_attentions=True, output_hidden_states=True)
        got, seen = generate(hard_model, MIXED, **kwargs)
        expected, every = generate(hard_model, MIXED, every_expert=True, **kwargs)
    finally:
        hard_model.set_attn_implementation("sdpa")
    assert torch.equal(got.sequences, expected.sequences)
    assert sum(every.values()) == hard_model.config.num_experts * sum(seen.values())
    for name in ("encoder_attentions", "encoder_hidden_states"):
        for a, b in zip(getattr(got, name), getattr(expected, name), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for name in ("decoder_attentions", "cross_attentions", "decoder_hidden_states"):
        steps, reference = getattr(got, name), getattr(expected, name)
        assert len(steps) == len(reference) == STEPS
        for step, ref in zip(steps, reference):
            assert len(step) == len(ref) and all(a is not None for a in step), name
            for a, b in zip(step, ref):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
