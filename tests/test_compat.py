"""Canaries: each test names one transformers seam hf_taskmoe relies on and fails, naming it, when an upstream release
changes it (`hf_taskmoe/compat.py` lists them). Then the behaviour those seams carry for BartTaskRouted: generation
hands the cache under the installed release's name, a static cache is refused by name, outputs of generate."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from transformers import GenerationMixin, Pipeline, PreTrainedModel, Trainer
from transformers.modeling_outputs import Seq2SeqLMOutput

from hf_taskmoe import compat
from hf_taskmoe.layers.routing import RoutedCache

from .test_bart_routed import batch, routed


def test_canary_generation_hands_the_cache_under_compat_cache_arg():
    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    assert compat.CACHE_ARG in params, (
        f"GenerationMixin.prepare_inputs_for_generation no longer takes `{compat.CACHE_ARG}`: update compat.CACHE_ARG"
    )
    assert compat.CACHE_ARG in Seq2SeqLMOutput.__dataclass_fields__, (
        f"Seq2SeqLMOutput has no field `{compat.CACHE_ARG}`: update compat.output_cache"
    )


def test_canary_trainer_prepare_inputs_still_exists():
    assert callable(getattr(Trainer, "_prepare_inputs", None)), (
        "Trainer._prepare_inputs is gone: MultiTaskTrainer.prediction_step calls it to move a batch to the device"
    )


@pytest.mark.parametrize("hook", ["_sanitize_parameters", "_forward", "preprocess", "postprocess"])
def test_canary_pipeline_extension_points(hook):
    assert callable(getattr(Pipeline, hook, None)), f"Pipeline.{hook} is gone: hf_taskmoe.pipelines implements it"


@pytest.mark.parametrize("flag", ["_load_tokenizer", "_load_feature_extractor", "_load_image_processor",
                                  "_load_processor", "_pipeline_calls_generate"])
def test_canary_pipeline_class_flags(flag):
    assert flag in vars(Pipeline) or any(flag in vars(c) for c in Pipeline.__mro__), (
        f"Pipeline.{flag} is gone: hf_taskmoe.pipelines sets it on its pipelines"
    )


def test_pop_cache_takes_either_name_once_without_a_warning():
    cache = RoutedCache()
    assert compat.pop_cache({"cache": cache}) is cache
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation warning of ours under either name
        assert compat.pop_cache({"past_key_values": cache}) is cache
        with pytest.raises(ValueError, match="once"):
            compat.pop_cache({"cache": cache, "past_key_values": RoutedCache()})


def test_forward_returns_a_routed_cache_under_the_installed_name_and_continues_from_it():
    model = routed("gumbel_softmax_st")
    b = batch()
    full = torch.randint(3, 60, (6, 4))
    with torch.no_grad():
        whole = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], task_ids=b["task_ids"],
                      decoder_input_ids=full, use_cache=True)
        cache = compat.output_cache(whole)
        assert isinstance(cache, RoutedCache)
        first = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], task_ids=b["task_ids"],
                      decoder_input_ids=full[:, :3], use_cache=True)
        step = model(encoder_outputs=(first.encoder_last_hidden_state,), attention_mask=b["attention_mask"],
                     task_ids=b["task_ids"], decoder_input_ids=full[:, 3:], use_cache=True,
                     **{compat.CACHE_ARG: compat.output_cache(first)})
    torch.testing.assert_close(step.logits[:, -1], whole.logits[:, -1], atol=1e-5, rtol=1e-5)


def test_a_static_cache_is_refused_by_name():
    model = routed("gumbel_softmax_st")
    b = batch()
    with pytest.raises(ValueError, match="static cache"):
        model.generate(b["input_ids"], attention_mask=b["attention_mask"], task_ids=b["task_ids"], max_new_tokens=3,
                       cache_implementation="static")


def test_generate_returns_scores_hidden_states_and_attentions_per_step():
    model = routed("gumbel_softmax_st")
    model.set_attn_implementation("eager")
    b = batch()
    out = model.generate(b["input_ids"], attention_mask=b["attention_mask"], task_ids=b["task_ids"], max_new_tokens=3,
                         min_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_scores=True,
                         output_hidden_states=True, output_attentions=True)
    layers = model.config.encoder_layers
    assert len(out.encoder_hidden_states) == layers + 1 and len(out.encoder_attentions) == layers
    assert len(out.scores) == 3 and len(out.decoder_hidden_states) == 3
    for step in out.decoder_attentions:
        assert len(step) == model.config.decoder_layers and step[0].shape[0] == 6
    plain = model.generate(b["input_ids"], attention_mask=b["attention_mask"], task_ids=b["task_ids"], max_new_tokens=3,
                           min_new_tokens=3, do_sample=False)
    assert torch.equal(out.sequences, plain)


def test_last_decoder_hidden_state_gives_the_logits():
    model = routed("softmax")
    b = batch()
    with torch.no_grad():
        out = model(**b, output_hidden_states=True)
    expected = model.backbone.lm_head(out.decoder_hidden_states[-1]) + model.backbone.final_logits_bias
    torch.testing.assert_close(out.logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["num_beams", "num_return_sequences", "max_new_tokens"])
def test_generation_counts_below_one_are_refused_by_name(name):
    model = routed("gumbel_softmax_st")
    b = batch()
    with pytest.raises(ValueError, match=f"`{name}` must be a positive integer"):
        model.generate(b["input_ids"], task_ids=b["task_ids"], **{name: 0})


def test_canary_activation_checkpointing_takes_checkpoint_keywords_first():
    """hf_taskmoe.compat.CHECKPOINTING_ENABLE: the public method that turns activation checkpointing on, whose first
    parameter is the keywords handed to torch.utils.checkpoint (the task models pass a `context_fn` through it)."""
    import inspect

    from transformers import PreTrainedModel

    from hf_taskmoe.compat import CHECKPOINTING_ENABLE

    params = list(inspect.signature(getattr(PreTrainedModel, CHECKPOINTING_ENABLE)).parameters)
    assert params[1] in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"), params


def test_task_routed_t5_is_refused_by_name_where_the_t5_block_differs():
    """compat.T5_BLOCK_RETURNS_BIASES: where T5Block returns a tuple of varying length (transformers 5.10.4, the floor)
    TaskRoutedForSeq2SeqLM refuses to build, naming the upgrade; where it returns the 3-tuple it builds."""
    from transformers import T5Config

    from hf_taskmoe import TaskSpec
    from hf_taskmoe.compat import T5_BLOCK_RETURNS_BIASES
    from hf_taskmoe.models.task_routing import TaskRoutedForSeq2SeqLM, TaskRoutedSeq2SeqConfig

    config = TaskRoutedSeq2SeqConfig(
        dense_config=T5Config(vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
                              num_heads=2, decoder_start_token_id=0),
        tasks=[TaskSpec(name="x", problem_type="seq2seq")], num_experts=2,
    )
    if T5_BLOCK_RETURNS_BIASES:
        assert isinstance(TaskRoutedForSeq2SeqLM(config), TaskRoutedForSeq2SeqLM)
    else:
        with pytest.raises(NotImplementedError, match="upgrade transformers"):
            TaskRoutedForSeq2SeqLM(config)


def test_canary_is_exporting_is_false_under_compile_and_true_under_export():
    """`compat.is_exporting` reads `torch.compiler._is_exporting_flag` (dynamo folds the public function to True under
    torch.compile before torch 2.12): False in eager code and under torch.compile, True under torch.export."""
    from hf_taskmoe.compat import is_exporting

    class Probe(torch.nn.Module):
        def forward(self, x):
            return x + 1 if is_exporting() else x - 1

    x = torch.zeros(2)
    assert Probe()(x).tolist() == [-1.0, -1.0]
    assert torch.compile(Probe(), fullgraph=True, backend="eager")(x).tolist() == [-1.0, -1.0]
    assert torch.export.export(Probe(), (x,)).module()(x).tolist() == [1.0, 1.0]


def test_canary_accelerate_fsdp_state_attributes():
    """`compat.enable_fsdp_on_cpu` sets `state.distributed_type` and `state.fsdp_plugin`; accelerate's FSDP2 path
    must still read exactly these (`AcceleratorState.is_fsdp2`) and still leave FSDP off on `MULTI_CPU` (else the
    switch is no longer needed)."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    if not hasattr(AcceleratorState, "is_fsdp2"):  # accelerate 1.5.2, the floor: no FSDP2 at all, nothing to switch on
        pytest.skip("this accelerate has no FSDP2 (AcceleratorState.is_fsdp2); FSDP2 training needs a newer one")
    source = inspect.getsource(AcceleratorState.is_fsdp2.fget)
    assert "distributed_type" in source and "DistributedType.FSDP" in source and "fsdp_plugin" in source
    init = inspect.getsource(AcceleratorState.__init__)
    assert "self.fsdp_plugin = fsdp_plugin" in init and "DistributedType.MULTI_GPU" in init
    assert DistributedType.MULTI_CPU in list(DistributedType)


