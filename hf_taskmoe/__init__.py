"""hf_taskmoe: multi-task learning for Hugging Face Transformers.

Importing the package registers every family's config with `AutoConfig` and its model with `AutoModel`
(BartTaskRouted also with `AutoModelForSeq2SeqLM`), so `AutoModel.from_pretrained(<a saved hf_taskmoe
model>)` works like for any built-in model.
"""

from transformers import AutoConfig

from .analysis import ParameterReport, RoutingStatistics, parameter_report
from .layers.heads import MultiTaskHeads
from .layers.moe import TaskMoE
from .modeling_utils import MultiTaskModelOutput
from .models import (
    AUTO_REGISTRY,
    BartTaskRouted,
    BartTaskRoutedConfig,
    BertForTaskMoE,
    BertPALsConfig,
    BertPALsModel,
    BertTaskMoEConfig,
    BertTaskMoEModel,
    BertWithPALs,
    CAMTLConfig,
    CAMTLModel,
    MMoEConfig,
    MMoEModel,
    bart_from_bert,
)
from .models.bert_taskmoe import TaskMoEOutput
from .tasks import PROBLEM_TYPES, TaskSpec, parse_tasks
from .upcycling import UpcyclingReport, upcycle

__version__ = "0.1.0"


def _register_auto_classes() -> None:
    import transformers

    for config_cls, model_cls in AUTO_REGISTRY:
        if not config_cls.model_type.startswith("taskmoe_"):
            raise ValueError(f"model_type {config_cls.model_type!r} must start with 'taskmoe_'.")
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        for auto in getattr(model_cls, "auto_classes", ("AutoModel",)):  # e.g. BartTaskRouted: also Seq2SeqLM
            getattr(transformers, auto).register(config_cls, model_cls, exist_ok=True)


_register_auto_classes()

from .pipelines import (  # noqa: E402  (registers the pipelines)
    PIPELINE_TASK,
    TEXT2TEXT_PIPELINE_TASK,
    MultiTaskText2TextGenerationPipeline,
    MultiTaskTextClassificationPipeline,
)

__all__ = [
    "PROBLEM_TYPES",
    "TaskSpec",
    "parse_tasks",
    "BertTaskMoEConfig",
    "BertForTaskMoE",
    "BertTaskMoEModel",
    "TaskMoEOutput",
    "BertPALsConfig",
    "BertWithPALs",
    "BertPALsModel",
    "CAMTLConfig",
    "CAMTLModel",
    "MMoEConfig",
    "MMoEModel",
    "BartTaskRoutedConfig",
    "BartTaskRouted",
    "bart_from_bert",
    "MultiTaskModelOutput",
    "MultiTaskHeads",
    "TaskMoE",
    "UpcyclingReport",
    "upcycle",
    "ParameterReport",
    "parameter_report",
    "RoutingStatistics",
    "PIPELINE_TASK",
    "MultiTaskTextClassificationPipeline",
    "MultiTaskText2TextGenerationPipeline",
    "TEXT2TEXT_PIPELINE_TASK",
]
