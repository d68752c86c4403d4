"""Issue 56, item 1 (MT-TaG part): `expert_rank` on MT-TaG. An MoE layer keeps the one dense FFN, its linears carry
each expert's LoRA delta (`TokenLowRankExperts`), the router's top-k choice per token selects the deltas; the dense
weights are frozen unless `train_base=True`. Tiny BERT (a split FFN) and DistilBERT (a whole FFN module)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModel

import hf_taskmoe
from hf_taskmoe import BertForTaskMoE, TaskMoEForMultiTask
from hf_taskmoe.backbones.base import TaskContext
from hf_taskmoe.compat import CHECKPOINTING_ENABLE
from hf_taskmoe.layers.low_rank import LowRankExperts, TokenLowRankExperts, token_decisions_key
from hf_taskmoe.layers.moe import TaskMoE
from hf_taskmoe.models import family_of
from hf_taskmoe.models.task_moe import TaskMoEConfig

from .backbone_matrix import TASKS, VOCAB, dense_config, dense_equivalence, dense_model, labelled_batch, token_batch

ARCHS = ["bert", "distilbert"]
MIXED = torch.tensor([0, 1, 0, 1])


def low_rank(arch: str, rank: int = 4, **kwargs):
    return TaskMoEForMultiTask.from_dense(dense_model(arch), tasks=TASKS, num_experts=4, expert_rank=rank, **kwargs)


def deltas(model) -> dict[str, TokenLowRankExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, TokenLowRankExperts)}


def heads_logits(dense, model, batch) -> dict[str, torch.Tensor]:
    """The dense model's last hidden state, pooled as `model` pools it, through `model`'s heads: each task's logits."""
    from hf_taskmoe.models.encoder import pool_sequence

    plain = {k: v for k, v in batch.items() if k != "task_ids"}
    hidden = dense(**plain).last_hidden_state
    pooled = pool_sequence(hidden, batch["attention_mask"], model.config.classifier_pooling)
    _, task_rows, prepared = model._prepare_task_batch(batch["task_ids"], *hidden.shape[:2], None, None)
    return model.heads(hidden, pooled, task_rows, prepared).task_logits


@pytest.mark.parametrize("arch", ARCHS)
def test_upcycled_low_rank_experts_compute_the_dense_model(arch):
    fresh, reference = dense_equivalence(TaskMoEForMultiTask, arch, num_experts=4, expert_rank=4)()
    got, expected = reference(fresh)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    # one copy of the FFN: its linears wrapped, no expert bank
    assert deltas(fresh) and not any(type(m).__name__ == "ExpertBank" for m in fresh.modules())
    assert all(m.lora_B.abs().sum() == 0 for m in deltas(fresh).values())


@pytest.mark.parametrize("arch", ARCHS)
def test_upcycled_logits_are_the_dense_model_through_the_heads(arch):
    dense = dense_model(arch)
    model = TaskMoEForMultiTask.from_dense(dense, tasks=TASKS, num_experts=4, expert_rank=4).eval()
    batch = token_batch(arch, VOCAB, MIXED)
    with torch.no_grad():
        out = model(**batch)
        expected = heads_logits(dense, model, batch)
    assert sorted(out.task_logits) == sorted(expected)
    for name, logits in expected.items():
        torch.testing.assert_close(out.task_logits[name], logits, atol=1e-6, rtol=0)


def test_per_token_decisions_select_each_tokens_expert_in_one_product():
    torch.manual_seed(0)
    context = TaskContext()
    layer = TokenLowRankExperts(torch.nn.Linear(6, 5), num_experts=3, rank=2, alpha=4.0, route_index=7,
                                context=context)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(2, 4, 6)
    chosen = torch.tensor([[0, 1, 2, 1], [2, 2, 0, 1]])
    # the MoE layer's way: its tokens' decisions in the context's flags, keyed by its layer index
    context.begin(torch.zeros(2, dtype=torch.long), **{token_decisions_key(7): torch.nn.functional.one_hot(chosen, 3)})
    got = layer(x)
    for b in range(2):
        for t in range(4):
            j = chosen[b, t]
            want = layer.base_layer(x[b, t]) + layer.scaling * (layer.lora_B[j] @ (layer.lora_A[j] @ x[b, t]))
            torch.testing.assert_close(got[b, t], want, atol=1e-6, rtol=1e-6)
    context.begin(torch.zeros(2, dtype=torch.long), **{token_decisions_key(6): torch.ones(2, 4, 3)})  # another layer's
    with pytest.raises(RuntimeError, match="decisions"):
        layer(x)
    context.end()
    with pytest.raises(RuntimeError, match="decisions"):
        layer(x)


