import numpy as np
import pytest
import torch
from transformers import AutoModel, BartConfig, BartForConditionalGeneration

from hf_taskmoe import BartTaskRouted, BartTaskRoutedConfig, TaskSpec, bart_from_bert
from hf_taskmoe.analysis import average_relative_gain, plot_task_routing, route_feature_correlation
from hf_taskmoe.layers.routing import ROUTER_TYPES, RoutedLayer, TaskRouter, select_gumbel_softmax_st

TASKS = [TaskSpec(name=n, problem_type="seq2seq") for n in ("cls", "qa", "summ")]
TINY_BART = dict(
    vocab_size=60, d_model=16, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
    encoder_attention_heads=2, decoder_attention_heads=2, max_position_embeddings=40, dropout=0.0,
    forced_eos_token_id=None,
)


def dense_bart(seed=0):
    torch.manual_seed(seed)
    return BartForConditionalGeneration(BartConfig(**TINY_BART)).eval()


def routed(selection="gumbel_softmax_st", seed=0, noise=0.0, distinct=True, **kwargs):
    """A BartTaskRouted from a tiny dense BART; `distinct` moves the experts apart (as training would)."""
    model = BartTaskRouted.from_dense(
        dense_bart(seed), TASKS, expert_noise_variance=noise, selection=selection, **kwargs
    )
    if distinct:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".experts." in name or name.startswith("router."):
                    p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def batch(rows=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, 60, (rows, 7), generator=g)
    x[1, 5:] = 1  # padding
    mask = (x != 1).long()
    labels = torch.randint(3, 60, (rows, 5), generator=g)
    labels[0, 3:] = -100
    return {"input_ids": x, "attention_mask": mask, "labels": labels, "task_ids": torch.arange(rows) % 3}


def test_shapes_losses_and_mixed_batch_equals_per_task():
    for selection in ("softmax", "gumbel_softmax_st"):
        model = routed(selection)
        b = batch()
        out = model(**b, output_router_logits=True)
        assert out.logits.shape == (6, 5, 60) and set(out.task_losses) == {"cls", "qa", "summ"}
        assert out.routing_decisions.shape == (6, 4, 3) and out.router_logits.shape == (6, 4, 3)
        for t in range(3):
            rows = b["task_ids"] == t
            alone = model(**{k: v[rows] for k, v in b.items()})
            assert torch.allclose(alone.logits, out.logits[rows], atol=1e-5)
            assert torch.allclose(alone.loss, out.task_losses[TASKS[t].name], atol=1e-5)


def test_selection_functions():
    logits = torch.randn(3, 4, 3, requires_grad=True)
    router = TaskRouter(3, 8, 8, 4, 3, selection="average")
    d = router.task_decisions(training=True)
    assert torch.allclose(d, torch.full_like(d, 1 / 3))
    router.select = TaskRouter(3, 8, 8, 4, 3, selection="softmax").select
    assert torch.allclose(router.task_decisions().sum(-1), torch.ones(3, 4))
    st = select_gumbel_softmax_st(logits, temperature=0.7, training=True)
    assert set(st.detach().unique().tolist()) <= {0.0, 1.0} and torch.equal(st.detach().sum(-1), torch.ones(3, 4))
    (st * torch.randn(3, 4, 3)).sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0  # soft gradients through hard values
    hard_eval = select_gumbel_softmax_st(logits.detach(), training=False)
    assert torch.equal(hard_eval.argmax(-1), logits.detach().argmax(-1))  # evaluation: arg-max, no noise


def test_straight_through_training_reaches_router():
    model = routed("gumbel_softmax_st").train()
    out = model(**batch(), output_router_logits=True)
    values = out.routing_decisions.detach()
    assert set(values.unique().tolist()) <= {0.0, 1.0}
    out.loss.backward()
    assert model.router.net.dense_in.weight.grad.abs().sum() > 0
    assert model.router.task_embeddings.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("router_type", sorted(ROUTER_TYPES))
def test_router_types(router_type):
    model = routed("softmax", router_type=router_type, task_embedding_dim=8)
    assert model.router.task_logits().shape == (3, 4, 3)
    out = model(**batch())
    assert torch.isfinite(out.loss)


