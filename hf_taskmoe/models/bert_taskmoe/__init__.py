from .configuration_bert_taskmoe import BertTaskMoEConfig
from .modeling_bert_taskmoe import (
    BertForTaskMoE,
    BertTaskMoEModel,
    BertTaskMoEPreTrainedModel,
    TaskMoEEncoderOutput,
    TaskMoEOutput,
)

__all__ = [
    "BertTaskMoEConfig",
    "BertForTaskMoE",
    "BertTaskMoEModel",
    "BertTaskMoEPreTrainedModel",
    "TaskMoEEncoderOutput",
    "TaskMoEOutput",
]