def _frozen_snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


@pytest.mark.parametrize("arch,checkpointing", [("bert", False), ("distilbert", False), ("bert", True)])
def test_frozen_base_trains_only_deltas_gates_and_heads_and_the_experts_diverge(arch, checkpointing):
    model = low_rank(arch)
    if checkpointing:  # every input of a checkpointed layer frozen: the deltas inside must still get gradients
        getattr(model, CHECKPOINTING_ENABLE)()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters()
                         if n.endswith((".lora_A", ".lora_B")) or ".router." in n or n.startswith("heads.")}
    assert any(".router." in n for n in trainable) and any(n.startswith("heads.") for n in trainable)
    frozen = _frozen_snapshot(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    batch = labelled_batch(model, [0, 1, 0, 1, 1, 0])
    model.train()
    router_grads = []
    for step in range(4):
        model(**batch).loss.backward()
        if step == 0:  # B = 0: the router's gradient comes through the gate weighting from the first step
            router_grads = [p.grad for n, p in model.named_parameters() if ".router." in n]
            assert all(g is not None and g.abs().sum() > 0 for g in router_grads)
        optimizer.step()
        optimizer.zero_grad()
    for name, param in model.named_parameters():
        if name in frozen:
            assert torch.equal(param, frozen[name]), name
    held = {id(p) for p in optimizer.state}
    assert held and held <= {id(p) for p in params}
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    # every expert started as the dense FFN; the tokens routed to each made their deltas differ
    for module in deltas(model).values():
        experts = [module.delta_weight(j) for j in range(module.num_experts)]
        trained = [j for j, d in enumerate(experts) if d.abs().sum() > 0]
        assert len(trained) >= 2
        assert all(not torch.equal(experts[i], experts[j]) for i in trained for j in trained if i < j)


def test_checkpointed_layers_recompute_with_their_own_tokens_decisions():
    """Under gradient checkpointing each MoE layer's linears are recomputed with the decisions the layer puts in the
    task context again: the same loss and gradients as without checkpointing, with trained deltas."""
    torch.manual_seed(0)
    model = low_rank("bert")
    with torch.no_grad():
        for module in deltas(model).values():
            module.lora_B.normal_(0, 0.3)
    checkpointed = copy.deepcopy(model)
    getattr(checkpointed, CHECKPOINTING_ENABLE)()
    batch = labelled_batch(model, [0, 1, 0, 1, 1, 0])
    results = []
    for m in (model, checkpointed):
        m.train()
        loss = m(**batch).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad}))
    torch.testing.assert_close(results[1][0], results[0][0])
    assert results[0][1].keys() == results[1][1].keys()
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_train_base_trains_everything():
    model = low_rank("bert", train_base=True)
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("arch", ARCHS)
def test_save_and_load_round_trip(arch, tmp_path):
    model = low_rank(arch, expert_alpha=3.0, expert_weighting="gate", top_k=2)
    with torch.no_grad():
        for module in deltas(model).values():
            module.lora_B.normal_(0, 0.2)
    model.eval()
    model.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert type(loaded) is family_of(model.config.model_type).model_class  # what the model_type loads as
    for field in ("expert_rank", "expert_alpha", "expert_dropout", "expert_targets", "train_base"):
        assert getattr(loaded.config, field) == getattr(model.config, field), field
    batch = token_batch(arch, VOCAB, MIXED)
    with torch.no_grad():
        a, b = model(**batch), loaded(**batch)
    for name in a.task_logits:
        assert torch.equal(a.task_logits[name], b.task_logits[name])
    assert {n for n, p in loaded.named_parameters() if p.requires_grad} == \
        {n for n, p in model.named_parameters() if p.requires_grad}


