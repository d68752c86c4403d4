"""transformers' own model tests (`ModelTesterMixin` of its `tests/test_modeling_common.py`) for every method class.

transformers' test files are not in its wheel. The sdist of a release carries `tests/test_modeling_common.py` (and
the other `*_common.py` files) but not the folders it imports from: `tests/generation/` (`GenerationTesterMixin`)
and `tests/exporters/` (`ExportTesterMixin`). `load_model_tester_mixin` imports the sdist's file as a package and,
only so that the import works, puts two stand-ins in `sys.modules` for those submodules (`STAND_INS`):

- `ExportTesterMixin`: an empty base class, so `ModelTesterMixin` gains no export tests (the project's own export
  tests: tests/test_export*.py, tests/test_torch_export.py);
- `GenerationTesterMixin`: an empty class that nothing here inherits. The generation tests are NOT available from
  the sdist and do not run here (the project's own: tests/test_*generation.py, tests/test_task_routed_*.py);
  `test_generation_tester_mixin_inheritance`, which asks a generative class's tester to inherit the real mixin,
  is refused below for that reason.

`HF_TASKMOE_TRANSFORMERS_TESTS` names the unpacked `tests/` folder; it must come from the installed release (the
folder's `../PKG-INFO`, or failing that its parent's name `transformers-<version>`, is checked), otherwise the
suite skips with the reason. `.ci/run` downloads and unpacks it (`pip download transformers==<installed>
--no-binary :all:`); `parameterized` (transformers' test extra) must be importable.

A method takes part with a `Case`: its model class, a tiny config and common inputs (task ids included), and
whether it is an encoder-decoder. A test that cannot apply to a method is refused in `REFUSALS`, with its reason,
in this one place; nothing is skipped silently.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

import hf_taskmoe
from hf_taskmoe import TaskSpec

ENV = "HF_TASKMOE_TRANSFORMERS_TESTS"
PACKAGE = "_transformers_sdist_tests"

# ---------------------------------------------------------------------------------------------------- the import
STAND_INS = {
    "exporters.test_export": {"ExportTesterMixin": "stand-in: the sdist has no tests/exporters/; no export tests"},
    "generation.test_utils": {"GenerationTesterMixin": "stand-in: the sdist has no tests/generation/; no generation "
                              "tests run"},
}


def sdist_version(tests_dir: Path) -> str | None:
    """The release the unpacked `tests/` folder comes from: `Version:` of the sdist's PKG-INFO beside it, else the
    folder name `transformers-<version>` the sdist unpacks to; None when neither says."""
    pkg_info = tests_dir.parent / "PKG-INFO"
    if pkg_info.is_file():
        for line in pkg_info.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    name = tests_dir.resolve().parent.name
    return name.removeprefix("transformers-") if name.startswith("transformers-") else None


def why_not_available() -> str | None:
    """None when the suite can run, else the reason it skips."""
    where = os.environ.get(ENV)
    if not where:
        return f"{ENV} is not set: transformers' own model tests need its sdist's tests/ folder (see .ci/run)"
    tests_dir = Path(where)
    if not (tests_dir / "test_modeling_common.py").is_file():
        return f"{ENV}={where} has no test_modeling_common.py"
    version = sdist_version(tests_dir)
    if version != transformers.__version__:
        found = version or "an unknown release (no PKG-INFO, no transformers-<version> parent)"
        return f"{ENV}={where} comes from transformers {found}, the installed release is {transformers.__version__}"
    if importlib.util.find_spec("parameterized") is None:
        return "transformers' test_modeling_common.py imports `parameterized` (its test extra): not installed"
    return None


def load_model_tester_mixin():
    """transformers' `ModelTesterMixin` from the folder `ENV` names (call `why_not_available` first)."""
    if f"{PACKAGE}.test_modeling_common" in sys.modules:
        return sys.modules[f"{PACKAGE}.test_modeling_common"].ModelTesterMixin
    tests_dir = Path(os.environ[ENV])
    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(tests_dir)]
    sys.modules[PACKAGE] = package
    for dotted, names in STAND_INS.items():
        parent, child = dotted.split(".")
        if not (tests_dir / parent / f"{child}.py").is_file():  # a fuller checkout: the real module is imported
            sys.modules.setdefault(f"{PACKAGE}.{parent}", types.ModuleType(f"{PACKAGE}.{parent}"))
            module = types.ModuleType(f"{PACKAGE}.{dotted}")
            for name, doc in names.items():
                setattr(module, name, type(name, (), {"__doc__": doc}))
            sys.modules[f"{PACKAGE}.{dotted}"] = module
    return importlib.import_module(f"{PACKAGE}.test_modeling_common").ModelTesterMixin


