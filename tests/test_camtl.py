import math

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModel, BertConfig, BertModel

import hf_taskmoe
from hf_taskmoe import CAMTLConfig, CAMTLModel, TaskSpec, parameter_report
from hf_taskmoe.analysis import covariance_similarity, first_layer_inputs, task_covariance_similarity
from hf_taskmoe.layers.conditional import (
    ConditionalAlignment,
    ConditionalAttentionBias,
    ConditionalBottleneck,
    ConditionalLayerNorm,
    Conditioning,
)

from .conftest import ALL_KINDS, TINY, random_batch

THREE = [
    TaskSpec(name="sst", num_labels=5),
    TaskSpec(name="qqp", num_labels=2),
    TaskSpec(name="sts", problem_type="regression"),
]
TINY4 = dict(TINY, num_hidden_layers=4)


def camtl_config(tasks=THREE, **overrides):
    kwargs = dict(TINY4, conditional_attention_max_length=16)
    kwargs.update(overrides)
    return CAMTLConfig(tasks=tasks, **kwargs)


def _randomise_conditioning(model, seed=1):
    """Move every FiLM / bottleneck away from its neutral start, as training would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".film." in name or "bottleneck.up" in name or "skip." in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.05)


def last_hidden(model, batch):
    """The encoder's last hidden states (after LARGE's skip connection)."""
    return model(**batch, output_hidden_states=True).hidden_states[-1]


def _model(config=None, seed=0, **overrides):
    torch.manual_seed(seed)
    model = CAMTLModel(config or camtl_config(**overrides))
    _randomise_conditioning(model)
    return model.eval()


def test_shapes_and_mixed_task_batch():
    for bottleneck in ("base", "large", "none"):
        model = _model(camtl_config(tasks=ALL_KINDS[:4], conditional_bottleneck=bottleneck))
        batch = random_batch(model.config, task_ids=torch.tensor([0, 1, 2, 3, 0, 1]))
        labels = torch.tensor([[1, -100, -100, -100], [2, -100, -100, -100], [0.5, -100, -100, -100], [1, 0, 1, 1],
                               [0, -100, -100, -100], [1, -100, -100, -100]], dtype=torch.float)
        out = model(**batch, labels=labels, output_hidden_states=True, output_attentions=True)
        assert out.loss.ndim == 0 and torch.isfinite(out.loss)
        assert set(out.task_losses) == {"sst2", "mnli", "stsb", "tags"}
        assert out.task_logits["mnli"].shape == (2, 3)
        assert len(out.hidden_states) == 5 and out.hidden_states[-1].shape == (6, 9, TINY["hidden_size"])


def test_init_covers_every_parameter():
    for bottleneck in ("base", "large"):
        model = CAMTLModel(camtl_config(initializer_range=1e-10, conditional_bottleneck=bottleneck))
        for name, param in model.named_parameters():
            p = param.detach()
            covered = (p.abs() < 1e-8) | (p == 1.0)
            assert covered.all(), f"{name} is not covered by _init_weights"
    model = CAMTLModel(camtl_config(initializer_range=0.5))
    layer = model.backbone.encoder.layer[3]
    assert torch.count_nonzero(layer.output.LayerNorm.weight.detach() != 1) == 0
    assert torch.count_nonzero(layer.output.LayerNorm.film.weight) == 0  # FiLM starts at gamma = 1, beta = 0
    assert torch.equal(model.alignment.weight.detach(), torch.eye(TINY["hidden_size"]))  # R = I
    assert abs(layer.attention_bias.blocks.std().item() - 0.5) < 0.15  # A_n random (N(0, initializer_range))
    assert torch.count_nonzero(layer.bottleneck.up.weight) == 0
    assert abs(model.task_embeddings.weight.std().item() - 0.5) < 0.2


@pytest.mark.parametrize("bottleneck", ["base", "large", "none"])
def test_fresh_model_from_dense_computes_the_dense_bert(bottleneck):
    torch.manual_seed(0)
    bert = BertModel(BertConfig(**TINY4)).eval()
    model, report = CAMTLModel.from_dense(
        bert, tasks=THREE, conditional_attention_max_length=16, conditional_attention_init_std=0.0,
        conditional_bottleneck=bottleneck, output_loading_info=True,
    )
    model.eval()
    assert not report.unused
    assert all(
        n.startswith("heads.")
        or any(k in n for k in (".film.", "attention_bias", "alignment", "bottleneck", "skip", "task_embeddings"))
        for n in report.new
    )
    batch = random_batch(model.config, task_ids=torch.tensor([0, 1, 2, 0, 1, 2]))
    plain = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    ours = model(**batch, output_hidden_states=True).hidden_states
    ref = bert(**plain, output_hidden_states=True).hidden_states
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    # the paper's random A_n (default std) bias the attention a little
    moved = CAMTLModel.from_dense(
        bert, tasks=THREE, conditional_attention_max_length=16, conditional_bottleneck=bottleneck
    ).eval()
    diff = (last_hidden(moved, batch) - ref[-1]).abs().max()
    assert 1e-6 < diff < 0.5


def test_fresh_model_from_real_minilm_computes_minilm(minilm):
    dense = BertModel.from_pretrained(minilm).eval()
    model = CAMTLModel.from_dense(minilm, tasks=THREE, conditional_attention_init_std=0.0).eval()
    batch = random_batch(model.config, batch=4, seq=12, task_ids=torch.tensor([0, 1, 2, 0]))
    plain = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    torch.testing.assert_close(
        last_hidden(model, batch), dense(**plain).last_hidden_state, atol=1e-5, rtol=0
    )
    assert model.config.upcycled_from == str(minilm)
    assert model.config.frozen_layers == 3 and model.config.conditional_layer_indices == [3, 4, 5]
    assert model.config.attention_blocks == 3  # N = d / L = 384 / 128


def test_modules_are_neutral_at_the_start_and_follow_their_equations():
    torch.manual_seed(0)
    d, task_dim, tasks = 8, 6, 3
    table = torch.randn(tasks, task_dim)
    cond = Conditioning(table, torch.tensor([0, 2, 1]))
    x = torch.randn(3, 5, d)

    cln = ConditionalLayerNorm(d, task_dim, eps=1e-12)
    ln = nn.LayerNorm(d, eps=1e-12)
    with torch.no_grad():
        for m in (cln, ln):
            m.weight.copy_(torch.linspace(0.5, 2, d))
            m.bias.copy_(torch.linspace(-1, 1, d))
        nn.init.zeros_(cln.film.weight), nn.init.zeros_(cln.film.bias)
    torch.testing.assert_close(cln(x, cond), ln(x))  # CLN == BERT's LayerNorm at the start
    with torch.no_grad():
        cln.film.weight.normal_()
    gamma, beta = cln.film(table)
    expected = torch.stack([
        nn.functional.layer_norm(x[r], (d,), eps=1e-12) * (cln.weight * gamma[t]) + cln.bias + beta[t]
        for r, t in enumerate([0, 2, 1])
    ])
    torch.testing.assert_close(cln(x, cond), expected)  # eq. 3

    align = ConditionalAlignment(d, task_dim)
    with torch.no_grad():
        align.weight.copy_(torch.eye(d))
        nn.init.zeros_(align.film.weight), nn.init.zeros_(align.film.bias)
    torch.testing.assert_close(align(x, cond), x)  # R = I, gamma = 1, beta = 0: identity
    with torch.no_grad():
        align.weight.normal_(), align.film.weight.normal_(), align.film.bias.normal_()
    gamma, beta = align.film(table)
    for r, t in enumerate([0, 2, 1]):
        r_hat = align.weight * gamma[t][None, :] + beta[t][None, :]  # eq. 2: R^(z) = R gamma(z) + beta(z)
        torch.testing.assert_close(align(x, cond)[r], x[r] @ r_hat, atol=1e-4, rtol=1e-4)

    bottleneck = ConditionalBottleneck(d, 3, task_dim)
    with torch.no_grad():
        for m in (bottleneck.up, bottleneck.up_film):  # as the model's _init_weights leaves them
            nn.init.zeros_(m.weight), nn.init.zeros_(m.bias)
    assert torch.count_nonzero(bottleneck(x, cond)) == 0


def test_conditional_attention_is_block_diagonal_and_crops_to_the_length():
    torch.manual_seed(0)
    bias = ConditionalAttentionBias(max_length=10, num_blocks=3, task_dim=4)  # blocks of ceil(10/3) = 4
    with torch.no_grad():
        bias.blocks.normal_(), bias.film.weight.normal_(), bias.film.bias.normal_()
    table = torch.randn(2, 4)
    full = bias.task_matrices(table, 10)  # (tasks, 10, 10)
    gamma, beta = bias.film(table)
    for t in range(2):
        blocks = [bias.blocks[n] * gamma[t].view(4, 4) + beta[t].view(4, 4) for n in range(3)]
        torch.testing.assert_close(full[t], torch.block_diag(*blocks)[:10, :10])
    assert torch.equal(bias.task_matrices(table, 6), full[:, :6, :6])  # any length up to the maximum
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    out = bias(Conditioning(table, torch.tensor([1, 0])), mask, 6, torch.float32)
    assert out.shape == (2, 1, 6, 6)
    assert (out[0, 0, :, 3:] == torch.finfo(torch.float32).min).all()
    torch.testing.assert_close(out[0, 0, :, :3], full[1, :6, :3])
    with pytest.raises(ValueError, match="at most `conditional_attention_max_length` = 10"):
        bias(Conditioning(table, torch.tensor([0])), None, 11, torch.float32)


def test_padding_and_variable_lengths_do_not_change_real_tokens():
    model = _model()
    torch.manual_seed(3)
    ids = torch.randint(1, 99, (1, 7))
    short = model(
        input_ids=ids, attention_mask=torch.ones_like(ids), task_ids=torch.tensor([1]), output_hidden_states=True
    )
    padded_ids = torch.cat([ids, torch.zeros(1, 5, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(1, 7, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long)], 1)
    padded = model(input_ids=padded_ids, attention_mask=mask, task_ids=torch.tensor([1]), output_hidden_states=True)
    torch.testing.assert_close(padded.hidden_states[-1][:, :7], short.hidden_states[-1], atol=1e-5, rtol=0)
    torch.testing.assert_close(padded.logits, short.logits, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="conditional_attention_max_length"):
        model(input_ids=torch.randint(1, 99, (1, 17)), task_ids=torch.tensor([0]))


def test_tasks_are_conditioned_and_mixed_batch_equals_task_by_task():
    model = _model()
    batch = random_batch(model.config, task_ids=torch.tensor([0, 1, 2, 0, 1, 2]))
    mixed = last_hidden(model, batch)
    for t in range(3):
        alone = last_hidden(model, {**batch, "task_ids": torch.full((6,), t)})
        rows = batch["task_ids"] == t
        torch.testing.assert_close(mixed[rows], alone[rows], atol=1e-5, rtol=0)
        if t:
            assert (
                alone - last_hidden(model, {**batch, "task_ids": torch.zeros(6, dtype=torch.long)})
            ).abs().max() > 1e-4


def test_frozen_layers_stay_unchanged_after_a_training_step():
    model = _model()
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert any(n.startswith("backbone.embeddings.") for n in frozen)
    assert any(n.startswith("backbone.encoder.layer.1.") for n in frozen) and not any(
        n.startswith("backbone.encoder.layer.2.") for n in frozen
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = random_batch(model.config, task_ids=torch.tensor([0, 1, 2, 0, 1, 2]))
    labels = torch.tensor([1, 0, 0.3, 4, 1, -0.2])
    model(**batch, labels=labels).loss.backward()
    optimizer.step()
    for name, param in model.named_parameters():
        changed = not torch.equal(before[name], param.detach())
        assert changed != (name in frozen) or name.startswith("heads."), name  # heads of absent classes may stay


def test_save_load_auto_round_trip_keeps_outputs_and_freezing(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    # a saved CAMTLModel is a saved CAMTLForMultiTask (its config has the family's model_type), BERT's pooler included
    assert type(config) is hf_taskmoe.CAMTLBackboneConfig and config.model_type == CAMTLConfig.model_type
    assert config.classifier_pooling == "pooler"
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert type(loaded) is hf_taskmoe.CAMTLForMultiTask and type(CAMTLModel.from_pretrained(tmp_path)) is CAMTLModel
    batch = random_batch(model.config, task_ids=torch.tensor([0, 1, 2, 0, 1, 2]))
    torch.testing.assert_close(
        last_hidden(loaded, batch), last_hidden(model, batch), atol=0, rtol=0
    )
    assert {n for n, p in loaded.named_parameters() if not p.requires_grad} == {
        n for n, p in model.named_parameters() if not p.requires_grad
    }


def test_add_task_grows_the_embedding_table():
    model = _model()
    new = model.add_task(TaskSpec(name="new", num_labels=2), init_from="qqp")
    assert new == 3 and model.task_embeddings.num_embeddings == 4
    torch.testing.assert_close(model.task_embeddings.weight[3], model.task_embeddings.weight[1])
    batch = random_batch(model.config, batch=2)
    as_new = last_hidden(model, {**batch, "task_ids": torch.tensor([3, 3])})
    as_source = last_hidden(model, {**batch, "task_ids": torch.tensor([1, 1])})
    torch.testing.assert_close(as_new, as_source)  # shares qqp's embedding: same modulation
    model.add_task(TaskSpec(name="fresh", problem_type="regression"))
    assert model.task_embeddings.num_embeddings == 5 and model.task_embeddings.weight[4].abs().sum() > 0
    out = model(**{**batch, "task_ids": torch.tensor([4, 3])}, labels=torch.tensor([0.5, 1.0]))
    assert torch.isfinite(out.loss)
    with pytest.raises(ValueError, match="Unknown task 'zz'"):
        model.add_task(TaskSpec(name="other", num_labels=2), init_from="zz")


def test_bad_config_values_name_the_field():
    for field, value, match in [
        ("num_frozen_layers", 9, "num_frozen_layers"),
        ("conditional_bottleneck", "huge", "conditional_bottleneck"),
        ("conditional_attention", "yes", "conditional_attention"),
        ("conditional_attention_blocks", 0, "conditional_attention_blocks"),
        ("conditional_layers", [0, 7], "conditional_layers"),
        ("task_embedding_dim", 0, "task_embedding_dim"),
    ]:
        with pytest.raises(ValueError, match=match):
            camtl_config(**{field: value})
    with pytest.raises(ValueError, match="bottleneck_layers"):
        camtl_config(conditional_bottleneck="large", bottleneck_layers=[1])


def test_parameter_overhead_for_bert_base_with_eight_glue_tasks():
    """The accounting helper on BERT-base with the paper's 8 GLUE tasks, against the count by hand."""
    glue = [
        TaskSpec(name=n, num_labels=k)
        for n, k in [("cola", 2), ("mnli", 3), ("mrpc", 2), ("qnli", 2), ("qqp", 2), ("rte", 2), ("sst2", 2)]
    ]
    glue.append(TaskSpec(name="stsb", problem_type="regression"))
    d, dense = 768, 109_482_240
    with torch.device("meta"):
        assert sum(p.numel() for p in BertModel(BertConfig()).parameters()) == dense
        model = CAMTLModel(CAMTLConfig.from_dense_config(BertConfig(), glue))
        report = parameter_report(model, dense_equivalent=dense)
    film = lambda out: d * 2 * out + 2 * out  # noqa: E731  (task_dim -> gamma, beta)
    block = math.ceil(128 / 6)  # N = d / L = 6 blocks
    attention = 6 * (6 * block * block + film(block * block))
    cln = 12 * film(d)
    alignment = d * d + film(d)
    bottleneck = (d * 256 + 256) + (256 * d + d) + film(256) + film(d)
    assert report.conditional == attention + cln + alignment + bottleneck
    assert report.task_embedding == 8 * d
    assert round(report.ratio_to_dense, 3) == 1.205
    with torch.device("meta"):
        smaller = parameter_report(
            CAMTLModel(CAMTLConfig.from_dense_config(BertConfig(), glue, task_embedding_dim=384)), dense
        )
    assert round(smaller.ratio_to_dense, 3) == 1.107


