import copy

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModel, BertConfig, BertModel

import hf_taskmoe
from hf_taskmoe import BertForTaskMoE, BertTaskMoEConfig, TaskSpec

from .conftest import ALL_KINDS, TINY, random_batch, tiny_config


def _model(config=None, seed=0):
    torch.manual_seed(seed)
    return BertForTaskMoE(config or tiny_config()).eval()


def _labels_for(config, task_ids):
    specs = config.task_specs
    return torch.tensor(
        [1.0 if specs[t].problem_type != "regression" else 0.25 * (i + 1) for i, t in enumerate(task_ids.tolist())]
    )


def test_forward_shapes_and_routing_outputs():
    config = tiny_config(num_experts=3)
    model = _model(config)
    batch = random_batch(config)
    out = model(
        **batch, labels=_labels_for(config, batch["task_ids"]), output_router_logits=True, output_hidden_states=True
    )
    assert out.loss.shape == () and set(out.task_losses) == {"a", "b"}
    assert out.task_logits["a"].shape == (3, 3) and out.task_logits["b"].shape == (3, 1)
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (6, 9, 3)
    assert out.expert_indices[0].shape == (6, 9, 1)
    assert out.routing_counts.shape == (2, 2, 3)
    real_tokens_per_task = torch.stack([batch["attention_mask"][batch["task_ids"] == t].sum() for t in range(2)])
    assert torch.equal(out.routing_counts.sum(-1), real_tokens_per_task.expand(2, 2))
    assert len(out.hidden_states) == 3 and out.hidden_states[-1].shape == (6, 9, 32)
    assert torch.equal(out.task_ids, batch["task_ids"])


def test_every_head_type_in_one_mixed_batch():
    config = tiny_config(tasks=ALL_KINDS)
    model = _model(config).train()
    # rows: sst2, mnli, stsb, tags, copa x2 (one example), wic, ner
    task_ids = torch.tensor([0, 1, 2, 3, 4, 4, 5, 6])
    batch = random_batch(config, batch=8, seq=9, task_ids=task_ids)
    labels = torch.full((8, 9), -100.0)
    labels[:, 0] = torch.tensor([1, 2, 0.5, 1, 1, 1, 0, 3])
    labels[3, :4] = torch.tensor([1.0, 0, 1, 0])
    labels[7, 1:5] = torch.tensor([4.0, 0, 1, 2])
    spans = torch.zeros(8, 2, 2, dtype=torch.long)
    spans[6] = torch.tensor([[1, 3], [5, 6]])
    out = model(**batch, labels=labels, span_positions=spans)
    assert set(out.task_losses) == {t.name for t in ALL_KINDS}
    assert out.task_logits["copa"].shape == (1, 2) and out.task_logits["ner"].shape == (1, 9, 5)
    out.loss.backward()
    for name, p in model.named_parameters():
        # a bias shared by all choices cancels in the softmax over choices: its gradient is exactly 0
        if "heads." in name and name != "heads.copa.scorer.bias":
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_init_covers_every_parameter():
    """With every *_range / *_std near zero, each parameter must be ~0 (weights, biases) or 1 (norm scales).

    (1e-10, not 0: transformers reads `initializer_range or 0.02`.)"""
    config = tiny_config(initializer_range=1e-10, router_init_std=1e-10)
    model = BertForTaskMoE(config)
    for name, param in model.named_parameters():
        p = param.detach()
        covered = (p.abs() < 1e-8) | (p == 1.0)
        assert covered.all(), f"{name} is not covered by _init_weights: {p[~covered][:5].tolist()}"
    routers = [n for n, _ in model.named_parameters() if "router" in n]
    assert len(routers) == 2


def test_router_init_std_follows_paper():
    model = BertForTaskMoE(tiny_config(hidden_size=64, num_attention_heads=4, num_experts=8))
    weight = model.backbone.encoder.layer[0].intermediate.router.weight
    assert abs(weight.std().item() - 0.001) < 0.0002


def test_save_load_round_trip_exact(tmp_path):
    model = _model(tiny_config(tasks=ALL_KINDS[:3], gating="shared", moe_layers=[1]))
    batch = random_batch(model.config, task_ids=torch.tensor([0, 1, 2, 0, 1, 2]))
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and not list(tmp_path.glob("*.bin"))
    # through its class a BertForTaskMoE; through AutoModel the family's model it is (its config has the family's
    # model_type), BERT's pooler included: the same numbers either way
    for loaded, cls in ((BertForTaskMoE.from_pretrained(tmp_path), BertForTaskMoE),
                        (AutoModel.from_pretrained(tmp_path), hf_taskmoe.TaskMoEForMultiTask)):
        assert type(loaded) is cls
        assert loaded.config.task_specs == model.config.task_specs
        assert loaded.config.gating == "shared" and loaded.config.moe_layers == [1]
        with torch.no_grad():
            a, b = model(**batch), loaded.eval()(**batch)
        for name in a.task_logits:
            torch.testing.assert_close(a.task_logits[name], b.task_logits[name], atol=1e-5, rtol=0)
    assert type(AutoConfig.from_pretrained(tmp_path)) is hf_taskmoe.TaskMoEConfig


