import pytest
import torch
from transformers import AutoConfig, AutoModel, BertConfig, BertModel

import hf_taskmoe
from hf_taskmoe import BertPALsConfig, BertWithPALs, TaskSpec, parameter_report

from .conftest import ALL_KINDS, TINY, random_batch
from .test_trainer import TASKS, make_trainer

THREE = [
    TaskSpec(name="sst", num_labels=5),
    TaskSpec(name="qqp", num_labels=2),
    TaskSpec(name="sts", problem_type="regression"),
]


def pals_config(tasks=THREE, **overrides):
    kwargs = dict(TINY, pal_size=16, pal_num_heads=4)
    kwargs.update(overrides)
    return BertPALsConfig(tasks=tasks, **kwargs)


def encode(model, input_ids=None, attention_mask=None, token_type_ids=None, task_ids=None, output_hidden_states=None):
    """What the heads read: the encoder's output (`last_hidden_state`, `pooler_output`, `hidden_states`),
    `model.encode`."""
    return model.encode(input_ids, attention_mask, token_type_ids, None, None, task_ids, None, output_hidden_states)


def _model(config=None, seed=0, **overrides):
    torch.manual_seed(seed)
    # D_t ~ N(0, 0.02) so PALs change the output (the default zero D_t is tested on its own)
    return BertWithPALs(config or pals_config(pal_decoder_init="normal", **overrides)).eval()


def test_shapes_and_mixed_task_batch():
    model = _model(pals_config(tasks=ALL_KINDS[:4], pal_decoder_init="normal"))
    batch = random_batch(model.config, task_ids=torch.tensor([0, 1, 2, 3, 0, 1]))
    labels = torch.tensor([[1, -100, -100, -100], [2, -100, -100, -100], [0.5, -100, -100, -100], [1, 0, 1, 1],
                           [0, -100, -100, -100], [1, -100, -100, -100]], dtype=torch.float)
    out = model(**batch, labels=labels, output_hidden_states=True)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    assert set(out.task_losses) == {"sst2", "mnli", "stsb", "tags"}
    assert out.task_logits["mnli"].shape == (2, 3) and out.task_logits["tags"].shape == (1, 4)
    assert len(out.hidden_states) == TINY["num_hidden_layers"] + 1
    assert out.hidden_states[-1].shape == (6, 9, TINY["hidden_size"])


def test_init_covers_every_parameter():
    for decoder_init in ("zeros", "normal"):
        model = BertWithPALs(pals_config(initializer_range=1e-10, pal_decoder_init=decoder_init))
        for name, param in model.named_parameters():
            p = param.detach()
            covered = (p.abs() < 1e-8) | (p == 1.0)
            assert covered.all(), f"{name} is not covered by _init_weights"
    model = BertWithPALs(pals_config(initializer_range=0.5))
    pals = model.pals
    assert all(torch.count_nonzero(d.weight) == 0 for d in pals.decoders)  # D_t = 0 by default
    assert all(abs(e.weight.std().item() - 0.5) < 0.1 for e in pals.encoders)
    assert abs(pals.attention["1"][2].qkv.weight.std().item() - 0.5) < 0.15


def test_fresh_model_from_dense_computes_the_dense_bert():
    torch.manual_seed(0)
    bert = BertModel(BertConfig(**TINY)).eval()
    model, report = BertWithPALs.from_dense(bert, tasks=THREE, pal_size=16, pal_num_heads=4, output_loading_info=True)
    model.eval()
    assert not report.unused and all(n.startswith(("heads.", "pals.")) for n in report.new)
    batch = random_batch(model.config, task_ids=torch.tensor([0, 1, 2, 0, 1, 2]))
    plain = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    with torch.no_grad():
        expected = bert(**plain, output_hidden_states=True)
        got = encode(model, **batch, output_hidden_states=True)
    for e, g in zip(expected.hidden_states, got.hidden_states, strict=True):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=0)
    torch.testing.assert_close(got.pooler_output, expected.pooler_output, atol=1e-6, rtol=0)
    # with D_t drawn at random the PALs do change the output
    moved = BertWithPALs.from_dense(bert, tasks=THREE, pal_size=16, pal_num_heads=4, pal_decoder_init="normal").eval()
    with torch.no_grad():
        assert (encode(moved, **batch).last_hidden_state - expected.last_hidden_state).abs().max() > 1e-4


