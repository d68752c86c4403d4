"""A family defined here, in the test file only (a config, a model, one registration), gets Auto loading,
`run_multitask.py --model_family`, a model card and the shared family contract without any edit elsewhere."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from torch import nn
from transformers import AutoModel, PreTrainedConfig

import hf_taskmoe
from hf_taskmoe import TaskSpec
from hf_taskmoe.contract import ParameterRoles
from hf_taskmoe.input_checks import check_input_shapes, check_kwargs
from hf_taskmoe.layers.heads import MultiTaskHeads
from hf_taskmoe.modeling_utils import MultiTaskModelOutput, MultiTaskPreTrainedModel, heads_to_output_fields
from hf_taskmoe.models import FAMILIES, Family, register_family
from hf_taskmoe.models.configuration import TaskConfigMixin
from hf_taskmoe.upcycling import UpcyclingRules, load_dense_model, upcycle

from .family_tester import FamilyCase, FamilyContract
from .test_families import encoder_batch

ROOT = Path(__file__).resolve().parents[1]


class ToyConfig(TaskConfigMixin, PreTrainedConfig):
    """Bag of embeddings, mean-pooled, one head per task."""

    model_type = "taskmoe_toy"

    def __init__(self, tasks=None, vocab_size=99, hidden_size=16, max_position_embeddings=64, pad_token_id=0, **kwargs):
        self.tasks, self.vocab_size, self.hidden_size = tasks, vocab_size, hidden_size
        self.max_position_embeddings = max_position_embeddings
        super().__init__(pad_token_id=pad_token_id, **kwargs)
        self._validate_tasks(
            ("single_label_classification", "regression"), "is not supported by the toy family; it supports"
        )


class ToyModel(MultiTaskPreTrainedModel):
    config_class = ToyConfig
    base_model_prefix = ""
    records_task_order = True
    parameter_roles = ParameterRoles(roles={"embedding": r"^embeddings\."})  # a head is all a task owns

    def __init__(self, config):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.heads = MultiTaskHeads(config.task_specs, config.hidden_size, dropout=0.0)
        self.post_init()

    def _init_weights(self, module):
        self._init_task_order(module)  # the task fingerprint buffer (a family with its own init scheme calls it)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def _grow_for_task(self, new_id, source):
        pass  # a head is all a task owns here

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, task_ids=None, labels=None,
                return_dict=None, **kwargs):
        check_kwargs(kwargs, self.forward)
        batch, seq = check_input_shapes(input_ids, None, self.max_input_length(), attention_mask=attention_mask)
        task_ids, rows, prepared = self._prepare_task_batch(task_ids, batch, seq, labels, None)
        hidden = self.embeddings(input_ids)  # (batch, seq, hidden)
        mask = (
            (attention_mask if attention_mask is not None else torch.ones_like(input_ids))
            .unsqueeze(-1)
            .to(hidden.dtype)
        )
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)  # (batch, hidden)
        out = self.heads(hidden, pooled, rows, prepared)
        output = MultiTaskModelOutput(loss=out.loss, task_ids=task_ids, **heads_to_output_fields(out))
        return output if (return_dict if return_dict is not None else self.config.return_dict) else output.to_tuple()

    @classmethod
    def from_dense(cls, dense, tasks, output_loading_info=False, hub_kwargs=None, **config_kwargs):
        checkpoint = load_dense_model(dense, **(hub_kwargs or {}))
        c = checkpoint.config
        model = cls(ToyConfig(tasks=tasks, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                              max_position_embeddings=c.max_position_embeddings, **config_kwargs))
        report = upcycle(checkpoint, model, strict=False)
        return (model, report) if output_loading_info else model


TOY = Family(
    name="toy",
    config_class=ToyConfig,
    model_class=ToyModel,
    problem_types=("single_label_classification", "regression"),
    pipeline_task=hf_taskmoe.pipelines.PIPELINE_TASK,
    describe=lambda c: f"a toy: embeddings of size {c.hidden_size}, mean-pooled",
    upcycling=UpcyclingRules(
        rename=((r"embeddings\.weight", r"embeddings.word_embeddings.weight"),),
        new=ToyModel.parameter_roles.new_patterns,
    ),
    dense_model_types=("bert",),
)


@pytest.fixture(scope="module", autouse=True)
def toy_family():
    register_family(TOY, exist_ok=True)
    yield
    FAMILIES.pop("toy", None)


TOY_TASKS = [TaskSpec(name="a", num_labels=3), TaskSpec(name="b", problem_type="regression")]
TOY_CASE = FamilyCase(
    "toy",
    TOY_TASKS,
    lambda tasks: ToyModel(ToyConfig(tasks=tasks)),
    encoder_batch,
    TaskSpec(name="c", num_labels=2),
    learns_steps=150,
    learns_lr=1e-2,
)


class TestToyFamilyContract(FamilyContract):
    case = TOY_CASE


def test_a_task_model_without_the_contract_s_declarations_is_refused_when_defined():
    """A family's task model must declare its parameter roles and what `add_task` grows: a class missing either is
    refused where it is written, naming what is missing, not when a trainer first asks."""
    with pytest.raises(TypeError, match=r"parameter_roles = ParameterRoles.*_grow_for_task"):
        type("NoContract", (MultiTaskPreTrainedModel,), {"config_class": ToyConfig, "records_task_order": True})
    with pytest.raises(TypeError, match="_grow_for_task") as caught:
        type("NoGrowth", (MultiTaskPreTrainedModel,),
             {"config_class": ToyConfig, "records_task_order": True, "parameter_roles": ToyModel.parameter_roles})
    assert "parameter_roles" not in str(caught.value)
    # a base class of a family (no task order of its own) declares nothing
    type("Base", (MultiTaskPreTrainedModel,), {"config_class": ToyConfig})


def test_parameter_roles_are_checked_where_declared():
    with pytest.raises(ValueError, match=r"`task_specific` names \['gate'\].*roles are \['embedding', 'head'\]"):
        ParameterRoles(roles={"embedding": r"^embeddings\."}, task_specific=("gate",))
    with pytest.raises(ValueError, match="`head` is declared by `heads=True`"):
        ParameterRoles(roles={"head": r"^heads\."})
    with pytest.raises(ValueError, match="`shared` is what matches no role"):
        ParameterRoles(roles={"shared": r"."}, heads=False)
    roles = ParameterRoles(roles={"gate": r"\.gate\."}, task_specific=("gate",))
    assert roles.role_of("heads.a.dense.weight") == "head" and roles.role_of("encoder.x.weight") == "shared"
    assert roles.possibly_idle == ("head",) and roles.new == ("head",) and roles.task_specific == ("gate", "head")


def test_registration_checks_names():
    class Bad(ToyConfig):
        model_type = "toy2"

    with pytest.raises(ValueError, match="must start with 'taskmoe_'"):
        register_family(Family(name="bad", config_class=Bad, model_class=ToyModel))
    with pytest.raises(ValueError, match="already registered"):
        register_family(Family(name="toy", config_class=ToyConfig, model_class=ToyModel))


def test_the_toy_family_trains_through_run_multitask_and_gets_a_card(tmp_path, tiny_dense):
    sys.path.insert(0, str(ROOT / "examples"))
    import run_multitask

    out = tmp_path / "toy"
    metrics = run_multitask.main(
        [
            "--model_family",
            "toy",
            "--model_name_or_path",
            str(tiny_dense),
            "--output_dir",
            str(out),
            "--max_steps",
            "3",
            "--per_device_train_batch_size",
            "4",
            "--max_train_samples",
            "8",
            "--max_eval_samples",
            "4",
            "--max_seq_length",
            "16",
            "--use_cpu",
            "--disable_tqdm",
            "true",
        ]
    )
    assert "eval_average" in metrics
    model = AutoModel.from_pretrained(out)
    assert type(model) is ToyModel and model.config.task_names[0] == "rotten_tomatoes"
    card = ModelCard.load(out / "README.md")
    assert "a toy: embeddings of size 32, mean-pooled" in card.content
    copied = torch.equal(
        model.embeddings.weight,
        hf_taskmoe.upcycling.load_dense_model(str(tiny_dense)).model.embeddings.word_embeddings.weight,
    )
    assert not copied  # trained three steps away from the dense embeddings it was upcycled from
