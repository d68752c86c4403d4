import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, BertConfig, BertForSequenceClassification, BertModel

from hf_taskmoe import BertForTaskMoE, TaskSpec, parameter_report
from hf_taskmoe.models import FAMILIES

from .conftest import TINY, make_hub_cache, random_batch

TASKS = [TaskSpec(name="sst2", num_labels=2), TaskSpec(name="stsb", problem_type="regression")]


def _tiny_bert(seed=0):
    torch.manual_seed(seed)
    return BertModel(BertConfig(**TINY)).eval()


def test_report_lists_copied_and_new_weights_and_every_expert_is_the_ffn():
    bert = _tiny_bert()
    model, report = BertForTaskMoE.from_dense(bert, tasks=TASKS, num_experts=3, output_loading_info=True)
    names = dict(model.named_parameters())
    assert set(report.copied) | set(report.new) == set(model.state_dict()) - {
        "task_fingerprint"
    }  # bookkeeping, not a weight
    assert all("router" in n or n.startswith("heads.") for n in report.new)
    assert not report.unused
    for i, layer in enumerate(bert.encoder.layer):
        experts = f"backbone.encoder.layer.{i}.intermediate.experts"
        assert names[f"{experts}.up_proj"].shape == (3, *layer.intermediate.dense.weight.shape)  # one slice per expert
        for e in range(3):
            assert torch.equal(names[f"{experts}.up_proj"][e], layer.intermediate.dense.weight)
            assert torch.equal(names[f"{experts}.up_proj_bias"][e], layer.intermediate.dense.bias)
            assert torch.equal(names[f"{experts}.down_proj"][e], layer.output.dense.weight)
            assert torch.equal(names[f"{experts}.down_proj_bias"][e], layer.output.dense.bias)
        assert torch.equal(names[f"backbone.encoder.layer.{i}.output.LayerNorm.weight"], layer.output.LayerNorm.weight)
    assert "copied" in report.summary() and model.config.upcycled_from


@pytest.mark.parametrize("weighting, equal", [("straight_through", True), ("gate", False)])
def test_function_preserving_mode_on_tiny_bert(weighting, equal):
    bert = _tiny_bert()
    model = BertForTaskMoE.from_dense(bert, tasks=TASKS, num_experts=4, expert_weighting=weighting).eval()
    batch = random_batch(model.config, task_ids=torch.tensor([0, 1] * 3))
    with torch.no_grad():
        dense = bert(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch["token_type_ids"]
        )
        moe = model(**batch, output_hidden_states=True).hidden_states[-1]
    real = batch["attention_mask"].bool()
    diff = (dense.last_hidden_state - moe)[real].abs().max().item()
    assert (diff < 1e-5) == equal, diff


def test_head_model_checkpoints_upcycle_from_their_encoder(tmp_path):
    torch.manual_seed(0)
    clf = BertForSequenceClassification(BertConfig(**TINY, num_labels=3)).eval()
    clf.save_pretrained(tmp_path)
    for source in (clf, str(tmp_path)):
        model = BertForTaskMoE.from_dense(source, tasks=TASKS, num_experts=2).eval()
        assert torch.equal(model.backbone.embeddings.word_embeddings.weight,
                           clf.bert.embeddings.word_embeddings.weight)
        assert torch.equal(model.backbone.pooler.dense.weight, clf.bert.pooler.dense.weight)


def test_checkpoint_without_pooler_is_an_error_unless_not_strict(tmp_path):
    bert = _tiny_bert()
    bert.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file(
        {k: v for k, v in weights.items() if not k.startswith("pooler.")},
        tmp_path / "model.safetensors",
        metadata={"format": "pt"},
    )
    with pytest.raises(ValueError, match=r"lacks 2 weights.*pooler"):
        BertForTaskMoE.from_dense(str(tmp_path), tasks=TASKS)
    model, report = BertForTaskMoE.from_dense(str(tmp_path), tasks=TASKS, strict=False, output_loading_info=True)
    assert "backbone.pooler.dense.weight" in report.new and "backbone.pooler.dense.weight" not in report.copied


def test_non_bert_checkpoint_is_refused():
    from transformers import DistilBertConfig, DistilBertModel

    distil = DistilBertModel(DistilBertConfig(vocab_size=99, dim=32, n_layers=1, n_heads=4, hidden_dim=37))
    with pytest.raises(ValueError, match="model_type 'bert'"):
        BertForTaskMoE.from_dense(distil, tasks=TASKS)