def test_from_dense_on_real_minilm(minilm):
    dense = BertModel.from_pretrained(minilm).eval()
    model = BertWithPALs.from_dense(minilm, tasks=THREE).eval()
    ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 102, 0], [101, 2178, 6251, 102, 0, 0, 0]])
    mask = (ids != 0).long()
    with torch.no_grad():
        expected = dense(input_ids=ids, attention_mask=mask).last_hidden_state
        got = encode(model, input_ids=ids, attention_mask=mask, task_ids=torch.tensor([0, 2])).last_hidden_state
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_pal_parameter_formula_for_bert_base():
    """Per task 12(3s^2) + 2sd: 1,811,520 at s=204 and 4,276,800 at s=324 (the paper's "43m" is a typo)."""
    base = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, vocab_size=30522)
    with torch.device("meta"):
        dense = BertModel(BertConfig(**base))
        for s, per_task in ((204, 1_811_520), (324, 4_276_800)):
            config = BertPALsConfig(tasks=THREE, pal_size=s, **base)
            assert config.pal_parameters_per_group() == per_task == 12 * 3 * s**2 + 2 * s * 768
            model = BertWithPALs(config)
            report = parameter_report(model, dense_equivalent=sum(p.numel() for p in dense.parameters()))
            assert report.pal == 3 * per_task
            assert report.total == report.dense_equivalent + report.pal + report.head
            if s == 324:  # the paper: about 1.13-1.15x (1.15x counts the 12 layers only)
                assert 1.11 < report.ratio_to_dense < 1.14
        grouped = BertWithPALs(BertPALsConfig(tasks=THREE, pal_size=324, pal_task_groups=[["qqp", "sts"]], **base))
        assert parameter_report(grouped).pal == 2 * 4_276_800


def test_task_group_shares_one_set_of_pals():
    model = _model(pal_task_groups=[["qqp", "sts"]])
    assert model.config.task_group_ids == [0, 1, 1] and model.config.pal_groups == [["sst"], ["qqp", "sts"]]
    pals = model.pals
    assert pals.num_groups == 2 and len(pals.attention["0"]) == 2
    batch = random_batch(model.config, task_ids=torch.zeros(6, dtype=torch.long))
    with torch.no_grad():
        hidden = {t: encode(model, **{**batch, "task_ids": torch.full((6,), t)}).last_hidden_state for t in range(3)}
    torch.testing.assert_close(hidden[1], hidden[2], atol=0, rtol=0)  # same PALs
    assert (hidden[0] - hidden[1]).abs().max() > 1e-4
    # a qqp loss and an sts loss both reach the one shared set
    model.train()
    for task in (1, 2):
        model.zero_grad()
        out = model(**{**batch, "task_ids": torch.full((6,), task)}, labels=torch.zeros(6))
        out.loss.backward()
        assert pals.encoders[1].weight.grad.abs().sum() > 0 and pals.encoders[0].weight.grad is None
    names = [n for n, _ in model.named_parameters() if n.startswith("pals.")]
    assert len(names) == 2 * (2 + TINY["num_hidden_layers"])  # per group: E, D, one fused qkv per layer


def test_pal_layers_subset_and_padding_ignored():
    model = _model(pal_layers=[1])
    assert list(model.pals.attention) == ["1"]
    batch = random_batch(model.config, task_ids=torch.zeros(6, dtype=torch.long), pad_last=3)
    changed = dict(batch, input_ids=batch["input_ids"].clone())
    changed["input_ids"][0, -3:] = 7  # tokens under the padding mask
    with torch.no_grad():
        a = encode(model, **batch).last_hidden_state[0, :-3]
        b = encode(model, **changed).last_hidden_state[0, :-3]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_save_load_and_auto_round_trip(tmp_path):
    model = _model(pal_task_groups=[["sst", "sts"]], pal_layers=[0])
    batch = random_batch(model.config, task_ids=torch.tensor([0, 1, 2, 0, 1, 2]))
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    # through its class a BertWithPALs; through AutoModel the family's model it is (its config has the family's
    # model_type), BERT's pooler included: the same numbers either way
    assert type(AutoConfig.from_pretrained(tmp_path)) is hf_taskmoe.PALsConfig
    for loaded, cls in ((BertWithPALs.from_pretrained(tmp_path), BertWithPALs),
                        (AutoModel.from_pretrained(tmp_path), hf_taskmoe.PALsForMultiTask)):
        assert type(loaded) is cls
        assert loaded.config.pal_groups == model.config.pal_groups and loaded.config.pal_layers == [0]
        with torch.no_grad():
            a, b = model(**batch), loaded.eval()(**batch)
        for name in a.task_logits:
            torch.testing.assert_close(a.task_logits[name], b.task_logits[name], atol=1e-6, rtol=0)
    base = BertWithPALs.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(encode(base, **batch).last_hidden_state, encode(model, **batch).last_hidden_state)