def test_attention_blocks_stay_bounded_at_long_lengths():
    """N = d / L at the paper's 128 tokens on BERT-base (6 blocks of 22); at 512, where N = d / L would be one 512 x 512
    block and 2.4 billion FiLM parameters, N grows with L so that no block is longer than 64."""
    tasks = [TaskSpec(name="a", num_labels=2)]
    sizes = {}
    for length in (128, 512, 2048):
        config = CAMTLConfig(tasks=tasks, conditional_attention_max_length=length)  # BERT-base sizes
        with torch.device("meta"):
            sizes[length] = sum(p.numel() for p in CAMTLModel(config).parameters())
        assert config.attention_blocks == {128: 6, 512: 8, 2048: 32}[length]
    assert sizes[128] < 132_000_000 and sizes[512] < 166_000_000 and sizes[2048] - sizes[512] < 1_000_000
    assert CAMTLConfig(tasks=tasks, conditional_attention_max_length=512,
                       conditional_attention_blocks=2).attention_blocks == 2  # as given


def test_a_saved_config_holds_its_blocks(tmp_path):
    """A saved config holds the block count N its model was built with, so a later default cannot change its shapes."""
    import json

    model = _model(camtl_config(conditional_attention_max_length=128, conditional_attention_blocks=1))
    assert camtl_config(conditional_attention_max_length=128).attention_blocks == 2  # the bounded default
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["conditional_attention_blocks"] == 1
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert loaded.config.attention_blocks == 1
    batch = random_batch(model.config, task_ids=torch.tensor([0, 1, 2, 0, 1, 2]))
    torch.testing.assert_close(last_hidden(loaded, batch), last_hidden(model.eval(), batch))
    fresh = camtl_config(conditional_attention_max_length=16)  # N = 2 both ways: saved, and loaded the same
    fresh.save_pretrained(tmp_path / "fresh")
    assert AutoConfig.from_pretrained(tmp_path / "fresh").attention_blocks == fresh.attention_blocks == 2