def test_parameter_report_counts_the_deltas_as_experts():
    model = low_rank("bert")
    report = hf_taskmoe.parameter_report(model)
    lora = sum(p.numel() for n, p in model.named_parameters() if n.endswith((".lora_A", ".lora_B")))
    gates = sum(p.numel() for n, p in model.named_parameters() if ".router." in n)
    heads = sum(p.numel() for n, p in model.named_parameters() if n.startswith("heads."))
    assert report.expert == lora
    assert report.trainable == lora + gates + heads < report.total
    assert report.shared == sum(p.numel() for p in model.parameters() if not p.requires_grad)  # the one dense copy
    from hf_taskmoe.models.task_moe import FAMILY

    card = FAMILY.describe(model.config)
    assert "LoRA delta of rank 4" in card and "dense weights frozen" in card
    # whole experts: the FFN copies are the experts, every weight trains
    full = TaskMoEForMultiTask.from_dense(dense_model("bert"), tasks=TASKS, num_experts=4)
    assert hf_taskmoe.parameter_report(full).trainable == hf_taskmoe.parameter_report(full).total


def test_targets_pick_linears_and_unmatched_ones_are_refused():
    model = low_rank("bert", expert_targets=["output.dense"])
    assert all(n.endswith("w_out") for n in deltas(model))
    model = low_rank("distilbert", expert_targets=["lin1"])
    assert all(n.endswith("lin1") for n in deltas(model))
    with pytest.raises(ValueError, match="expert_targets"):
        low_rank("bert", expert_targets=["q_proj"])


@pytest.mark.parametrize("rank", [0, -2, 1.5, "4", True])
def test_a_rank_that_is_not_a_positive_int_is_refused(rank):
    with pytest.raises(ValueError, match="expert_rank"):
        TaskMoEConfig(dense_config=dense_config("bert"), tasks=TASKS, expert_rank=rank)


def test_mt_dense_with_a_rank_is_refused():
    with pytest.raises(ValueError, match="num_experts=1"):
        TaskMoEConfig(dense_config=dense_config("bert"), tasks=TASKS, num_experts=1, expert_rank=4)


def test_low_rank_only_fields_need_a_rank():
    with pytest.raises(ValueError, match="expert_rank"):
        TaskMoEConfig(dense_config=dense_config("bert"), tasks=TASKS, train_base=True)


def test_experts_implementation_is_refused_with_a_rank(tmp_path):
    with pytest.raises(ValueError, match="experts_implementation"):
        TaskMoEConfig(dense_config=dense_config("bert"), tasks=TASKS, expert_rank=4, experts_implementation="eager")
    model = low_rank("bert")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="experts_implementation"):
        AutoModel.from_pretrained(tmp_path, experts_implementation="grouped_mm")


def test_the_bert_name_takes_a_rank():
    model = BertForTaskMoE.from_dense(dense_model("bert"), tasks=TASKS, num_experts=2, expert_rank=2)
    assert model.config.expert_rank == 2 and all(m.lora_A.shape[:2] == (2, 2) for m in deltas(model).values())
    assert not any(type(m) is LowRankExperts for m in model.modules())


@pytest.mark.parametrize("top_k", [1, 2])
def test_a_training_step_reads_nothing_back(top_k):
    """The low-rank MoE layers route, set the decisions and mix the deltas on the device: a training step of a batch
    whose values were checked reads nothing back (the whole-expert dispatch's per-expert loop would)."""
    from .test_host_syncs import host_reads

    model = low_rank("bert", top_k=top_k).train()
    batch = labelled_batch(model, [0, 1, 0, 1])
    with host_reads() as calls:
        out = model(**batch, values_checked=True, task_counts=[2, 2])
        out.loss.backward()
    assert not calls, calls