def test_add_task_copies_pals_of_a_related_task(tmp_path):
    model = _model()
    new_id = model.add_task(TaskSpec(name="mrpc", num_labels=2), init_from="qqp")
    assert new_id == 3 and model.config.task_group_ids == [0, 1, 2, 3]
    batch = random_batch(model.config, task_ids=torch.full((6,), 1))
    with torch.no_grad():
        as_qqp = encode(model, **batch).last_hidden_state
        as_mrpc = encode(model, **{**batch, "task_ids": torch.full((6,), 3)}).last_hidden_state
    torch.testing.assert_close(as_mrpc, as_qqp, atol=0, rtol=0)
    fresh = model.add_task(TaskSpec(name="cola", num_labels=2))
    assert torch.count_nonzero(model.pals.decoders[fresh].weight) == 0 or model.config.pal_decoder_init == "normal"
    model.save_pretrained(tmp_path)
    loaded = BertWithPALs.from_pretrained(tmp_path).eval()
    assert loaded.config.task_names == ["sst", "qqp", "sts", "mrpc", "cola"]
    with torch.no_grad():
        as_mrpc_loaded = encode(loaded, **{**batch, "task_ids": torch.full((6,), 3)}).last_hidden_state
        torch.testing.assert_close(as_mrpc_loaded, as_mrpc)


def test_train_task_specific_only_leaves_backbone_bit_identical(tmp_path):
    torch.manual_seed(0)
    model = BertWithPALs(pals_config(tasks=TASKS))
    trainer = make_trainer(tmp_path, model=model, train_task_specific_only=True, max_steps=3, task_sampling="annealed")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.train()
    after = model.state_dict()
    changed_pals = 0
    for key in before:
        if key.startswith("pals."):
            changed_pals += not torch.equal(before[key], after[key])
        elif not key.startswith("heads."):
            assert torch.equal(before[key], after[key]), key
    assert changed_pals > 0


@pytest.mark.parametrize("sampling", ["round_robin", "sqrt", "proportional", "annealed"])
def test_trains_with_every_paper_sampler(tmp_path, sampling):
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, model=BertWithPALs(pals_config(tasks=TASKS)), task_sampling=sampling, max_steps=4)
    trainer.train()
    assert trainer.state.global_step == 4
    assert "eval_average" in trainer.evaluate()


def test_gradient_checkpointing_gives_the_same_gradients():
    model = _model()
    batch = random_batch(model.config)
    labels = torch.tensor([1.0, 1.0, 0.5, 2.0, 0.0, -0.5])
    grads = []
    for checkpointing in (False, True):
        model.zero_grad()
        if checkpointing:
            # transformers >= 5.2x renamed it (the old name warns)
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        model.train()
        torch.manual_seed(0)
        model(**batch, labels=labels).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(pal_size=10, pal_num_heads=4), "multiple of `pal_num_heads`"),
        (dict(pal_size=0), "pal_size"),
        (dict(pal_task_groups=[["qqp", "nope"]]), "unknown task 'nope'"),
        (dict(pal_task_groups=[["qqp", "sts"], ["sts", "sst"]]), "more than one group"),
        (dict(pal_task_groups=[[]]), "non-empty"),
        (dict(pal_task_groups="qqp"), "list of lists"),
        (dict(pal_layers=[0, 5]), "pal_layers"),
        (dict(pal_decoder_init="ones"), "pal_decoder_init"),
    ],
)
def test_bad_config_values_raise_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        pals_config(**overrides)