def test_base_model_loads_from_full_checkpoint(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path)
    base = BertForTaskMoE.from_pretrained(tmp_path).eval()
    batch = random_batch(model.config)
    with torch.no_grad():
        encoded = base.encode(**batch)  # the encoder's output, the heads not run
        full = model(**batch, output_hidden_states=True)
    torch.testing.assert_close(encoded.last_hidden_state, full.hidden_states[-1])
    assert encoded.pooler_output.shape == (6, 32)


def test_mt_dense_equals_transformers_bert():
    torch.manual_seed(0)
    bert_config = BertConfig(**TINY)
    bert = BertModel(bert_config).eval()
    model = BertForTaskMoE.from_dense(bert, tasks=[TaskSpec(name="a", num_labels=2)], num_experts=1).eval()
    batch = random_batch(model.config, task_ids=torch.zeros(6, dtype=torch.long))
    with torch.no_grad():
        expected = bert(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
            token_type_ids=batch["token_type_ids"], output_hidden_states=True,
        )
        # the encoder's output (pooled sequence included)
        got = model.encode(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], None, None,
                           batch["task_ids"], None, True)
    for e, g in zip(expected.hidden_states, got.hidden_states, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.pooler_output, expected.pooler_output, atol=1e-5, rtol=0)
    # MT-Dense keeps BERT's own FFN: no router anywhere
    assert not any("router" in name for name, _ in model.named_parameters())


def test_eval_mode_is_deterministic():
    model = _model()
    batch = random_batch(model.config)
    with torch.no_grad():
        a, b = model(**batch), model(**batch)
    for name in a.task_logits:
        assert torch.equal(a.task_logits[name], b.task_logits[name])


@pytest.mark.parametrize("gating", ["task", "shared"])
def test_mixed_batch_equals_task_by_task(gating):
    config = tiny_config(tasks=ALL_KINDS[:3], gating=gating, num_experts=4)
    model = _model(config)
    batch = random_batch(config, batch=6, seq=9, task_ids=torch.tensor([2, 0, 1, 0, 2, 1]))
    labels = torch.tensor([0.3, 1, 2, 0, -0.8, 1])
    with torch.no_grad():
        mixed = model(**batch, labels=labels)
        for t, name in enumerate(config.task_names):
            rows = (batch["task_ids"] == t).nonzero().squeeze(1)
            single = model(**{k: v[rows] for k, v in batch.items()}, labels=labels[rows])
            torch.testing.assert_close(mixed.task_losses[name], single.task_losses[name], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mixed.task_logits[name], single.logits, atol=1e-5, rtol=1e-5)


def test_task_gates_change_routing_per_task():
    config = tiny_config(num_experts=4, router_init_std=1.0)
    model = _model(config)
    batch = random_batch(config, batch=2, task_ids=torch.tensor([0, 1]), pad_last=0)
    batch["input_ids"][1] = batch["input_ids"][0]
    batch["token_type_ids"][1] = batch["token_type_ids"][0]
    with torch.no_grad():
        out = model(**batch, output_router_logits=True)
    first = out.router_logits[0]
    assert not torch.allclose(first[0], first[1])  # same tokens, different task gates
    shared = _model(tiny_config(num_experts=4, router_init_std=1.0, gating="shared"))
    with torch.no_grad():
        logits = shared(**batch, output_router_logits=True).router_logits[0]
    torch.testing.assert_close(logits[0], logits[1])


def test_aux_losses_are_added_when_configured():
    config = tiny_config(router_aux_loss_coef=0.01, router_z_loss_coef=0.001)
    model = _model(config)
    batch = random_batch(config)
    labels = _labels_for(config, batch["task_ids"])
    out = model(**batch, labels=labels)
    plain = sum(out.task_losses[n] * 3 for n in out.task_losses) / 6
    torch.testing.assert_close(out.loss, plain + 0.01 * out.aux_loss + 0.001 * out.z_loss)
    assert _model()(**batch, labels=labels).aux_loss is None


