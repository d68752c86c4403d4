"""hf_taskmoe: multi-task learning for Hugging Face Transformers.

Importing the package registers every family (`hf_taskmoe.models.registry`): its config with `AutoConfig` and
its model with `AutoModel` (BartTaskRouted also with `AutoModelForSeq2SeqLM`), so `AutoModel.from_pretrained(<a
saved hf_taskmoe model>)` works like for any built-in model.
"""

from .analysis import ParameterReport, RoutingStatistics, parameter_report
from .layers.heads import MultiTaskHeads
from .layers.moe import TaskMoE
from .modeling_utils import MultiTaskModelOutput
from .models import FAMILIES, Family, family_of, get_family, register_family  # importing registers every family
from .models.bart_task_routed import BartTaskRouted, BartTaskRoutedConfig, bart_from_bert
from .models.bert_pals import BertPALsConfig, BertPALsModel, BertWithPALs
from .models.bert_taskmoe import BertForTaskMoE, BertTaskMoEConfig, BertTaskMoEModel
from .models.camtl import CAMTLBertModel, CAMTLConfig, CAMTLModel
from .models.mmoe import MMoEConfig, MMoEModel
from .models.bert_taskmoe import TaskMoEOutput
from .pipelines import (  # registers the pipelines
    PIPELINE_TASK,
    TEXT2TEXT_PIPELINE_TASK,
    MultiTaskText2TextGenerationPipeline,
    MultiTaskTextClassificationPipeline,
)
from .tasks import PROBLEM_TYPES, TaskSpec, parse_tasks
from .upcycling import UpcyclingReport, upcycle

__version__ = "0.1.0"

__all__ = [
    "FAMILIES",
    "Family",
    "family_of",
    "get_family",
    "register_family",
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
    "CAMTLBertModel",
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