def test_registration_and_family_name():
    # the paper's BERT class is a variant of the PALs family, saved as the family's model_type
    assert BertPALsConfig.model_type == hf_taskmoe.PALsConfig.model_type == "taskmoe_pals"
    assert hf_taskmoe.models.get_family("bert_pals") is hf_taskmoe.models.FAMILIES["pals"]
    assert hf_taskmoe.models.family_for("bert_pals", "bert").model_class is BertWithPALs


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_per_group_and_batched_dispatch_compute_the_same_step(family):
    """`pal_dispatch`: a mixed batch through each group's PALs on its rows, or every row at once through its group's
    gathered weights, gives the same loss, per-task losses and gradients, and the same parameters get one (an
    absent task's PALs none); a name outside the choices is refused."""
    from hf_taskmoe import PALsConfig, PALsForMultiTask

    from .backbone_matrix import TASKS as MATRIX_TASKS
    from .backbone_matrix import dense_config, labelled_batch

    tasks = [*MATRIX_TASKS, TaskSpec(name="absent", num_labels=2)]

    def build(dispatch):
        torch.manual_seed(0)
        if family == "bert":
            config = BertPALsConfig(tasks=tasks, pal_size=8, pal_num_heads=2, pal_decoder_init="normal",
                                    pal_dispatch=dispatch, **TINY)
            return BertWithPALs(config).train()
        return PALsForMultiTask(PALsConfig(dense_config=dense_config("roberta"), tasks=tasks, pal_size=8,
                                           pal_num_heads=2, pal_decoder_init="normal", pal_dispatch=dispatch)).train()

    results = {}
    for dispatch in ("per_group", "batched"):
        model = build(dispatch)
        batch = labelled_batch(model, torch.tensor([0, 1, 1, 0, 1])) if family == "roberta" else None
        if batch is None:
            from .backbone_matrix import token_batch

            batch = token_batch("bert", TINY["vocab_size"], torch.tensor([0, 1, 1, 0, 1]))
            batch["labels"] = torch.tensor([1.0, 0.5, -0.3, 2.0, 1.2])
        torch.manual_seed(1)  # the same dropout masks
        out = model(**batch)
        out.loss.backward()
        results[dispatch] = (out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    (loop, loop_grads), (batched, batched_grads) = results["per_group"], results["batched"]
    torch.testing.assert_close(batched.loss, loop.loss, atol=1e-6, rtol=1e-5)
    assert set(batched_grads) == set(loop_grads) and not any(".2." in n and "pals" in n for n in loop_grads)
    for name, grad in loop_grads.items():
        torch.testing.assert_close(batched_grads[name], grad, atol=1e-5, rtol=1e-4)  # summed in another order
    with pytest.raises(ValueError, match="pal_dispatch"):
        BertPALsConfig(tasks=tasks, pal_dispatch="grouped", **TINY)


@pytest.mark.parametrize("dispatch", ["batched", "per_group"])
def test_gradient_checkpointing_gives_the_same_step_on_a_mixed_batch(dispatch):
    """With activation checkpointing a mixed batch's training step is the one without, bit for bit: the batched
    path's rows and gathered weights are made once before the first layer (`PALsForMultiTask._plan_pals`), not inside
    the first checkpointed layer, whose recomputation would not make them again (torch.utils.checkpoint raised
    `CheckpointError` there)."""
    from hf_taskmoe.training.batches import BatchChecker

    tasks = [*THREE, TaskSpec(name="absent", num_labels=2)]
    batch = random_batch(pals_config(tasks=tasks), task_ids=torch.tensor([0, 1, 2, 0, 1, 2]))
    batch["labels"] = torch.tensor([[1.0], [0.0], [0.5], [3.0], [1.0], [-0.2]])
    batch = {**batch, **BatchChecker.for_model(_model(pals_config(tasks=tasks))).check(batch)}  # the collator's marks
    results = []
    for checkpointing in (False, True):
        model = _model(pals_config(tasks=tasks, pal_dispatch=dispatch, pal_decoder_init="normal")).train()
        if checkpointing:
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        torch.manual_seed(5)  # the same dropout masks
        out = model(**batch)
        out.loss.backward()
        results.append((out.loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss, grads), (checkpointed_loss, checkpointed_grads) = results
    assert torch.equal(checkpointed_loss, loss) and set(checkpointed_grads) == set(grads)
    assert any(n.startswith("pals.attention.") for n in grads) and not any("pals.encoders.3" in n for n in grads)
    for name, grad in grads.items():
        assert torch.equal(checkpointed_grads[name], grad), name
