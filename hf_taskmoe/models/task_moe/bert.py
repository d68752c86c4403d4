"""`BertForTaskMoE` / `BertTaskMoEConfig`: the paper's names (MT-TaG on BERT / MiniLM), a variant of the MT-TaG family
(`TaskMoEForMultiTask` with a BERT default), not a family of its own. The config has the family's `model_type`, so a
saved `BertForTaskMoE` is a saved `TaskMoEForMultiTask` (`AutoModel` loads it as one, the same numbers)."""

from __future__ import annotations

from transformers import BertConfig

from ..encoder import FlatDenseFields
from .configuration_task_moe import TaskMoEConfig
from .modeling_task_moe import TaskMoEForMultiTask


class BertTaskMoEConfig(FlatDenseFields, TaskMoEConfig):
    r"""
    `TaskMoEConfig` on a BERT: `BertConfig`'s fields are also taken flat (`hidden_size`, `num_hidden_layers`, ...) and
    kept in `dense_config` (a `BertConfig`); `config.hidden_size` and the others read and set it there.
    `classifier_pooling` defaults to `"pooler"` (BERT's tanh pooler on [CLS]); the other fields are `TaskMoEConfig`'s.
    """

    flat_dense_class = BertConfig
    method_name = "MT-TaG (BertForTaskMoE)"

    classifier_pooling: str = "pooler"

    @classmethod
    def from_dense_config(cls, dense_config, tasks, **kwargs):
        """Like `TaskMoEConfig.from_dense_config`, for a BERT config only (other encoders: `TaskMoEConfig`)."""
        found = getattr(dense_config, "model_type", None)
        if found != "bert":
            raise ValueError(
                f"{cls.__name__} starts from BERT checkpoints (model_type 'bert', MiniLM included), got model_type "
                f"{found!r}; TaskMoEForMultiTask takes every declared encoder."
            )
        return super().from_dense_config(dense_config, tasks, **kwargs)


class BertForTaskMoE(TaskMoEForMultiTask):
    """MT-TaG on BERT: `TaskMoEForMultiTask` with a `BertTaskMoEConfig`
    (`BertForTaskMoE.from_dense("path/or/repo-of-a-bert", tasks=tasks, num_experts=4)`)."""

    config_class = BertTaskMoEConfig
