"""The MT-TaG names of earlier releases, now thin names on the one implementation (`TaskMoEForMultiTask`):

- `BertTaskMoEConfig` (model type `taskmoe_bert`): a `TaskMoEConfig` that also takes `BertConfig`'s fields flat, as
  the BERT-only class did (`hidden_size=...`, a config.json of an earlier release), and keeps them in `dense_config`,
  a `BertConfig`; read and set through it under the same names. `classifier_pooling` defaults to `"pooler"`.
- `BertForTaskMoE`: `TaskMoEForMultiTask` with that config.
- `BertTaskMoEModel`: the same model whose forward returns the encoder's output (`TaskMoEEncoderOutput`), as the
  bare encoder of the BERT-only class did.
"""

from __future__ import annotations

from transformers import BertConfig

from ...input_checks import check_kwargs
from ..encoder import FlatDenseFields
from .configuration_task_moe import TaskMoEConfig
from .modeling_task_moe import TaskMoEEncoderOutput, TaskMoEForMultiTask

__all__ = ["BertForTaskMoE", "BertTaskMoEConfig", "BertTaskMoEModel"]

class BertTaskMoEConfig(FlatDenseFields, TaskMoEConfig):
    r"""
    `TaskMoEConfig` on BERT under the name of earlier releases (model type `taskmoe_bert`). Every field of `BertConfig`
    is accepted flat (`hidden_size`, `num_hidden_layers`, `hidden_dropout_prob`, ...) and kept in `dense_config` (a
    `BertConfig`); `config.hidden_size` and the others read and set it there. `classifier_pooling` defaults to
    `"pooler"` (BERT's tanh pooler on [CLS]); the other fields are `TaskMoEConfig`'s.
    """

    model_type = "taskmoe_bert"
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
    """MT-TaG on BERT under the name of earlier releases: `TaskMoEForMultiTask` with a `BertTaskMoEConfig`
    (`BertForTaskMoE.from_dense("path/or/repo-of-a-bert", tasks=tasks, num_experts=4)`)."""

    config_class = BertTaskMoEConfig


class BertTaskMoEModel(BertForTaskMoE):
    """The bare encoder's name of earlier releases: `BertForTaskMoE` (heads included, so it loads a saved model
    whole) whose forward returns the encoder's output, a `TaskMoEEncoderOutput` (`last_hidden_state`,
    `pooler_output`, the routing fields), not the heads'."""

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                task_ids=None, output_attentions=None, output_hidden_states=None, output_router_logits=None,
                return_dict=None, **kwargs) -> TaskMoEEncoderOutput | tuple:
        """The encoder's output for these rows (the inputs and flags of `BertForTaskMoE.forward`)."""
        check_kwargs(kwargs, self.forward)
        return self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, task_ids,
                           output_attentions, output_hidden_states, output_router_logits, return_dict=return_dict)