def test_dense_equivalence_after_upcycling():
    dense = dense_bart()
    b = batch()
    with torch.no_grad():
        reference = dense(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).logits
    for selection in ("average", "softmax", "gumbel_softmax_st"):
        model = BartTaskRouted.from_dense(dense, TASKS, expert_noise_variance=0.0, selection=selection).eval()
        with torch.no_grad():
            assert torch.allclose(model(**b).logits, reference, atol=1e-5)
    noisy = BartTaskRouted.from_dense(dense, TASKS, selection="average").eval()  # the paper's N(0, 1e-8) noise
    with torch.no_grad():
        difference = (noisy(**b).logits - reference).abs().max().item()
    assert 0 < difference < 1e-2
    experts = noisy.backbone.model.encoder.layers[0].experts
    assert not torch.equal(experts[0].fc1.weight, experts[1].fc1.weight)
    assert (experts[0].fc1.weight - dense.model.encoder.layers[0].fc1.weight).std().item() == pytest.approx(
        1e-4, rel=0.1
    )


def test_generate_with_task_ids_beam_search_and_cache():
    dense = dense_bart()
    model = BartTaskRouted.from_dense(dense, TASKS, expert_noise_variance=0.0, selection="softmax").eval()
    b = batch()
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    for beams in (1, 3):
        expected = dense.generate(b["input_ids"], attention_mask=b["attention_mask"], num_beams=beams, **kwargs)
        got = model.generate(
            b["input_ids"], attention_mask=b["attention_mask"], task_ids=b["task_ids"], num_beams=beams, **kwargs
        )
        assert torch.equal(got, expected)
    distinct = routed("gumbel_softmax_st")
    for beams in (1, 3):
        cached = distinct.generate(
            b["input_ids"], attention_mask=b["attention_mask"], task_ids=b["task_ids"], num_beams=beams, **kwargs
        )
        uncached = distinct.generate(
            b["input_ids"],
            attention_mask=b["attention_mask"],
            task_ids=b["task_ids"],
            num_beams=beams,
            use_cache=False,
            **kwargs,
        )
        assert torch.equal(cached, uncached) and cached.shape == (6, 7)
    per_task = [
        distinct.generate(
            b["input_ids"][b["task_ids"] == t],
            attention_mask=b["attention_mask"][b["task_ids"] == t],
            task_ids=b["task_ids"][b["task_ids"] == t],
            **kwargs,
        )
        for t in range(3)
    ]
    mixed = distinct.generate(b["input_ids"], attention_mask=b["attention_mask"], task_ids=b["task_ids"], **kwargs)
    for t in range(3):
        assert torch.equal(mixed[b["task_ids"] == t], per_task[t])


def test_only_the_chosen_experts_run():
    model = routed("gumbel_softmax_st")
    calls = []
    for stack in (model.backbone.model.encoder, model.backbone.model.decoder):
        for i, layer in enumerate(stack.layers):
            for j, expert in enumerate(layer.experts):
                # the default binds this expert's key (noqa: B008, id() is meant to run here)
                expert.register_forward_hook(
                    lambda m, a, o, key=(id(stack), i, j): calls.append((key, a[0].shape[0]))  # noqa: B008
                )
    b = batch()
    with torch.no_grad():
        one_task = {k: v[b["task_ids"] == 1] for k, v in b.items()}
        model(**one_task)
    assert len(calls) == 4 and all(rows == 2 for _, rows in calls)  # one expert per layer, whole batch
    calls.clear()
    with torch.no_grad():
        model(**b)
    per_layer = {}
    for (stack, i, _), rows in calls:
        per_layer[(stack, i)] = per_layer.get((stack, i), 0) + rows
    assert set(per_layer.values()) == {6}  # each row ran through exactly one expert per layer


def test_export_task_gives_same_outputs():
    model = routed("gumbel_softmax_st")
    b = batch()
    for t, name in enumerate(model.config.task_names):
        plain = model.export_task(name)
        assert type(plain) is BartForConditionalGeneration
        rows = b["task_ids"] == t
        inputs = {k: v[rows] for k, v in b.items() if k != "task_ids"}
        with torch.no_grad():
            expected = model(**inputs, task_ids=b["task_ids"][rows]).logits
            assert torch.allclose(plain(**inputs).logits, expected, atol=1e-5)
        kwargs = dict(max_new_tokens=5, min_new_tokens=5, num_beams=2, do_sample=False)
        assert torch.equal(
            plain.generate(inputs["input_ids"], attention_mask=inputs["attention_mask"], **kwargs),
            model.generate(
                inputs["input_ids"], attention_mask=inputs["attention_mask"], task_ids=b["task_ids"][rows], **kwargs
            ),
        )
    with pytest.raises(ValueError, match="soft route"):
        routed("softmax").export_task("cls")


