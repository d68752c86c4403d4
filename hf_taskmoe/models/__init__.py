"""Model families. Each subpackage holds `configuration_<family>.py` and `modeling_<family>.py`."""

from .bart_task_routed import BartTaskRouted, BartTaskRoutedConfig, TaskRoutedSeq2SeqOutput
from .bart_task_routed.bart_from_bert import bart_from_bert
from .bert_pals import BertPALsConfig, BertPALsModel, BertWithPALs
from .camtl import CAMTLBertModel, CAMTLConfig, CAMTLModel
from .bert_taskmoe import BertForTaskMoE, BertTaskMoEConfig, BertTaskMoEModel
from .mmoe import MMoEConfig, MMoEModel

# (config class, class registered with AutoModel) of every family; `hf_taskmoe.__init__` registers them.
AUTO_REGISTRY = [
    (BertTaskMoEConfig, BertForTaskMoE),
    (BertPALsConfig, BertWithPALs),
    (MMoEConfig, MMoEModel),
    (CAMTLConfig, CAMTLModel),
    (BartTaskRoutedConfig, BartTaskRouted),
]

# family name (`run_multitask.py --model_family`) -> model class with `from_dense(dense, tasks, **config_kwargs)`
MODEL_FAMILIES = {
    "bert_taskmoe": BertForTaskMoE,
    "bert_pals": BertWithPALs,
    "camtl": CAMTLModel,
    "bart_routed": BartTaskRouted,
}

__all__ = [
    "AUTO_REGISTRY",
    "BartTaskRouted",
    "BartTaskRoutedConfig",
    "TaskRoutedSeq2SeqOutput",
    "bart_from_bert",
    "MODEL_FAMILIES",
    "BertPALsConfig",
    "BertPALsModel",
    "BertWithPALs",
    "CAMTLBertModel",
    "CAMTLConfig",
    "CAMTLModel",
    "MMoEConfig",
    "MMoEModel",
    "BertForTaskMoE", "BertTaskMoEConfig", "BertTaskMoEModel"]