def test_covariance_similarity():
    torch.manual_seed(0)
    x = torch.randn(200, 8)
    assert covariance_similarity(x, x) == pytest.approx(1.0)
    assert covariance_similarity(x, 3 * x[torch.randperm(200)]) == pytest.approx(1.0)  # scale and order free
    # eq. 7 as printed: ||S||_F / tr S for identical inputs
    eigenvalues = torch.linalg.eigvalsh((x.T @ x).double())
    assert covariance_similarity(x, x, energy=1.0, normalized=False) == pytest.approx(
        (eigenvalues.norm() / eigenvalues.sum()).item(), rel=1e-6
    )
    left = torch.cat([torch.randn(100, 4), torch.zeros(100, 4)], 1)
    right = torch.cat([torch.zeros(100, 4), torch.randn(100, 4)], 1)
    assert covariance_similarity(left, right) == pytest.approx(0.0, abs=1e-9)
    names, matrix, average = task_covariance_similarity({"a": x, "b": x.clone(), "c": right})
    assert names == ["a", "b", "c"] and matrix[0, 1] == pytest.approx(1.0)
    assert average["a"] == pytest.approx((1.0 + matrix[0, 2]) / 2)
    with pytest.raises(ValueError, match="same features"):
        covariance_similarity(x, torch.randn(5, 3))

    model = _model()
    batches = {t: random_batch(model.config, batch=4, seed=i) for i, t in enumerate(model.config.task_names)}
    inputs = first_layer_inputs(model, batches)
    assert inputs["sst"].shape == (int(batches["sst"]["attention_mask"].sum()), TINY["hidden_size"])
    assert not torch.equal(inputs["sst"], first_layer_inputs(model, {"qqp": batches["sst"]})["qqp"])  # after alignment
    assert first_layer_inputs(model, batches, pooling="mean")["sts"].shape == (4, TINY["hidden_size"])