def test_export_loads_without_hf_taskmoe(tmp_path):
    model = routed("gumbel_softmax_st")
    model.export_task("qa").save_pretrained(tmp_path)
    import json

    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "bart"
    again = BartForConditionalGeneration.from_pretrained(tmp_path).eval()
    b = batch()
    rows = b["task_ids"] == 1
    with torch.no_grad():
        assert torch.allclose(again(input_ids=b["input_ids"][rows]).logits,
                              model(input_ids=b["input_ids"][rows], task_ids=b["task_ids"][rows]).logits, atol=1e-5)


def test_expert_disabling_changes_the_chosen_expert():
    model = routed("gumbel_softmax_st")
    before = model.task_routing(["summ"])[0].argmax(-1)
    b = batch()
    rows = b["task_ids"] == 2
    inputs = {k: v[rows] for k, v in b.items()}
    with torch.no_grad():
        reference = model(**inputs).logits
    with model.experts_disabled([("E1", int(before[1]))]):
        after = model.task_routing(["summ"])[0].argmax(-1)
        assert after[1] != before[1] and torch.equal(after[[0, 2, 3]], before[[0, 2, 3]])
        with torch.no_grad():
            assert not torch.allclose(model(**inputs).logits, reference)
    assert torch.equal(model.task_routing(["summ"])[0].argmax(-1), before)  # restored
    with pytest.raises(ValueError, match="every expert"):
        model.disable_experts([(0, 0), (0, 1), (0, 2)])
    with pytest.raises(ValueError, match="routed layers"):
        model.disable_experts([("E9", 0)])


def test_partial_routing_and_plain_layers():
    model = routed("softmax", routed_encoder_layers=[1], routed_decoder_layers=[])
    assert model.config.route_names == ["E1"]
    encoder, decoder = model.backbone.model.encoder, model.backbone.model.decoder
    assert len(encoder.layers[0].experts) == 1 and len(encoder.layers[1].experts) == 3
    assert all(len(layer.experts) == 1 for layer in decoder.layers)
    out = model.generate(batch()["input_ids"], task_ids=batch()["task_ids"], max_new_tokens=3, num_beams=2)
    assert out.shape[0] == 6


def test_save_load_auto_round_trip(tmp_path):
    model = routed("gumbel_softmax_st", freeze_task_embeddings=True)
    model.save_pretrained(tmp_path)
    again = AutoModel.from_pretrained(tmp_path)
    # a saved BartTaskRouted is the task-routing family's seq2seq model (its config has that model_type)
    assert type(again).__name__ == "TaskRoutedForSeq2SeqLM" and not again.router.task_embeddings.weight.requires_grad
    assert not again.router.disabled.any()
    b = batch()
    with torch.no_grad():
        assert torch.equal(again.eval()(**b).logits, model(**b).logits)


def test_temperature_annealing_and_task_embeddings():
    model = routed("gumbel_softmax", gumbel_temperature=2.0, gumbel_min_temperature=0.5, gumbel_anneal_rate=1e-2)
    model.set_training_step(0)
    assert model.router.temperature == 2.0
    model.set_training_step(100)
    assert model.router.temperature == pytest.approx(2.0 * np.exp(-1.0))
    model.set_training_step(10_000)
    assert model.router.temperature == 0.5
    table = torch.randn(3, 16)
    model.set_task_embeddings(table)
    assert torch.equal(model.router.task_embeddings.weight.detach(), table)
    with pytest.raises(ValueError, match="shape"):
        model.set_task_embeddings(torch.randn(2, 16))


