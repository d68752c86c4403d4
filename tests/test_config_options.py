"""An option a family does not have (misspelt, another family's, a future release's) is refused by name with the
closest valid one, in every config and every `from_dense`; transformers' own config keywords keep passing."""

import dataclasses

import pytest
import transformers
from transformers import AutoConfig, PreTrainedConfig

import hf_taskmoe
from hf_taskmoe import TaskSpec
from hf_taskmoe.models.configuration import transformers_config_keys
from hf_taskmoe.models.registry import FAMILIES

ENCODER_TASKS = [TaskSpec(name="a", num_labels=2), TaskSpec(name="b", problem_type="regression")]

# (config class, misspelt option, the option meant)
MISSPELT = [
    (hf_taskmoe.TaskMoEConfig, "num_expert", "num_experts"),
    (hf_taskmoe.TaskMoEConfig, "gatting", "gating"),
    (hf_taskmoe.BertTaskMoEConfig, "num_expert", "num_experts"),
    (hf_taskmoe.BertTaskMoEConfig, "hiden_size", "hidden_size"),  # a BERT field, taken flat by the BERT config
    (hf_taskmoe.PALsConfig, "pal_sise", "pal_size"),
    (hf_taskmoe.BertPALsConfig, "pal_num_head", "pal_num_heads"),
    (hf_taskmoe.CAMTLBackboneConfig, "conditional_atention", "conditional_attention"),
    (hf_taskmoe.CAMTLConfig, "num_frozen_layer", "num_frozen_layers"),
    (hf_taskmoe.MMoEConfig, "num_expert", "num_experts"),
    (hf_taskmoe.TaskRoutedLMConfig, "selecton", "selection"),
    (hf_taskmoe.TaskRoutedSeq2SeqConfig, "routed_encoder_layer", "routed_encoder_layers"),
    (hf_taskmoe.BartTaskRoutedConfig, "router_typ", "router_type"),
]


@pytest.mark.parametrize("config_class, given, meant", MISSPELT, ids=[f"{c.__name__}-{g}" for c, g, _ in MISSPELT])
def test_a_misspelt_config_option_is_refused_with_the_closest_one(config_class, given, meant):
    with pytest.raises(ValueError) as caught:
        config_class(**{given: 8})
    message = str(caught.value)
    assert f"`{given}` (did you mean `{meant}`?)" in message and config_class.__name__ in message
    assert "\n" not in message


def test_expert_rank_is_refused_where_it_does_not_apply_naming_the_family_that_takes_it():
    """`expert_rank` (low-rank experts) is task-level routing's and MT-TaG's option: every other family refuses it by
    name and says which families take it; theirs keep it."""
    owners = [f for f in FAMILIES.values() if "expert_rank" in {x.name for x in dataclasses.fields(f.config_class)}]
    assert {f.method for f in owners} == {"task-routing", "mt-tag"}
    for family in FAMILIES.values():
        if family in owners:
            assert family.config_class(expert_rank=8).expert_rank == 8
            continue
        with pytest.raises(ValueError, match=r"unknown option\(s\): `expert_rank` is an option of the mt-tag "
                                             r"family .* and of the task-routing family") as caught:
            family.config_class(expert_rank=8)
        assert family.config_class.__name__ in str(caught.value)


@pytest.mark.parametrize("config_class, option, owner", [
    (hf_taskmoe.TaskMoEConfig, "pal_size", "pals"),
    (hf_taskmoe.BertTaskMoEConfig, "conditional_attention", "ca-mtl"),
    (hf_taskmoe.PALsConfig, "gating", "mt-tag"),
    (hf_taskmoe.CAMTLBackboneConfig, "router_type", "task-routing"),
    (hf_taskmoe.TaskRoutedLMConfig, "pal_size", "pals"),
])
def test_another_familys_option_is_refused_naming_the_family_that_takes_it(config_class, option, owner):
    with pytest.raises(ValueError) as caught:
        config_class(**{option: 8})
    assert f"`{option}` is an option of the {owner} family" in str(caught.value)


