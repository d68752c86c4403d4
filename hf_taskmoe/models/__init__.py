"""Model families. Each subpackage holds `configuration_<family>.py` and `modeling_<family>.py`."""

from .bert_taskmoe import BertForTaskMoE, BertTaskMoEConfig, BertTaskMoEModel

# (config class, class registered with AutoModel) of every family; `hf_taskmoe.__init__` registers them.
AUTO_REGISTRY = [
    (BertTaskMoEConfig, BertForTaskMoE),
]

__all__ = ["AUTO_REGISTRY", "BertForTaskMoE", "BertTaskMoEConfig", "BertTaskMoEModel"]
