"""`BertWithPALs`, `BertPALsConfig`, `BertPALsModel`: the names of the BERT-specific PALs class of earlier releases,
kept for their users and their saved checkpoints. Each is `PALsForMultiTask` / `PALsConfig` with a BERT default:

- `BertPALsConfig` keeps the `model_type` (`"taskmoe_bert_pals"`) and the old defaults (`classifier_pooling="pooler"`),
  and takes BERT's fields flat, as the old config did (`BertPALsConfig(hidden_size=..., tasks=...)`, a saved
  config.json of that layout): they become its `dense_config`, a `BertConfig`, and read and write through to it.
  Saved again, it writes the new layout (`dense_config` nested), which it reads as well.
- `BertWithPALs` loads a checkpoint of the old layout (the encoder under `bert.`, the PALs under `bert.pals.`) by
  renaming its weights on load (`checkpoint_key_mapping`, passed to transformers' `from_pretrained(key_mapping=)`),
  through its own `from_pretrained` and through `AutoModel`. The map leaves names of the new layout as they are, so a
  model saved now (new layout) loads again.
- `BertPALsModel`, the old bare encoder, is `BertWithPALs` returning the encoder's output (`last_hidden_state`,
  `pooler_output`, `hidden_states`, `attentions`) instead of the heads'.
"""

from __future__ import annotations

from typing import ClassVar

from transformers import BertConfig

from ...input_checks import check_kwargs
from ..encoder import FlatDenseFields
from .configuration_pals import PALsConfig
from .modeling_pals import PALsForMultiTask

#: the old layout's weight names -> the new layout's (transformers' `key_mapping`: regexes, applied in turn)
BERT_PALS_KEY_MAPPING = {
    r"^bert\.pals\.": "pals.",  # the PALs, a module of the old encoder, are the model's own
    r"^bert\.": "backbone.",  # BERT's embeddings, layers and pooler: transformers' BertModel under `backbone.`
}


class BertPALsConfig(FlatDenseFields, PALsConfig):
    r"""
    The config of `BertWithPALs`: `PALsConfig` on a BERT (`dense_config`, a `BertConfig`), with the `model_type`
    and defaults of the earlier BERT-specific config. Every field of `BertConfig` is accepted flat, as before
    (`BertPALsConfig(vocab_size=..., hidden_size=..., tasks=..., pal_size=...)`), and read and written through to
    `dense_config`; the PAL fields are `PALsConfig`'s.

    Args:
        classifier_pooling (`str`, *optional*, defaults to `"pooler"`):
            What the heads read: BERT's tanh pooler on [CLS] (`"pooler"`), the [CLS] state (`"cls"`) or the mean
            over real tokens (`"mean"`).
    """

    model_type = "taskmoe_bert_pals"
    dense_config_default: ClassVar[str] = "bert"
    flat_dense_class = BertConfig

    classifier_pooling: str = "pooler"


class BertWithPALs(PALsForMultiTask):
    """BERT + Projected Attention Layers (Stickland & Murray 2019) with one head per task: `PALsForMultiTask` on a
    BERT, under the name and `model_type` of earlier releases, whose checkpoints it loads (see
    `hf_taskmoe.models.pals.legacy`). Built as `PALsForMultiTask` is (its example), from a BERT:
    `BertWithPALs.from_dense("path/or/repo-of-a-bert", tasks=tasks, pal_size=204, pal_task_groups=[["qqp", "sts"]])`.
    """

    config_class = BertPALsConfig
    #: weight names of the earlier layout -> this class's (applied on load; names of this layout match none)
    checkpoint_key_mapping: ClassVar[dict[str, str]] = BERT_PALS_KEY_MAPPING


class BertPALsModel(BertWithPALs):
    """The encoder of `BertWithPALs` (its old bare encoder's name): the same model, whose forward returns what the
    heads would read -- `last_hidden_state` `(batch, seq, hidden)`, `pooler_output` `(batch, hidden)` (by
    `classifier_pooling`), and `hidden_states` / `attentions` when asked -- for rows of any task (`task_ids`)."""

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                task_ids=None, output_attentions=None, output_hidden_states=None, return_dict=None, **kwargs):
        check_kwargs(kwargs, self.forward)
        return self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, task_ids,
                           output_attentions, output_hidden_states, return_dict=return_dict, **kwargs)