# ---------------------------------------------------------------------------------------------------- the testers
VOCAB = 60
ENCODER_TASKS = [TaskSpec(name="a", num_labels=3), TaskSpec(name="b", problem_type="regression")]
TEXT_TASKS = [TaskSpec(name=n, problem_type="seq2seq") for n in ("x", "y")]
SPECIAL = dict(bos_token_id=2, eos_token_id=3, pad_token_id=0)
_BERT = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, vocab_size=VOCAB,
             max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _bert():
    return transformers.BertConfig(**_BERT)


def _llama():
    return transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=40, **SPECIAL)


def _t5():
    return transformers.T5Config(d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
                                 vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                                 eos_token_id=1)


def _bart():
    return dict(vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=32,
                decoder_ffn_dim=32, encoder_attention_heads=2, decoder_attention_heads=2, max_position_embeddings=40,
                dropout=0.0, attention_dropout=0.0, decoder_start_token_id=2, forced_eos_token_id=None,
                **SPECIAL)


@dataclass
class Case:
    """One method class under transformers' tests: `config()` a tiny config, `inputs` which inputs it reads."""

    name: str
    model_class: type
    config: Callable[[], transformers.PreTrainedConfig]
    inputs: str  # "encoder" | "causal" | "seq2seq" | "tabular"
    is_encoder_decoder: bool = False
    sizes: dict = field(default_factory=lambda: dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2))


CASES: dict[str, Case] = {
    "TaskMoEForMultiTask": Case("TaskMoEForMultiTask", hf_taskmoe.TaskMoEForMultiTask,
                                lambda: hf_taskmoe.TaskMoEConfig(dense_config=_bert(), tasks=ENCODER_TASKS,
                                                                 num_experts=3), "encoder"),
    "PALsForMultiTask": Case("PALsForMultiTask", hf_taskmoe.PALsForMultiTask,
                             lambda: hf_taskmoe.PALsConfig(dense_config=_bert(), tasks=ENCODER_TASKS, pal_size=8,
                                                           pal_num_heads=2), "encoder"),
    "CAMTLForMultiTask": Case("CAMTLForMultiTask", hf_taskmoe.CAMTLForMultiTask,
                              lambda: hf_taskmoe.CAMTLForMultiTask.config_class(
                                  dense_config=_bert(), tasks=ENCODER_TASKS, conditional_attention_max_length=16),
                              "encoder"),
    "TaskRoutedForCausalLM": Case("TaskRoutedForCausalLM", hf_taskmoe.TaskRoutedForCausalLM,
                                  lambda: hf_taskmoe.TaskRoutedLMConfig(dense_config=_llama(), tasks=TEXT_TASKS),
                                  "causal"),
    "TaskRoutedForSeq2SeqLM": Case("TaskRoutedForSeq2SeqLM", hf_taskmoe.TaskRoutedForSeq2SeqLM,
                                   lambda: hf_taskmoe.TaskRoutedSeq2SeqConfig(dense_config=_t5(), tasks=TEXT_TASKS),
                                   "seq2seq", is_encoder_decoder=True),
    "BartTaskRouted": Case("BartTaskRouted", hf_taskmoe.BartTaskRouted,
                           lambda: hf_taskmoe.BartTaskRoutedConfig(tasks=TEXT_TASKS, **_bart()), "seq2seq",
                           is_encoder_decoder=True),
    "BertForTaskMoE": Case("BertForTaskMoE", hf_taskmoe.BertForTaskMoE,
                           lambda: hf_taskmoe.BertTaskMoEConfig(tasks=ENCODER_TASKS, num_experts=3, **_BERT),
                           "encoder"),
    "BertWithPALs": Case("BertWithPALs", hf_taskmoe.BertWithPALs,
                         lambda: hf_taskmoe.BertPALsConfig(tasks=ENCODER_TASKS, pal_size=8, pal_num_heads=2, **_BERT),
                         "encoder"),
    "CAMTLModel": Case("CAMTLModel", hf_taskmoe.CAMTLModel,
                       lambda: hf_taskmoe.CAMTLConfig(tasks=ENCODER_TASKS, conditional_attention_max_length=16,
                                                      **_BERT), "encoder"),
    "MMoEModel": Case("MMoEModel", hf_taskmoe.MMoEModel,
                      lambda: hf_taskmoe.MMoEConfig(
                          tasks=ENCODER_TASKS, numeric_features=["age", "price"], categorical_features=["city"],
                          categorical_cardinalities=[5], embedding_dim=3, num_experts=3, expert_hidden_sizes=[8],
                          tower_hidden_sizes=[4], dropout=0.0), "tabular",
                      sizes=dict(hidden_size=8, num_hidden_layers=1)),
}

