"""hf_taskmoe: multi-task learning for Hugging Face Transformers.

Importing the package registers every family (`hf_taskmoe.models.registry`): its config with `AutoConfig` and
its model with `AutoModel` (BartTaskRouted also with `AutoModelForSeq2SeqLM`), and the pipelines, so
`AutoModel.from_pretrained(<a saved hf_taskmoe model>)` works like for any built-in model. The other public names
(`__all__`) load on first use (PEP 562 `__getattr__`), so analysis, training and their dependencies are not
imported until asked for.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"


def _lazy_exports(package: str, table: dict[str, tuple[str, ...]]):
    """`__getattr__` and `__dir__` for a package whose public names live in its submodules: `table` maps a
    submodule (relative to `package`) to the names it exports; each is imported on first access and kept."""
    where = {name: module for module, names in table.items() for name in names}

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name], package), name)
        setattr(importlib.import_module(package), name, value)  # the next access is a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(where))

    return __getattr__, __dir__


# Registration is a side effect of these two imports, so they stay eager: `models` registers every family with
# AutoConfig / AutoModel, `pipelines` registers the pipelines (noqa: imported for that effect, below the helper).
from . import models, pipelines  # noqa: E402, F401

_EXPORTS: dict[str, tuple[str, ...]] = {
    ".models": ("FAMILIES", "Family", "family_for", "family_of", "get_family", "register_family"),
    ".backbones": ("Backbone", "FFNSite", "backbone_names", "register_backbone"),
    ".tasks": ("PROBLEM_TYPES", "TaskSpec", "parse_tasks"),
    ".models.task_moe": ("BertTaskMoEConfig", "BertForTaskMoE", "BertTaskMoEModel", "TaskMoEOutput", "TaskMoEConfig",
                         "TaskMoEForMultiTask"),
    ".models.pals": ("PALsConfig", "PALsForMultiTask"),
    ".models.pals.legacy": ("BertPALsConfig", "BertWithPALs", "BertPALsModel"),
    ".models.camtl": ("CAMTLBackboneConfig", "CAMTLBertModel", "CAMTLConfig", "CAMTLForMultiTask", "CAMTLModel"),
    ".models.mmoe": ("MMoEConfig", "MMoEModel"),
    ".models.task_routing": ("TaskRoutedLMConfig", "TaskRoutedForCausalLM", "TaskRoutedSeq2SeqConfig",
                             "TaskRoutedForSeq2SeqLM", "BartTaskRoutedConfig", "BartTaskRouted", "bart_from_bert"),
    ".modeling_utils": ("MultiTaskModelOutput",),
    ".layers.heads": ("MultiTaskHeads",),
    ".layers.moe": ("TaskMoE",),
    ".upcycling": ("UpcyclingReport", "upcycle"),
    ".onnx_export": ("export_onnx",),
    ".lora_export": ("export_task_adapters",),
    ".analysis": ("ParameterReport", "parameter_report", "RoutingStatistics"),
    ".pipelines": ("PIPELINE_TASK", "MultiTaskTextClassificationPipeline", "MultiTaskText2TextGenerationPipeline",
                   "TEXT2TEXT_PIPELINE_TASK"),
}

__all__ = [name for names in _EXPORTS.values() for name in names]

__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
