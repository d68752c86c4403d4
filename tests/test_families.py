"""Every registered family of the package runs the shared contract (`family_tester.FamilyContract`)."""

from __future__ import annotations

import pytest
import torch
from transformers import BartConfig, BartForConditionalGeneration, BertConfig, BertModel

import hf_taskmoe
from hf_taskmoe import TaskSpec
from hf_taskmoe.models import get_family

from .conftest import TINY, random_batch
from .family_tester import FamilyCase, FamilyContract

NO_DROPOUT = dict(TINY, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
ENCODER_TASKS = [TaskSpec(name="a", num_labels=3), TaskSpec(name="b", problem_type="regression")]
NEW_ENCODER_TASK = TaskSpec(name="c", num_labels=2)


def encoder_batch(model, ids, rows=None, seed=0):
    """Token inputs and per-task labels for rows of tasks `ids` (`rows`: keep only those rows)."""
    batch = random_batch(model.config, batch=len(ids), seq=9, task_ids=ids, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    specs = model.config.task_specs
    labels = [float(torch.randint(0, specs[t].num_labels, (1,), generator=g)) if specs[t].problem_type != "regression"
              else float(torch.randn(1, generator=g)) for t in ids.tolist()]
    batch["labels"] = torch.tensor(labels)
    return batch if rows is None else {k: v[rows] for k, v in batch.items()}


def _dense_bert():
    torch.manual_seed(0)
    return BertModel(BertConfig(**NO_DROPOUT)).eval()


def _encoder_equivalence(model_cls, **kwargs):
    def build():
        dense = _dense_bert()
        fresh = model_cls.from_dense(dense, tasks=ENCODER_TASKS, **kwargs).eval()

        def reference(model):
            batch = random_batch(model.config, batch=4, seq=9, task_ids=torch.tensor([0, 1, 0, 1]))
            plain = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
            with torch.no_grad():
                if hasattr(model, "bert"):  # a BERT-specific class's bare encoder
                    got = model.bert(**plain, task_ids=batch["task_ids"]).last_hidden_state
                else:  # a class on the backbone layer: the encoder's last states, what the heads read
                    got = model(**plain, task_ids=batch["task_ids"], output_hidden_states=True).hidden_states[-1]
                expected = dense(**plain).last_hidden_state
            mask = batch["attention_mask"].bool()
            return got[mask], expected[mask]
        return fresh, reference
    return build


def _tiny_bart():
    torch.manual_seed(0)
    return BartForConditionalGeneration(BartConfig(
        vocab_size=60, d_model=16, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        encoder_attention_heads=2, decoder_attention_heads=2, max_position_embeddings=40, dropout=0.0,
    )).eval()


def bart_batch(model, ids, rows=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch = {
        "input_ids": torch.randint(3, 60, (len(ids), 7), generator=g),
        "labels": torch.randint(3, 60, (len(ids), 5), generator=g),
        "task_ids": ids,
    }
    return batch if rows is None else {k: v[rows] for k, v in batch.items()}


def _bart_equivalence():
    dense = _tiny_bart()
    fresh = hf_taskmoe.BartTaskRouted.from_dense(dense, [TaskSpec(name=n, problem_type="seq2seq") for n in "xy"],
                                                 expert_noise_variance=0.0, selection="average").eval()

    def reference(model):
        batch = bart_batch(model, torch.tensor([0, 1, 0]))
        with torch.no_grad():
            return model(**batch).logits, dense(input_ids=batch["input_ids"], labels=batch["labels"]).logits
    return fresh, reference


MMOE_TASKS = [TaskSpec(name="click", num_labels=2), TaskSpec(name="rating", problem_type="regression")]


def mmoe_build(tasks):
    return hf_taskmoe.MMoEModel(hf_taskmoe.MMoEConfig(
        tasks=tasks, numeric_features=["age", "price"], categorical_features=["city"], categorical_cardinalities=[5],
        embedding_dim=3, num_experts=3, expert_hidden_sizes=[8], tower_hidden_sizes=[4], dropout=0.0,
    ))


def mmoe_batch(model, ids, rows=None, seed=0):
    """MMoE rows carry every task's label (no task ids): `ids` gives the number of rows."""
    g = torch.Generator().manual_seed(seed)
    n = len(ids)
    labels = [
        torch.randint(0, s.num_labels, (n,), generator=g).float()
        if s.problem_type != "regression"
        else torch.randn(n, generator=g)
        for s in model.config.task_specs
    ]
    batch = {
        "numeric_features": torch.randn(n, 2, generator=g),
        "categorical_features": torch.randint(0, 5, (n, 1), generator=g),
        "labels": torch.stack(labels, 1),
    }
    return batch if rows is None else {k: v[rows] for k, v in batch.items()}


# the BERT families' bare encoder (`model.bert`) and the layers their outputs report
ENCODER_EXTRA = {"encoder": "bert", "layers": {"hidden_states": "num_hidden_layers", "attentions": "num_hidden_layers"}}

CASES = {
    "bert_taskmoe": FamilyCase(
        "bert_taskmoe",
        ENCODER_TASKS,
        lambda tasks: hf_taskmoe.BertForTaskMoE(hf_taskmoe.BertTaskMoEConfig(tasks=tasks, num_experts=3, **NO_DROPOUT)),
        encoder_batch,
        NEW_ENCODER_TASK,
        dense_equivalent=_encoder_equivalence(
            hf_taskmoe.BertForTaskMoE, num_experts=3, expert_weighting="straight_through"
        ),
        extra={"layers": ENCODER_EXTRA["layers"]},  # no bare encoder: the dense model runs inside
    ),
    "bert_pals": FamilyCase(
        "bert_pals",
        ENCODER_TASKS,
        lambda tasks: hf_taskmoe.BertWithPALs(
            hf_taskmoe.BertPALsConfig(tasks=tasks, pal_size=8, pal_num_heads=2, **NO_DROPOUT)
        ),
        encoder_batch,
        NEW_ENCODER_TASK,
        dense_equivalent=_encoder_equivalence(hf_taskmoe.BertWithPALs, pal_size=8, pal_num_heads=2),
        # PALsForMultiTask with a BERT default: transformers' BertModel under `backbone.`, no bare `model.bert`
        extra={"layers": ENCODER_EXTRA["layers"]},
    ),
    "camtl": FamilyCase(
        "camtl",
        ENCODER_TASKS,
        lambda tasks: hf_taskmoe.CAMTLModel(
            hf_taskmoe.CAMTLConfig(tasks=tasks, conditional_attention_max_length=16, **NO_DROPOUT)
        ),
        encoder_batch,
        NEW_ENCODER_TASK,
        dense_equivalent=_encoder_equivalence(
            hf_taskmoe.CAMTLModel, conditional_attention_max_length=16, conditional_attention_init_std=0.0
        ),
        extra={k: v for k, v in ENCODER_EXTRA.items() if k != "encoder"},  # no bare encoder module
    ),
    "bart_routed": FamilyCase(
        "bart_routed",
        [TaskSpec(name=n, problem_type="seq2seq") for n in "xyz"],
        lambda tasks: hf_taskmoe.BartTaskRouted.from_dense(_tiny_bart(), tasks, selection="gumbel_softmax_st"),
        bart_batch,
        TaskSpec(name="w", problem_type="seq2seq"),
        learns_steps=80,
        dense_equivalent=_bart_equivalence,
        extra={
            "layers": {
                "encoder_hidden_states": "encoder_layers",
                "encoder_attentions": "encoder_layers",
                "decoder_hidden_states": "decoder_layers",
                "decoder_attentions": "decoder_layers",
                "cross_attentions": "decoder_layers",
            }
        },
    ),
    "mmoe": FamilyCase(
        "mmoe",
        MMOE_TASKS,
        mmoe_build,
        mmoe_batch,
        TaskSpec(name="genre", num_labels=3),
        output_key="task_logits",
        learns_steps=200,
        learns_lr=1e-2,
        extra={"task_ids": False, "roles_without_parameters": ("bottom",)},  # MMoE: no Shared-Bottom tower
    ),
}


def test_every_family_of_the_package_has_a_case():
    """Every family runs the contract here (a case named after the family or one of its other names), and every model
    of a family (its variants: the paper's class, task-level routing's causal and seq2seq LMs) in a test module that
    subclasses `FamilyContract` and builds it (this one, or one over an architecture matrix)."""
    from pathlib import Path

    package = {n for n, f in hf_taskmoe.FAMILIES.items() if f.model_class.__module__.startswith("hf_taskmoe.")}
    assert package == {get_family(n).name for n in CASES}
    contracts = [text for p in Path(__file__).parent.glob("test_*.py") if "(FamilyContract)" in (text := p.read_text())]
    models = {m.model_class.__name__ for n in package for m in hf_taskmoe.FAMILIES[n].members}
    assert {m for m in models if not any(m in text for text in contracts)} == set()


@pytest.fixture(params=list(CASES), ids=list(CASES))
def case(request):
    return CASES[request.param]


class TestFamilies(FamilyContract):
    @pytest.fixture(autouse=True)
    def _case(self, case):
        self.case = case
