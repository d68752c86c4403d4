"""hf_taskmoe: multi-task learning for Hugging Face Transformers.

Importing the package registers every family (`hf_taskmoe.models.registry`): its config with `AutoConfig` and
its model with `AutoModel` (the seq2seq models also with `AutoModelForSeq2SeqLM`), and the pipelines, so
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

#: what a user types: the papers' classes and each family's generic ones, tasks, upcycling, the Trainer, export and
#: analysis, and what an extension declares (a family, a backbone); the rest is in the submodules
_EXPORTS: dict[str, tuple[str, ...]] = {
    ".models": ("FAMILIES", "Family", "register_family"),
    ".backbones": ("Backbone", "FFNSite", "register_backbone"),
    ".tasks": ("TaskSpec", "parse_tasks"),
    ".models.task_moe": ("BertTaskMoEConfig", "BertForTaskMoE", "TaskMoEConfig", "TaskMoEForMultiTask"),
    ".models.pals": ("BertPALsConfig", "BertWithPALs", "PALsConfig", "PALsForMultiTask"),
    ".models.camtl": ("CAMTLConfig", "CAMTLModel", "CAMTLBackboneConfig", "CAMTLForMultiTask"),
    ".models.mmoe": ("MMoEConfig", "MMoEModel"),
    ".models.task_routing": ("BartTaskRoutedConfig", "BartTaskRouted", "TaskRoutedLMConfig", "TaskRoutedForCausalLM",
                             "TaskRoutedSeq2SeqConfig", "TaskRoutedForSeq2SeqLM", "bart_from_bert"),
    ".upcycling": ("upcycle",),
    ".training": ("MultiTaskTrainer", "MultiTaskTrainingArguments"),
    ".onnx_export": ("export_onnx", "export_program"),
    ".lora_export": ("export_task_adapters",),
    ".analysis": ("parameter_report", "RoutingStatistics"),
    ".pipelines": ("MultiTaskTextClassificationPipeline", "MultiTaskText2TextGenerationPipeline"),
}

__all__ = [name for names in _EXPORTS.values() for name in names]

__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