def test_canary_initialize_weights_step_marks_the_module():
    """`compat.initialize_module_tree` runs transformers' per-module step (`PreTrainedModel._initialize_weights`) and
    reads the mark it sets (`compat.is_initialized`): a marked module is passed over, `again=True` clears the mark
    and initialises it (and marks it again)."""
    from transformers import BertConfig, BertModel

    assert callable(getattr(PreTrainedModel, "_initialize_weights", None))
    model = BertModel(BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=8))
    linear = model.pooler.dense
    assert compat.is_initialized(linear)  # post_init's pass marked it
    with torch.no_grad():
        linear.weight.fill_(7.0)
    compat.initialize_module_tree(model, model.pooler)
    assert (linear.weight == 7.0).all()
    compat.initialize_module_tree(model, model.pooler, again=True)
    assert not (linear.weight == 7.0).any() and compat.is_initialized(linear)


def test_canary_experts_implementation_settable_by_class():
    """transformers decides whether `experts_implementation` may be set from `_can_set_experts_implementation` (the
    decorator's text in the model class's module), and keeps the choice in `_experts_implementation_internal` behind
    the `_experts_implementation` property, whose setter copies it into sub-configs (`compat.experts_class_elsewhere`,
    `compat.own_experts_implementation`)."""
    from transformers import PretrainedConfig, PreTrainedModel

    assert isinstance(inspect.getattr_static(PreTrainedModel, "_can_set_experts_implementation"), classmethod)
    assert isinstance(inspect.getattr_static(PretrainedConfig, "_experts_implementation"), property)
    config = PretrainedConfig(experts_implementation="batched_mm")
    assert config._experts_implementation_internal == "batched_mm"
    assert "_experts_implementation_internal" not in config.to_dict()


def test_canary_transformers_grouped_mm_fallback_op():
    """`torch.ops.transformers.grouped_mm_fallback(input, weight, offs)`: each group's rows times its weight, traced by
    torch.compile with fullgraph in fp32 (its fake kernel)."""
    from hf_taskmoe.compat import grouped_mm_fallback_op

    op = grouped_mm_fallback_op()
    x, w = torch.randn(5, 3), torch.randn(2, 3, 4)
    ends = torch.tensor([2, 5], dtype=torch.int32)
    expected = torch.cat([x[:2] @ w[0], x[2:] @ w[1]])
    torch.testing.assert_close(op(x, w, ends), expected)
    torch.testing.assert_close(torch.compile(op, fullgraph=True, backend="aot_eager")(x, w, ends), expected)