def test_readme_names_are_exported():
    assert hf_taskmoe.CAMTLModel is CAMTLModel
    family = hf_taskmoe.models.FAMILIES["camtl"]  # CAMTLModel is the family's BERT variant, not a family
    assert CAMTLModel in [m.model_class for m in family.variants] and family.model_class is hf_taskmoe.CAMTLForMultiTask


def test_flat_bert_fields_make_the_dense_config_and_read_back():
    config = camtl_config()
    assert config.dense_config.model_type == "bert" and config.dense_config.hidden_size == TINY["hidden_size"]
    assert config.hidden_size == TINY["hidden_size"] and config.pad_token_id == config.dense_config.pad_token_id
    assert config.classifier_pooling == "pooler"  # the first CAMTLConfig's default
    beside = CAMTLConfig(tasks=THREE, dense_config=BertConfig(**TINY4), use_cache=False)  # they set its fields
    assert beside.dense_config.use_cache is False and beside.dense_config.hidden_size == TINY["hidden_size"]
    config.use_cache = False  # written through: saved inside dense_config, not beside it
    assert config.dense_config.use_cache is False and "use_cache" not in config.to_dict()
    assert config.to_dict()["dense_config"]["use_cache"] is False
    with pytest.raises(AttributeError):
        config.not_a_field  # noqa: B018