#: architectures declared after the first fourteen (issue 57) under the routed classes: decoders of each structural
#: kind (Gemma 2's sandwich norms and sliding layers, OLMo 2's output norms, Qwen3's q/k norms, Phi-3's fused
#: projections, Granite's multipliers, SmolLM3's no-RoPE layers, StableLM's partial rotary, Gemma 3's local and
#: global rotaries, Starcoder2's biased MLP, Cohere's parallel block, GPT-NeoX's fused qkv) and encoder-decoders
#: (UMT5's per-block position tables, mBART's pre-norm BART layers, Pegasus' and Marian's sinusoidal positions);
#: the newer encoders under each encoder method (MT-TaG, PALs, CA-MTL)
NEW_ARCH_CASES = {"gemma2": "causal", "olmo2": "causal", "qwen3": "causal", "phi3": "causal", "granite": "causal",
                  "smollm3": "causal", "stablelm": "causal", "gemma3_text": "causal", "starcoder2": "causal",
                  "cohere": "causal", "gpt_neox": "causal", "umt5": "seq2seq", "mbart": "seq2seq",
                  "pegasus": "seq2seq", "marian": "seq2seq"}
NEW_ENCODER_ARCHS = ("camembert", "data2vec-text", "ernie", "rembert", "xlm-roberta-xl", "mpnet")


def _sizes(arch: str, dense) -> dict:
    from hf_taskmoe.backbones import get_backbone

    declared = get_backbone(arch)
    return {n: declared.config_value(dense, n) for n in ("hidden_size", "num_hidden_layers", "num_attention_heads")}


def _new_arch_case(arch: str, inputs: str) -> Case:
    from .backbone_matrix import NEW_CONFIGS

    model_class = hf_taskmoe.TaskRoutedForCausalLM if inputs == "causal" else hf_taskmoe.TaskRoutedForSeq2SeqLM
    return Case(f"{model_class.__name__}_{arch}", model_class,
                lambda: model_class.config_class(dense_config=NEW_CONFIGS[arch](), tasks=TEXT_TASKS), inputs,
                is_encoder_decoder=inputs == "seq2seq", sizes=_sizes(arch, NEW_CONFIGS[arch]()))


#: each encoder method's extra config arguments (as in its BERT case above)
_ENCODER_METHODS = {
    hf_taskmoe.TaskMoEForMultiTask: dict(num_experts=3),
    hf_taskmoe.PALsForMultiTask: dict(pal_size=8, pal_num_heads=2),
    hf_taskmoe.CAMTLForMultiTask: dict(conditional_attention_max_length=16),
}


def _new_encoder_case(arch: str, model_class: type) -> Case:
    from .backbone_matrix import NEW_CONFIGS

    kwargs = _ENCODER_METHODS[model_class]
    return Case(f"{model_class.__name__}_{arch.replace('-', '_')}", model_class,
                lambda: model_class.config_class(dense_config=NEW_CONFIGS[arch](), tasks=ENCODER_TASKS, **kwargs),
                "encoder", sizes=_sizes(arch, NEW_CONFIGS[arch]()))


CASES.update({case.name: case for case in (_new_arch_case(a, i) for a, i in NEW_ARCH_CASES.items())})


def _falcon_case() -> Case:
    """Falcon is declared low-rank only (whole copies of its layers are refused): its case sets `expert_rank`."""
    from .backbone_matrix import NEW_CONFIGS

    model_class = hf_taskmoe.TaskRoutedForCausalLM
    return Case(f"{model_class.__name__}_falcon", model_class,
                lambda: model_class.config_class(dense_config=NEW_CONFIGS["falcon"](), tasks=TEXT_TASKS,
                                                 expert_rank=4),
                "causal", sizes=_sizes("falcon", NEW_CONFIGS["falcon"]()))