def test_add_task_copies_the_related_gate_and_round_trips(tmp_path):
    model = _model(tiny_config(num_experts=3))
    new_id = model.add_task(TaskSpec(name="c", num_labels=4), init_from="b")
    assert new_id == 2 and model.config.task_names == ["a", "b", "c"]
    assert not model.heads["c"].training  # follows the model's eval mode
    for layer in model.backbone.encoder.layer:
        assert torch.equal(layer.intermediate.router.weight[2], layer.intermediate.router.weight[1])
    batch = random_batch(model.config, task_ids=torch.tensor([2, 2, 0, 1, 2, 0]))
    with torch.no_grad():
        out = model(**batch)
    assert out.task_logits["c"].shape == (3, 4)
    model.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).task_logits["c"], out.task_logits["c"])
    with pytest.raises(ValueError, match="already exists"):
        model.add_task({"name": "a", "num_labels": 2})
    with pytest.raises(ValueError, match="Unknown task 'zzz'"):
        model.add_task({"name": "d", "num_labels": 2}, init_from="zzz")


def test_moe_layers_subset_and_single_task_default():
    config = tiny_config(tasks=[TaskSpec(name="only", num_labels=2)], moe_layers=[0])
    model = _model(config)
    layers = model.backbone.encoder.layer
    assert layers[0].intermediate.router is not None and not hasattr(layers[1].intermediate, "router")
    batch = random_batch(config)
    batch.pop("task_ids")  # one task: task_ids may be omitted
    with torch.no_grad():
        out = model(**batch, output_router_logits=True)
    assert torch.equal(out.task_ids, torch.zeros(6, dtype=torch.long)) and len(out.router_logits) == 1


def test_gradient_checkpointing_gives_the_same_gradients():
    config = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = _model(config).train()
    clone = copy.deepcopy(model)
    # transformers >= 5.x renamed it; keep working on both names
    enable = getattr(clone, "activation_checkpointing_enable", None) or clone.gradient_checkpointing_enable
    enable()
    batch = random_batch(config)
    labels = _labels_for(config, batch["task_ids"])
    model(**batch, labels=labels).loss.backward()
    clone(**batch, labels=labels).loss.backward()
    for (name, p), q in zip(model.named_parameters(), clone.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_bf16_autocast_keeps_router_fp32():
    model = _model(tiny_config())
    batch = random_batch(model.config)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**batch, output_router_logits=True)
    assert all(r.dtype == torch.float32 for r in out.router_logits)
    assert torch.isfinite(out.task_logits["a"]).all()


def test_return_tuple():
    model = _model()
    batch = random_batch(model.config)
    with torch.no_grad():
        tup = model(**batch, return_dict=False)
    assert isinstance(tup, tuple)


def test_registration_uses_prefixed_model_type():
    assert BertTaskMoEConfig.model_type.startswith("taskmoe_")
    # the paper's BERT class is a variant of the MT-TaG family, saved as the family's model_type
    assert BertTaskMoEConfig.model_type == hf_taskmoe.TaskMoEConfig.model_type
    assert type(AutoConfig.for_model(BertTaskMoEConfig.model_type, tasks=[{"name": "x", "num_labels": 2}])) is (
        hf_taskmoe.TaskMoEConfig)
    assert hf_taskmoe.models.get_family("bert_taskmoe") is hf_taskmoe.models.FAMILIES["taskmoe"]
    assert hf_taskmoe.models.family_for("bert_taskmoe", "bert").model_class is BertForTaskMoE


def test_flat_bert_fields_live_in_the_dense_config(tmp_path):
    config = BertTaskMoEConfig(tasks=[{"name": "a", "num_labels": 2}], hidden_size=32, num_attention_heads=4,
                               intermediate_size=48, type_vocab_size=3, hidden_dropout_prob=0.25)
    assert type(config.dense_config) is BertConfig and config.classifier_pooling == "pooler"
    assert (config.dense_config.hidden_size, config.dense_config.type_vocab_size) == (32, 3)
    assert config.hidden_size == 32 and config.hidden_dropout_prob == 0.25
    config.hidden_dropout_prob = 0.1  # set through the flat name, as before
    assert config.dense_config.hidden_dropout_prob == 0.1
    config.save_pretrained(tmp_path)
    again = BertTaskMoEConfig.from_pretrained(tmp_path, attention_probs_dropout_prob=0.3)
    assert again.dense_config.to_dict() == {**config.dense_config.to_dict(), "attention_probs_dropout_prob": 0.3}
    with pytest.raises(ValueError, match="starts from BERT checkpoints"):
        BertTaskMoEConfig.from_dense_config(transformers.RobertaConfig(), tasks=[{"name": "a", "num_labels": 2}])
