"""`CAMTLModel` / `CAMTLConfig`: the paper's names (CA-MTL on BERT), a variant of the CA-MTL family
(`CAMTLForMultiTask` with a BERT default), not a family of its own. The config has the family's `model_type`, so a
saved `CAMTLModel` is a saved `CAMTLForMultiTask` (`AutoModel` loads it as one, the same numbers)."""

from __future__ import annotations

from transformers import BertConfig

from ..encoder import FlatDenseFields
from .configuration_camtl import CAMTLBackboneConfig
from .modeling_camtl import CAMTLForMultiTask


class CAMTLConfig(FlatDenseFields, CAMTLBackboneConfig):
    r"""
    `CAMTLBackboneConfig` on a BERT, with `classifier_pooling="pooler"` (BERT's pooler) as the default pooling. A BERT's
    fields are also taken flat (`CAMTLConfig(hidden_size=384, ..., tasks=...)`): they make `dense_config` (a
    `BertConfig`), or set its fields beside an explicit `dense_config`; they read and write through flat
    (`config.pad_token_id` is `dense_config`'s). It saves `dense_config` nested, as `CAMTLBackboneConfig` does.
    """

    method_name = "CA-MTL (CAMTLModel)"
    flat_dense_class = BertConfig

    classifier_pooling: str = "pooler"


class CAMTLModel(CAMTLForMultiTask):
    """CA-MTL on BERT: `CAMTLForMultiTask` with a `CAMTLConfig`. Build one from a dense BERT with
    `CAMTLModel.from_dense("path/or/repo-of-a-bert", tasks=tasks)`; train it with `MultiTaskTrainer(...,
    args=MultiTaskTrainingArguments(task_sampling="uncertainty"))` for the paper's MT-Uncertainty sampling."""

    config_class = CAMTLConfig