def test_one_step_through_the_multitask_trainer_leaves_the_base_alone(tmp_path):
    from datasets import Dataset

    from hf_taskmoe.training import MultiTaskTrainer, MultiTaskTrainingArguments

    model = low_rank("bert")
    frozen = _frozen_snapshot(model)
    data = {
        "a": Dataset.from_dict({"input_ids": [[5, 6, 7, 8, 9, 10]] * 4, "attention_mask": [[1] * 6] * 4,
                                "labels": [0, 1, 2, 1]}),
        "b": Dataset.from_dict({"input_ids": [[9, 8, 7, 6, 5, 4]] * 4, "attention_mask": [[1] * 6] * 4,
                                "labels": [0.5, -0.2, 1.0, 0.1]}),
    }
    args = MultiTaskTrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                                      use_cpu=True, report_to="none", save_strategy="no", learning_rate=1e-2)
    trainer = MultiTaskTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    for name, param in model.named_parameters():
        if name in frozen:
            assert torch.equal(param.detach().cpu(), frozen[name]), name
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainer.optimizer.state and {id(p) for p in trainer.optimizer.state} <= trainable
    assert any(m.lora_B.abs().sum() > 0 for m in deltas(model).values())


def test_top_2_mixes_the_chosen_deltas_and_gate_weighting_scales_by_their_probability():
    """Under top-2 straight-through the upcycled model is still the dense one; with trained deltas a layer's output is
    the FFN with the two chosen experts' deltas mixed by their renormalised probabilities, and `"gate"` multiplies
    that by the chosen probabilities' sum."""
    fresh, reference = dense_equivalence(TaskMoEForMultiTask, "bert", num_experts=4, expert_rank=4, top_k=2)()
    got, expected = reference(fresh)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)

    torch.manual_seed(0)
    moe = fresh.moe_layers()[0]
    with torch.no_grad():
        for module in deltas(fresh).values():
            module.lora_B.normal_(0, 0.3)
    x = torch.randn(2, 5, fresh.config.hidden_size)
    task_ids = torch.tensor([0, 1])
    with torch.no_grad():
        straight = TaskMoE.forward(moe, x, task_ids).hidden_states  # the layer alone (no task context)
        probs = moe.route(x, task_ids).softmax(-1)
        top_p, top_e = probs.topk(2, dim=-1)
        ffn = moe.experts[0]
        for b in range(2):
            for t in range(5):
                d = torch.zeros(4)
                d[top_e[b, t]] = top_p[b, t] / top_p[b, t].sum()
                moe.context.flags = {moe.decisions_key: d.view(1, 1, 4)}  # what the layer puts in its context
                want = ffn(x[b: b + 1, t: t + 1])[0, 0]
                moe.context.flags = {}
                torch.testing.assert_close(straight[b, t], want, atol=1e-6, rtol=1e-5)
        moe.expert_weighting = "gate"
        gated = TaskMoE.forward(moe, x, task_ids).hidden_states
    torch.testing.assert_close(gated, straight * top_p.sum(-1, keepdim=True), atol=1e-6, rtol=1e-6)


def test_the_bert_config_takes_a_rank():
    from hf_taskmoe import BertTaskMoEConfig

    config = BertTaskMoEConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                               vocab_size=VOCAB, tasks=TASKS, num_experts=2, expert_rank=3)
    model = BertForTaskMoE(config)
    assert config.expert_rank == 3 and len(deltas(model)) == 4


@pytest.mark.parametrize("arch", ["bert", "distilbert", "modernbert"])
def test_upcycling_report_copies_the_dense_ffn_in_place_and_lists_the_deltas_as_new(arch):
    dense = dense_model(arch)
    model, report = TaskMoEForMultiTask.from_dense(dense, TASKS, num_experts=3, expert_rank=2,
                                                   output_loading_info=True)
    bases = [name for name in report.copied if ".base_layer." in name]
    wrapped = [f"{n}.base_layer.{k}" for n, m in deltas(model).items() for k, _ in m.base_layer.named_parameters()]
    assert bases and sorted(bases) == sorted(wrapped)  # each wrapped linear's weight (and bias), once
    dense_state, state = dense.state_dict(), model.state_dict()
    for name in bases:
        assert ".base_layer." not in report.copied[name] and torch.equal(state[name], dense_state[report.copied[name]])
    lora = {n for n in state if n.endswith((".lora_A", ".lora_B"))}
    assert lora and lora <= set(report.new)