def test_bad_configs_and_inputs():
    with pytest.raises(ValueError, match="selection"):
        BartTaskRoutedConfig(tasks=TASKS, selection="top2", **TINY_BART)
    with pytest.raises(ValueError, match="text-to-text"):
        BartTaskRoutedConfig(tasks=[TaskSpec(name="a", num_labels=2)], **TINY_BART)
    with pytest.raises(ValueError, match="routed_encoder_layers"):
        BartTaskRoutedConfig(tasks=TASKS, routed_encoder_layers=[5], **TINY_BART)
    model = routed("softmax")
    b = batch()
    with pytest.raises(ValueError, match="task_ids"):
        model(input_ids=b["input_ids"])
    with pytest.raises(ValueError, match="routing_weights"):
        model(input_ids=b["input_ids"], task_ids=b["task_ids"], routing_weights=torch.ones(6, 2, 3))
    with pytest.raises(ValueError, match="vocabulary"):
        model(input_ids=b["input_ids"], task_ids=b["task_ids"], labels=torch.full((6, 3), 99))
    with pytest.raises(ValueError, match="BartForConditionalGeneration"):
        BartTaskRouted.from_dense(BartForConditionalGeneration(BartConfig(**TINY_BART)).model, TASKS)


def test_bart_from_bert_encoder_reproduces_bert(minilm, minilm_tokenizer):
    from transformers import BertModel

    bart = bart_from_bert(minilm).eval()
    bert = BertModel.from_pretrained(minilm).eval()
    enc = minilm_tokenizer(
        ["a short sentence", "another, much longer sentence with more words"], padding=True, return_tensors="pt"
    )
    real = enc["attention_mask"].bool()
    with torch.no_grad():
        expected = bert(**enc, output_hidden_states=True).hidden_states
        got = bart.model.encoder(
            input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], output_hidden_states=True
        ).hidden_states
        assert len(got) == len(expected) == 7
        # BART's LayerNorms have eps 1e-5 (BERT 1e-12): close, not equal
        assert max((g - e)[real].abs().max().item() for g, e in zip(got, expected)) < 1e-2
        for module in bart.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.eps = bert.config.layer_norm_eps
        got = bart.model.encoder(
            input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], output_hidden_states=True
        ).hidden_states
    assert max((g - e)[real].abs().max().item() for g, e in zip(got, expected)) < 1e-5
    assert torch.equal(bart.model.decoder.layers[2].fc1.weight, bert.encoder.layer[2].intermediate.dense.weight)
    assert bart.lm_head.weight.data_ptr() == bart.model.shared.weight.data_ptr()
    assert bart.config.decoder_start_token_id == minilm_tokenizer.cls_token_id
    assert bart.config.eos_token_id == minilm_tokenizer.sep_token_id


def test_route_analysis(tmp_path):
    decisions = torch.tensor(
        [[[1.0, 0.0], [0.0, 1.0]], [[1.0, 0.0], [1.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]], [[0.0, 1.0], [1.0, 0.0]]]
    )
    features = {"classification": [1, 1, 0, 0], "constant": [1, 1, 1, 1]}
    r, p = route_feature_correlation(decisions, features)
    assert r.shape == (4, 2) and np.isnan(r[:, 1]).all()
    assert r[0, 0] == pytest.approx(1.0) and r[1, 0] == pytest.approx(-1.0)
    assert r[2, 0] == pytest.approx(np.corrcoef([0, 1, 0, 1], [1, 1, 0, 0])[0, 1], abs=1e-12)
    assert p[0, 0] < 1e-6
    # the paper's worked example (section 7.2): ARG 17.5%
    assert average_relative_gain({"a": 0.5, "b": 0.8}, {"a": 0.8, "b": 0.6}) == pytest.approx(0.175)
    with pytest.raises(ValueError, match="same tasks"):
        average_relative_gain({"a": 1.0}, {"b": 1.0})
    path = plot_task_routing(decisions, ["t0", "t1", "t2", "t3"], ["E0", "D0"], tmp_path / "routes.png")
    assert path.stat().st_size > 1000


def test_routed_layer_without_routing_weights_is_an_error():
    layer = RoutedLayer([torch.nn.Identity(), torch.nn.Identity()], route_index=0)
    with pytest.raises(ValueError, match="routing_weights"):
        layer(torch.zeros(2, 3, 4))