CASES[_falcon_case().name] = _falcon_case()
CASES.update({case.name: case for case in (_new_encoder_case(a, m) for a in NEW_ENCODER_ARCHS
                                           for m in _ENCODER_METHODS)})
NEW_SEQ2SEQ = tuple(name for name, case in CASES.items() if "_" in name and case.is_encoder_decoder)


def _takes_segments(config) -> bool:
    """Whether the encoder reads a second segment: declared so, and a token type table of two entries or more
    (XLM-R-XL's has one, MPNet has none: `token_type_ids` is refused there)."""
    from hf_taskmoe.backbones import get_backbone

    dense = getattr(config, "dense_config", None) or config
    return get_backbone(dense.model_type).segment_ids and getattr(dense, "type_vocab_size", 2) > 1


class ModelTester:
    """The `model_tester` transformers' mixin asks for: sizes and `prepare_config_and_inputs_for_common`."""

    # 7: the batch `test_eager_matches_sdpa_inference` runs; a shorter one it would extend with random ids < 5, task
    # ids out of range for 2 tasks
    batch_size = 7
    seq_length = 7
    decoder_seq_length = 5  # the mixin reads `key_length` as the encoder's (cross-attention keys)
    encoder_seq_length = 7
    key_length = 7
    is_training = True
    vocab_size = VOCAB

    def __init__(self, parent, case: Case):
        self.parent, self.case = parent, case
        for name, value in case.sizes.items():
            setattr(self, name, value)

    def get_config(self):
        return self.case.config()

    def prepare_config_and_inputs_for_common(self):
        config = self.get_config()
        g = torch.Generator().manual_seed(0)
        n, seq = self.batch_size, self.seq_length
        task_ids = torch.arange(n) % config.num_tasks
        if self.case.inputs == "tabular":
            return config, {"numeric_features": torch.randn(n, 2, generator=g),
                            "categorical_features": torch.randint(0, 5, (n, 1), generator=g)}
        inputs = {"input_ids": torch.randint(4, VOCAB, (n, seq), generator=g),
                  "attention_mask": torch.ones(n, seq, dtype=torch.long), "task_ids": task_ids}
        inputs["attention_mask"][0, -2:] = 0
        if self.case.inputs == "encoder" and _takes_segments(config):
            inputs["token_type_ids"] = (torch.arange(seq) >= seq // 2).long().expand(n, seq).clone()
        elif self.case.inputs == "seq2seq":
            inputs["decoder_input_ids"] = torch.randint(4, VOCAB, (n, self.decoder_seq_length), generator=g)
        return config, inputs

    def labels(self, config, inputs: dict) -> torch.Tensor:
        """Targets in the format each method reads: one per row in its task's format (encoders), one token per
        position (causal and text-to-text LMs), one column per task (MMoE)."""
        g = torch.Generator().manual_seed(1)
        n = self.batch_size
        if self.case.inputs == "tabular":
            return torch.stack([torch.randint(0, s.num_labels, (n,), generator=g).float()
                                if s.problem_type != "regression" else torch.randn(n, generator=g)
                                for s in config.task_specs], 1)
        if self.case.inputs == "encoder":
            specs = [config.task_specs[t] for t in inputs["task_ids"].tolist()]
            return torch.tensor([float(torch.randint(0, s.num_labels, (1,), generator=g))
                                 if s.problem_type != "regression" else float(torch.randn(1, generator=g))
                                 for s in specs])
        length = self.decoder_seq_length if self.case.inputs == "seq2seq" else self.seq_length
        return torch.randint(4, VOCAB, (n, length), generator=g)


# ---------------------------------------------------------------------------------------------------- the refusals
ALL = "*"
ENCODERS = ("TaskMoEForMultiTask", "PALsForMultiTask", "CAMTLForMultiTask", "BertForTaskMoE", "BertWithPALs",
            "CAMTLModel", *(name for name, case in CASES.items() if "_" in name and case.inputs == "encoder"))

ROUTED = ("TaskRoutedForCausalLM", "TaskRoutedForSeq2SeqLM", "BartTaskRouted",
          *(name for name, case in CASES.items() if "_" in name and case.inputs != "encoder"))
_EXACT_LOAD = ("hf_taskmoe's from_pretrained is exact by design: a checkpoint on file that lacks weights its "
               "config.json describes is refused with a ValueError naming them, not loaded with them random "
               "(tests/family_tester.py::test_a_weights_file_missing_extra_or_misshaped_task_tensors_is_refused_"
               "naming_them); ignore_mismatched_sizes=True opts in to transformers' behaviour")
_TASK_LOGITS = ("the first output, `logits`, is a dict task name -> tensor (each task its own width: classes, one "
                "regression value); the mixin reads `outputs[0]` as one tensor. Determinism and gradients of the "
                "task outputs: tests/family_tester.py")
_MIXED_ATTENTIONS = ("a routed layer reports its experts' attention probabilities weighted by the routing weights "
                     "and scattered back to their rows (hf_taskmoe/layers/routing.py, RoutedLayer.run_plan): a new "
                     "tensor the logits do not depend on, so it gets no gradient; the hidden states do")
_TABULAR = ("MMoE is a tabular model: its forward takes numeric and categorical features, it has no token "
            "embeddings to get, set or resize and no attention or layer stack whose states it could report "
            "(output_attentions / output_hidden_states are refused by name); its gates: `output_gates`")

_MPNET = tuple(f"{method.__name__}_mpnet" for method in _ENCODER_METHODS)
_MPNET_NO_CHECKPOINTING = ("transformers' MPNet has no activation checkpointing (MPNetPreTrainedModel."
                           "supports_gradient_checkpointing is False, its layers are no GradientCheckpointingLayer), "
                           "so gradient_checkpointing_enable on a method built on it raises transformers' ValueError; "
                           "the method class declares support for the backbones that have it")
_MPNET_REFUSED = {test: {name: _MPNET_NO_CHECKPOINTING for name in _MPNET} for test in (
    "test_gradient_checkpointing_backward_compatibility", "test_gradient_checkpointing_enable_disable",
    "test_peft_gradient_checkpointing_enable_disable", "test_training_gradient_checkpointing",
    "test_training_gradient_checkpointing_use_reentrant_false")}
# this one passes on CA-MTL over MPNet (HF_TASKMOE_TRANSFORMERS_CASES=CAMTLForMultiTask_mpnet): refused for the others
_MPNET_REFUSED["test_enable_input_require_grads_with_gradient_checkpointing"] = {
    name: _MPNET_NO_CHECKPOINTING for name in _MPNET[:2]}

#: test name -> {case name or ALL: why it cannot apply}. The one place a test is refused.
REFUSALS: dict[str, dict[str, str]] = {
    **_MPNET_REFUSED,
    "test_generation_tester_mixin_inheritance": {
        ALL: "the generation mixin is not in transformers' sdist (tests/generation/ is left out), so no tester can "
             "inherit it; the routed classes' generation is tested by tests/test_*generation.py",
    },
    "test_model_weights_reload_no_missing_tied_weights": {ALL: _EXACT_LOAD + " (the test replaces every weight on "
                                                               "file by a placeholder)"},
    "test_correct_missing_keys": {
        ALL: _EXACT_LOAD + " (the test saves the bare base model and loads the task model from it, without its "
             "tasks; a dense checkpoint becomes a task model through `from_dense`)",
    },
    **{test: {"MMoEModel": _TABULAR} for test in ("test_hidden_states_output",
                                                  "test_model_outputs_equivalence", "test_model_get_set_embeddings",
                                                  "test_resize_tokens_embeddings")},
    "test_training_gradient_checkpointing_use_reentrant_true": {
        name: "a backbone-generic encoder's layers read the batch's task ids from a context that the recomputation "
              "restores through torch.utils.checkpoint's `context_fn`, which only the non-reentrant checkpoint has: "
              "use_reentrant=True is refused with a ValueError saying so (hf_taskmoe.backbones.base.TaskContext."
              "checkpoint_kwargs); the default and use_reentrant=False run (the BERT-named classes are these "
              "classes under their earlier names)"
        for name in ENCODERS
    } | {
        "TaskRoutedForCausalLM_falcon": "low-rank experts (`expert_rank`, which Falcon needs) read the batch's "
        "routing decisions from a context that the recomputation restores through torch.utils.checkpoint's "
        "`context_fn`, which only the non-reentrant checkpoint has: use_reentrant=True is refused with a ValueError "
        "saying so (hf_taskmoe.backbones.base.TaskContext.checkpoint_kwargs); the default and use_reentrant=False run",
    },
    "test_bc_cache_name_forward": {
        "TaskRoutedForCausalLM_falcon": "with low-rank experts the routed model returns the dense model's own "
        "DynamicCache (one copy of each layer), so the test goes on to build `DynamicCache(config=config."
        "get_text_config(decoder=True))` from the wrapper's TaskRoutedLMConfig, which holds the layer count in its "
        "`dense_config` (`config.dense_config.num_hidden_layers`), not as `num_hidden_layers`; a DynamicCache built "
        "from `config.dense_config` is taken as `past_key_values`",
    },
    "test_attention_outputs": {
        name: "the output carries `task_ids` (the family contract: every family's output echoes the rows' task "
              "ids), one field more than the count of Seq2SeqLMOutput fields the test asserts (7 != 6) after it "
              "checked the encoder's attentions; the decoder's and cross-attentions per layer: tests/test_families.py "
              "(bart_routed) and tests/test_task_routed_t5.py"
        for name in ("TaskRoutedForSeq2SeqLM", "BartTaskRouted", *NEW_SEQ2SEQ)
    } | {"MMoEModel": _TABULAR},
    "test_save_load_keys_to_ignore_on_save": {
        "TaskRoutedForSeq2SeqLM_marian": "Marian leaves its sinusoidal position tables out of the file "
        "(`_keys_to_ignore_on_save`, which the routed model inherits, prefixed); the test then expects the "
        "state dict loaded back to miss those keys and the wrapper's own `_tied_weights_keys` only, but the tied "
        "embeddings and lm_head are declared by the dense model inside (the wrapper's `all_tied_weights_keys`: "
        "backbone.lm_head.weight and the embeddings -> backbone.model.shared.weight), so they are missing too and "
        "tied again on load; Marian's save / load round trip: tests/test_backbones_new.py (family contract, -m slow)",
    },
    "test_determinism": {name: _TASK_LOGITS for name in (*ENCODERS, "MMoEModel")},
    "test_retain_grad_hidden_states_attentions": {
        **{name: _TASK_LOGITS for name in (*ENCODERS, "MMoEModel")},
        **{name: _MIXED_ATTENTIONS for name in ROUTED},
    },
}


def refusal(test_name: str, case_name: str) -> str | None:
    reasons = REFUSALS.get(test_name, {})
    return reasons.get(case_name) or reasons.get(ALL)


def test_classes(mixin) -> dict[str, type]:
    """One `unittest.TestCase` per case, transformers' mixin first; refused tests replaced by a skip with the
    reason."""
    import unittest

    classes = {}
    for name, case in CASES.items():
        def setUp(self, case=case):  # noqa: N802 (unittest's name)
            self.model_tester = ModelTester(self, case)

        def _prepare_for_class(self, inputs_dict, model_class, return_labels=False, mixin=mixin):
            # transformers' own testers override this too: its labels come from its Auto mappings, ours per method
            inputs = mixin._prepare_for_class(self, inputs_dict, model_class, return_labels=False)
            if return_labels:
                inputs["labels"] = self.model_tester.labels(self.model_tester.get_config(), inputs)
            return inputs

        body = {
            "_prepare_for_class": _prepare_for_class,
            # the inputs besides `input_ids` that tests building their own batch (eager vs sdpa) must pass on
            "additional_model_inputs": ["task_ids", "token_type_ids", "numeric_features", "categorical_features"],
            "all_model_classes": (case.model_class,),
            "is_encoder_decoder": case.is_encoder_decoder,
            # the mixin skips this test for models whose config file predates 2023 (no copyright year here)
            "test_can_init_all_missing_weights_before_2023": True,
            "setUp": setUp,
            "__module__": __name__,
        }
        for test_name in dir(mixin):
            if test_name.startswith("test_") and (reason := refusal(test_name, name)):
                def refused(self, reason=reason):
                    self.skipTest(reason)
                refused.__name__ = test_name
                body[test_name] = refused
        classes[f"Test{name}"] = type(f"Test{name}", (mixin, unittest.TestCase), body)
    return classes
