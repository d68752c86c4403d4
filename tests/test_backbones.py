"""The backbone layer (`hf_taskmoe.backbones`) and MT-TaG on every declared encoder architecture.

Each architecture's declaration must point at real modules of transformers' model (an upstream rename fails here
by name), and `TaskMoEForMultiTask` keeps the family contract on each: dense equivalence at initialisation, save /
load through the Auto classes, mixed-task batches, learning a few examples, bf16."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hf_taskmoe
from hf_taskmoe import TaskMoEConfig, TaskMoEForMultiTask
from hf_taskmoe.backbones import ENCODER_BACKBONE, backbone_names, get_backbone
from hf_taskmoe.models import family_for

from .backbone_matrix import ENCODER_ARCHS, NEW_ARCHS, TASKS, dense_config, dense_model, method_cases, token_batch
from .family_tester import FamilyContract


def test_every_declared_encoder_is_in_the_test_matrix():
    """The first seven here, every later one in `test_backbones_new.py` (`NEW_CONFIGS`)."""
    later = [arch for arch in NEW_ARCHS if get_backbone(arch).kind == ENCODER_BACKBONE]
    assert sorted(ENCODER_ARCHS + later) == backbone_names(ENCODER_BACKBONE)


@pytest.mark.parametrize("arch", ENCODER_ARCHS)
def test_declared_paths_are_the_architectures_modules(arch):
    backbone = get_backbone(arch)
    model = dense_model(arch)
    layers = backbone.layer_list(model)
    assert isinstance(layers, nn.ModuleList) and len(layers) == backbone.config_value(model.config,
                                                                                     "num_hidden_layers")
    layer = layers[0]
    site = backbone.ffn
    assert isinstance(layer.get_submodule(site.module), nn.Module)
    if site.split:
        assert isinstance(layer.get_submodule(site.w_in), nn.Linear)
        assert isinstance(layer.get_submodule(site.w_out), nn.Linear)
    assert isinstance(layer.get_submodule(backbone.attention), nn.Module)
    assert isinstance(layer.get_submodule(backbone.attention_output), nn.Linear)
    for norm in backbone.norms:
        assert isinstance(layers[-1].get_submodule(norm), nn.LayerNorm), norm
    assert isinstance(model.get_submodule(backbone.embeddings), nn.Module)
    if backbone.pooler:
        assert isinstance(model.get_submodule(backbone.pooler), nn.Module)


def test_an_undeclared_architecture_is_refused_listing_the_declared_ones():
    import transformers

    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=60)
    with pytest.raises(ValueError, match=r"does not support model_type 'gpt2'; supported encoder backbones: \["):
        TaskMoEConfig(dense_config=config, tasks=TASKS)


def test_family_for_picks_the_family_that_takes_the_checkpoint():
    assert family_for("bert_taskmoe", "bert").model_class.__name__ == "BertForTaskMoE"  # the family's BERT variant
    assert family_for("bert_taskmoe", "roberta").model_class is TaskMoEForMultiTask
    assert family_for("taskmoe", "bert").name == family_for("bert_taskmoe", "roberta").name == "taskmoe"
    assert family_for("mt-tag", "modernbert").name == "taskmoe"
    with pytest.raises(ValueError, match="cannot be built from a 'gpt2' checkpoint; it supports the model types"):
        family_for("bert_taskmoe", "gpt2")


@pytest.mark.parametrize("arch", ENCODER_ARCHS)
def test_upcycling_report_names_what_was_copied_and_what_is_new(arch):
    dense = dense_model(arch)
    model, report = TaskMoEForMultiTask.from_dense(dense, TASKS, num_experts=3, output_loading_info=True)
    experts = [name for name in report.copied if ".experts." in name]
    assert experts and all(".experts." not in report.copied[name] for name in experts)  # each from the dense FFN
    dense_state, state = dense.state_dict(), model.state_dict()
    for name in experts:  # every expert (a slice of a stacked weight, or a whole module's copy) is that weight
        assert torch.equal(state[name], dense_state[report.copied[name]].expand_as(state[name])), name
    split = get_backbone(arch).ffn.split
    assert all(state[name].shape[0] == 3 for name in experts) if split else any(".experts.2." in n for n in experts)
    assert {name for name in report.new if ".router." in name} and all(
        n.startswith("heads.") or ".router." in n for n in report.new)
    assert model.config.upcycled_from and model.config.dense_config.model_type == arch


@pytest.mark.parametrize("arch", ["roberta", "modernbert"])
def test_grouped_mm_is_refused_for_a_whole_module_ffn_and_equal_for_a_split_one(arch):
    if not get_backbone(arch).ffn.split:
        with pytest.raises(ValueError, match="use 'taskmoe_auto'"):
            TaskMoEForMultiTask(TaskMoEConfig(dense_config=dense_config(arch), tasks=TASKS,
                                              experts_implementation="grouped_mm"))
        return
    dense = dense_model(arch)
    loop = TaskMoEForMultiTask.from_dense(dense, TASKS, num_experts=2).eval()
    grouped = TaskMoEForMultiTask.from_dense(dense, TASKS, num_experts=2, experts_implementation="grouped_mm").eval()
    grouped.load_state_dict(loop.state_dict())
    batch = token_batch(arch, 60, torch.tensor([0, 1, 1]))
    with torch.no_grad():
        torch.testing.assert_close(grouped(**batch).task_logits["a"], loop(**batch).task_logits["a"])


def test_routing_is_reported_per_moe_layer():
    model = TaskMoEForMultiTask.from_dense(dense_model("modernbert"), TASKS, num_experts=3, moe_layers=[1]).eval()
    batch = token_batch("modernbert", 60, torch.tensor([0, 1, 0]))
    with torch.no_grad():
        out = model(**batch, output_router_logits=True)
    assert len(out.router_logits) == 1 and out.routing_counts.shape == (1, 2, 3)
    assert int(out.routing_counts.sum()) == int(batch["attention_mask"].sum())  # every real token, once


CASES = method_cases("mt-tag", TaskMoEForMultiTask, TaskMoEConfig, config_kwargs={"num_experts": 3})


@pytest.fixture(params=list(CASES), ids=list(CASES))
def case(request):
    return CASES[request.param]


class TestMTTaGOnEveryEncoder(FamilyContract):
    @pytest.fixture(autouse=True)
    def _case(self, case):
        self.case = case


def test_the_generic_family_is_registered():
    assert hf_taskmoe.FAMILIES["taskmoe"].model_class is TaskMoEForMultiTask


@pytest.mark.parametrize("arch", ["roberta", "modernbert"])
def test_activation_checkpointing_restores_the_task_ids_of_each_recomputed_layer(arch):
    """Checkpointed layers run again in the backward pass, after the forward emptied the model's TaskContext: each
    gets back the task ids it first ran with, also when two forwards (other task mixes) precede one backward."""
    import copy

    from hf_taskmoe.compat import CHECKPOINTING_ENABLE

    from .backbone_matrix import labelled_batch

    model = TaskMoEForMultiTask.from_dense(dense_model(arch), TASKS, num_experts=3).train()
    plain = copy.deepcopy(model)
    getattr(model, CHECKPOINTING_ENABLE)()
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    first = labelled_batch(model, torch.tensor([0, 1, 0, 1]))
    second = labelled_batch(model, torch.tensor([1, 1, 1, 0]), seed=3)
    for m in (model, plain):
        (m(**first).loss + m(**second).loss).backward()
    expected = dict(plain.named_parameters())
    for name, param in model.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(param.grad, expected[name].grad, atol=1e-6, rtol=1e-5, msg=name)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        getattr(model, CHECKPOINTING_ENABLE)({"use_reentrant": True})