def test_every_family_has_rules():
    assert all(m.upcycling is not None for f in FAMILIES.values() if f.name != "mmoe" for m in f.members)


def test_repo_id_resolves_offline_from_hub_cache(tmp_path):
    """`from_pretrained("org/name")` and `from_dense("org/dense")` resolved from a cache snapshot, no network."""
    bert = _tiny_bert()
    bert.save_pretrained(tmp_path / "dense")
    cache = tmp_path / "cache"
    make_hub_cache(cache, "org/tiny-bert", tmp_path / "dense")
    hub = {"cache_dir": str(cache), "local_files_only": True}
    model = BertForTaskMoE.from_dense("org/tiny-bert", tasks=TASKS, num_experts=2, hub_kwargs=hub).eval()
    assert torch.equal(model.backbone.embeddings.word_embeddings.weight, bert.embeddings.word_embeddings.weight)

    model.save_pretrained(tmp_path / "moe")
    make_hub_cache(cache, "org/bert-mttag", tmp_path / "moe", revision="b" * 40)
    loaded = AutoModel.from_pretrained("org/bert-mttag", **hub).eval()
    assert type(loaded).__name__ == "TaskMoEForMultiTask"  # a saved BertForTaskMoE is the family's model
    batch = random_batch(model.config, task_ids=torch.tensor([0, 1] * 3))
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(**batch).task_logits["sst2"], model(**batch).task_logits["sst2"], atol=1e-5, rtol=0
        )


# --------------------------------------------------------------------------- real MiniLM weights
class _Records(logging.Handler):
    """transformers' logger does not propagate to the root logger (caplog), so listen to it directly."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("transformers").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("transformers").removeHandler(self)


def test_minilm_function_preserving_upcycling_equals_dense(minilm, minilm_tokenizer):
    dense = AutoModel.from_pretrained(minilm).eval()
    with _Records() as wrong_way:  # positive control: a dense checkpoint loaded straight into the MoE class
        BertForTaskMoE.from_pretrained(minilm, config=BertForTaskMoE.from_dense(dense, tasks=TASKS).config)
    assert any("MISSING" in m or "newly initialized" in m for m in wrong_way.messages)
    with _Records() as upcycled:
        model, report = BertForTaskMoE.from_dense(
            str(minilm), tasks=TASKS, num_experts=4, expert_weighting="straight_through", output_loading_info=True
        )
    # nothing copied is reported as freshly initialised, by transformers or by us
    assert not [m for m in upcycled.messages if "MISSING" in m or "newly initialized" in m]
    assert all("router" in n or n.startswith("heads.") for n in report.new)
    model.eval()
    texts = ["A gripping, beautifully acted film.", "Two sentences, one pair.", "Short."]
    enc = minilm_tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = dense(**enc, output_hidden_states=True)
        got = model(**enc, task_ids=torch.tensor([0, 1, 0]), output_hidden_states=True).hidden_states
        pooled = model.backbone.pooler(got[-1])
    real = enc["attention_mask"].bool()
    for e, g in zip(expected.hidden_states, got, strict=True):
        assert (e - g)[real].abs().max() < 1e-5
    assert (expected.pooler_output - pooled).abs().max() < 1e-5


def test_minilm_parameter_accounting_matches_paper(minilm):
    """MT-TaG section 3.2 / 4.4: MiniLM-L6-H384, 4 experts, 8 tasks -> 73,728 gating parameters, ~44M total."""
    tasks = [TaskSpec(name=f"t{i}", num_labels=2) for i in range(8)]
    model = BertForTaskMoE.from_dense(str(minilm), tasks=tasks, num_experts=4)
    dense_params = sum(p.numel() for p in AutoModel.from_pretrained(minilm).parameters())
    report = parameter_report(model, dense_equivalent=dense_params)
    assert report.gating == 6 * 4 * 384 * 8 == 73_728
    ffn = 384 * 1536 + 1536 + 1536 * 384 + 384  # one expert (P_f)
    assert report.expert == 6 * 4 * ffn  # L x N x P_f
    assert report.head == 8 * (384 * 2 + 2)
    assert report.shared == dense_params - 6 * ffn
    assert 43.5e6 < report.total < 44.5e6
    assert report.ratio_to_dense == pytest.approx(report.total / dense_params)
