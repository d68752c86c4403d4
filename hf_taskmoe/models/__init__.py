"""Model families. Each subpackage holds `configuration_<family>.py` and `modeling_<family>.py`."""

from .bert_pals import BertPALsConfig, BertPALsModel, BertWithPALs
from .bert_taskmoe import BertForTaskMoE, BertTaskMoEConfig, BertTaskMoEModel
from .mmoe import MMoEConfig, MMoEModel

# (config class, class registered with AutoModel) of every family; `hf_taskmoe.__init__` registers them.
AUTO_REGISTRY = [
    (BertTaskMoEConfig, BertForTaskMoE),
    (BertPALsConfig, BertWithPALs),
    (MMoEConfig, MMoEModel),
]

# family name (`run_multitask.py --model_family`) -> model class with `from_dense(dense, tasks, **config_kwargs)`
MODEL_FAMILIES = {
    "bert_taskmoe": BertForTaskMoE,
    "bert_pals": BertWithPALs,
}

__all__ = [
    "AUTO_REGISTRY",
    "MODEL_FAMILIES",
    "BertPALsConfig",
    "BertPALsModel",
    "BertWithPALs",
    "MMoEConfig",
    "MMoEModel",
    "BertForTaskMoE", "BertTaskMoEConfig", "BertTaskMoEModel"]
