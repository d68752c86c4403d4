"""`BertWithPALs` / `BertPALsConfig`: the paper's names (PALs on BERT), a variant of the PALs family
(`PALsForMultiTask` with a BERT default), not a family of its own. The config has the family's `model_type`, so a saved
`BertWithPALs` is a saved `PALsForMultiTask` (`AutoModel` loads it as one, the same numbers)."""

from __future__ import annotations

from transformers import BertConfig

from ..encoder import FlatDenseFields
from .configuration_pals import PALsConfig
from .modeling_pals import PALsForMultiTask


class BertPALsConfig(FlatDenseFields, PALsConfig):
    r"""
    `PALsConfig` on a BERT (`dense_config`, a `BertConfig`). Every field of `BertConfig` is also taken flat
    (`BertPALsConfig(vocab_size=..., hidden_size=..., tasks=..., pal_size=...)`), and read and written through to
    `dense_config`; the PAL fields are `PALsConfig`'s.

    Args:
        classifier_pooling (`str`, *optional*, defaults to `"pooler"`):
            What the heads read: BERT's tanh pooler on [CLS] (`"pooler"`), the [CLS] state (`"cls"`) or the mean
            over real tokens (`"mean"`).
    """

    flat_dense_class = BertConfig

    classifier_pooling: str = "pooler"


class BertWithPALs(PALsForMultiTask):
    """BERT + Projected Attention Layers (Stickland & Murray 2019) with one head per task: `PALsForMultiTask` with a
    `BertPALsConfig`, built as it is, from a BERT:
    `BertWithPALs.from_dense("path/or/repo-of-a-bert", tasks=tasks, pal_size=204, pal_task_groups=[["qqp", "sts"]])`.
    """

    config_class = BertPALsConfig