def test_task_representations(minilm_tokenizer):
    from hf_taskmoe.analysis.task_embeddings import fisher_task_embeddings, text_task_embeddings

    vocab = minilm_tokenizer.vocab_size
    torch.manual_seed(0)
    dense = BartForConditionalGeneration(BartConfig(**{**TINY_BART, "vocab_size": vocab, "pad_token_id": 0})).eval()
    tasks = {
        "cls": [("good movie", "positive"), ("bad film", "negative"), ("great plot", "positive")],
        "qa": [("who wrote hamlet", "shakespeare"), ("capital of france", "paris")],
        "summ": [("the cat sat on the mat all day long", "cat sat"), ("a dog ran in the park", "dog ran")],
    }
    avg = text_task_embeddings(dense, minilm_tokenizer, tasks, pooling="avg")
    bos = text_task_embeddings(dense, minilm_tokenizer, tasks, pooling="bos")
    assert avg.shape == bos.shape == (3, 16) and not torch.allclose(avg, bos)
    enc = minilm_tokenizer([s for s, _ in tasks["qa"]], padding=True, return_tensors="pt", return_token_type_ids=False)
    with torch.no_grad():
        states = dense.get_encoder()(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    expected = ((states * mask).sum(1) / mask.sum(1)).mean(0)
    assert torch.allclose(avg[1], expected, atol=1e-5)
    tuned = text_task_embeddings(dense, minilm_tokenizer, tasks, finetune_steps=2, learning_rate=1e-2)
    assert not torch.allclose(tuned, avg)  # FT-TextEmb: the copy moved, the model did not
    assert torch.equal(text_task_embeddings(dense, minilm_tokenizer, tasks), avg)
    fisher = fisher_task_embeddings(dense, minilm_tokenizer, tasks, dim=4, probe_steps=2, lora_rank=2)
    assert fisher.shape == (3, 4) and torch.all(fisher[:, 3] == 0)  # 3 tasks: at most 3 PCA components
    assert fisher[:, :2].abs().sum() > 0
    model = BartTaskRouted.from_dense(
        dense, [TaskSpec(name=n, problem_type="seq2seq") for n in tasks], task_embedding_dim=4
    )
    model.set_task_embeddings(fisher)
    assert torch.equal(model.router.task_embeddings.weight.detach(), fisher)


def test_a_saved_bart_task_routed_loads_through_auto_as_the_seq2seq_model_that_generates_the_same(tmp_path):
    """`BartTaskRoutedConfig` has the seq2seq model's `model_type`: `AutoModelForSeq2SeqLM` loads a saved
    `BartTaskRouted` as the `TaskRoutedForSeq2SeqLM` it is, with the generation config it saved, so it generates what
    the class itself loads and generates (greedy and beam search, mixed tasks)."""
    from transformers import AutoModelForSeq2SeqLM

    from hf_taskmoe import TaskRoutedForSeq2SeqLM

    torch.manual_seed(0)
    tasks = [TaskSpec(name="a", problem_type="seq2seq"), TaskSpec(name="b", problem_type="seq2seq")]
    config = BartTaskRoutedConfig(tasks=tasks, num_experts=2, vocab_size=60, d_model=16, encoder_layers=1,
                                  decoder_layers=1, encoder_ffn_dim=32, decoder_ffn_dim=32, encoder_attention_heads=2,
                                  decoder_attention_heads=2, max_position_embeddings=40)
    model = BartTaskRouted(config).eval()
    with torch.no_grad():  # experts and routes that differ, as training would leave them
        for name, p in model.named_parameters():
            if ".experts." in name or name.startswith("router."):
                p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(tmp_path)
    own, auto = BartTaskRouted.from_pretrained(tmp_path).eval(), AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert type(own) is BartTaskRouted and type(auto) is TaskRoutedForSeq2SeqLM
    assert own.generation_config.to_diff_dict() == auto.generation_config.to_diff_dict()
    ids, task_ids = torch.randint(3, 60, (4, 7)), torch.tensor([0, 1, 0, 1])
    for beams in (1, 2):
        torch.testing.assert_close(auto.generate(ids, task_ids=task_ids, max_new_tokens=5, num_beams=beams),
                                   own.generate(ids, task_ids=task_ids, max_new_tokens=5, num_beams=beams),
                                   atol=0, rtol=0)