FROM_DENSE = [
    (hf_taskmoe.TaskMoEForMultiTask, "num_expert", "num_experts"),
    (hf_taskmoe.TaskMoEForMultiTask, "gatting", "gating"),
    (hf_taskmoe.BertForTaskMoE, "expert_weightin", "expert_weighting"),
    (hf_taskmoe.PALsForMultiTask, "pal_sise", "pal_size"),
    (hf_taskmoe.BertWithPALs, "pal_layer", "pal_layers"),
    (hf_taskmoe.CAMTLForMultiTask, "conditional_atention", "conditional_attention"),
    (hf_taskmoe.CAMTLModel, "bottleneck_sise", "bottleneck_size"),
    (hf_taskmoe.TaskRoutedForCausalLM, "num_expert", "num_experts"),
    (hf_taskmoe.TaskRoutedForSeq2SeqLM, "expert_noise_varience", "expert_noise_variance"),  # from_dense's own
    (hf_taskmoe.BartTaskRouted, "hub_kwarg", "hub_kwargs"),
]


@pytest.mark.parametrize("model_class, given, meant", FROM_DENSE, ids=[f"{c.__name__}-{g}" for c, g, _ in FROM_DENSE])
def test_from_dense_refuses_a_misspelt_option_before_loading_anything(tmp_path, model_class, given, meant):
    """The refusal comes first: the checkpoint path does not even exist (loading it would be an OSError)."""
    with pytest.raises(ValueError) as caught:
        model_class.from_dense(tmp_path / "absent", ENCODER_TASKS, **{given: 8})
    message = str(caught.value)
    assert f"{model_class.__name__}.from_dense got unknown option(s): `{given}` (did you mean `{meant}`?)" in message


def test_from_dense_names_the_family_of_another_familys_option(tmp_path):
    with pytest.raises(ValueError, match=r"`pal_size` is an option of the pals family \(`PALsConfig`"):
        hf_taskmoe.TaskMoEForMultiTask.from_dense(tmp_path / "absent", ENCODER_TASKS, pal_size=64)


def test_transformers_config_keywords_pass_and_round_trip(tmp_path):
    """What `PreTrainedConfig` takes (its fields, properties, what it writes to config.json, the generation settings
    it moves away, `auto_map`) passes every family config, and a config saved with them loads back."""
    config = hf_taskmoe.TaskMoEConfig(
        tasks=ENCODER_TASKS, output_hidden_states=True, torch_dtype="float32", id2label={0: "x", 1: "y"},
        problem_type="regression", architectures=["TaskMoEForMultiTask"], _name_or_path="somewhere",
        transformers_version="5.0.0", attn_implementation="eager", experts_implementation="eager",
        max_length=20, num_beams=2, auto_map={"AutoConfig": "x.Y"}, output_attentions=True, return_dict=False,
    )
    assert config.output_hidden_states and config.id2label == {0: "x", 1: "y"} and config.auto_map
    config.save_pretrained(tmp_path)
    for load in (AutoConfig.from_pretrained, hf_taskmoe.TaskMoEConfig.from_pretrained):
        loaded = load(tmp_path, output_attentions=False)
        assert loaded.output_hidden_states and not loaded.output_attentions and loaded.problem_type == "regression"
    for family in FAMILIES.values():  # transformers' whole set passes each family's config (values of its fields)
        family.config_class(output_hidden_states=True, torch_dtype="float32", name_or_path="x", use_cache=False)
    assert {"torch_dtype", "attn_implementation", "name_or_path", "model_type", "max_length",
            "auto_map"} <= transformers_config_keys()
    assert {f for f in PreTrainedConfig().to_dict()} <= transformers_config_keys()


def test_a_saved_config_loads_with_the_attributes_it_was_saved_with(tmp_path):
    """transformers saves every attribute set on a config (its own model tests set the norms' epsilons under every
    name) and loads them back: the check refuses options given when building a config, not what a saved one holds."""
    config = hf_taskmoe.TaskRoutedLMConfig(dense_config=transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=60), tasks=[TaskSpec(name="x", problem_type="seq2seq")])
    config.rms_norm_eps_override = 1.0
    config.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).rms_norm_eps_override == 1.0
    with pytest.raises(ValueError, match=r"`num_expert` \(did you mean `num_experts`\?\)"):
        hf_taskmoe.TaskRoutedLMConfig(num_expert=3)
