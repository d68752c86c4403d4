"""Configuration of `PALsForMultiTask`: Projected Attention Layers on any declared encoder."""

from __future__ import annotations

from ...utils import check_choice, check_float, check_int
from ..backbone_encoder import BackboneTaskConfig
from ..bert_pals.configuration_bert_pals import PAL_DECODER_INITS, PAL_DISPATCHES, BertPALsConfig

__all__ = ["PAL_SITES", "PALsConfig"]

#: where a PAL's output joins the layer (`PALsConfig.pal_site`)
PAL_SITES = ("ffn", "attention")


class PALsConfig(BackboneTaskConfig):
    r"""
    Configuration of a dense encoder of any declared architecture (RoBERTa, XLM-R, ELECTRA, DistilBERT, DeBERTa-v2/v3,
    ModernBERT, BERT: `hf_taskmoe.backbones.backbone_names("encoder")`) with task-specific Projected Attention Layers
    (PALs paper, section 3.2) beside its layers, plus one head per task. The fields of `BackboneTaskConfig`
    (`dense_config`, `tasks`, `classifier_pooling`, ...) and the PAL fields of `BertPALsConfig`, under the same names
    and with the same meaning:

    Args:
        pal_size (`int`, *optional*, defaults to 204): the projected dimension `s`.
        pal_num_heads (`int`, *optional*, defaults to 12): attention heads of each PAL; must divide `pal_size`.
        pal_layers (`list[int]`, *optional*): layers that carry PALs (default: every layer); `E_t` / `D_t` are shared
            by them.
        pal_task_groups (`list[list[str]]`, *optional*): groups of task names sharing one set of PALs (section 3.4);
            a task in no group has PALs of its own.
        pal_decoder_init (`str`, *optional*, defaults to `"zeros"`): `"zeros"` (`D_t = 0`: the model built by
            `from_dense` computes exactly the dense model) or `"normal"` (`N(0, initializer_range)`).
        pal_attention_dropout (`float`, *optional*): dropout on the PALs' attention probabilities; defaults to the
            dense model's attention dropout (`attention_probs_dropout_prob`, DistilBERT's and ModernBERT's
            `attention_dropout`).
        pal_dispatch (`str`, *optional*, defaults to `"auto"`): how an eager forward runs a batch mixing PAL groups,
            `"per_group"`, `"batched"` or `"auto"` (per-group on a CPU, batched on an accelerator and under
            `torch.compile`), as `BertPALsConfig.pal_dispatch`; the numbers are the same either way.
        pal_site (`str`, *optional*, defaults to `"ffn"`): where `GELU(PAL_{l,t}(x))` joins the layer.
            `"ffn"`: the paper's eq. 7, beside the feed-forward block -- in a post-norm layer (BERT, RoBERTa, XLM-R,
            ELECTRA, DeBERTa-v2, DistilBERT) it is added inside the second layer norm,
            `LN_2(MHN(x) + FFN(MHN(x)) + g(PAL(x)))`; in a pre-norm layer (ModernBERT) it is added to the FFN's
            output, so the layer computes `h + FFN(LN(h)) + g(PAL(x))` with `h = x + Attn(LN(x))`. `"attention"`:
            beside the attention's output projection (`Backbone.attention_output`), `LN_1(x + SA(x) + g(PAL(x)))`
            in a post-norm layer (not the paper's place; the FFN then reads the PAL's contribution), added to the
            attention branch in a pre-norm one; the PAL output passes through the dropout the architecture applies
            after that projection.
    """

    model_type = "taskmoe_pals"
    method_name = "PALs (PALsForMultiTask)"

    pal_size: int = 204
    pal_num_heads: int = 12
    pal_layers: list | None = None
    pal_task_groups: list | None = None
    pal_decoder_init: str = "zeros"
    pal_attention_dropout: float | None = None
    pal_site: str = "ffn"
    pal_dispatch: str = "auto"

    def _validate(self) -> None:
        super()._validate()
        check_int(self.pal_size, "pal_size", minimum=1)
        check_int(self.pal_num_heads, "pal_num_heads", minimum=1)
        if self.pal_size % self.pal_num_heads:
            raise ValueError(
                f"`pal_size` ({self.pal_size}) must be a multiple of `pal_num_heads` ({self.pal_num_heads})."
            )
        check_choice(self.pal_decoder_init, PAL_DECODER_INITS, "pal_decoder_init")
        check_choice(self.pal_site, PAL_SITES, "pal_site")
        check_choice(self.pal_dispatch, PAL_DISPATCHES, "pal_dispatch")
        if self.pal_attention_dropout is not None:
            check_float(self.pal_attention_dropout, "pal_attention_dropout", minimum=0.0, maximum=1.0)
        self.pal_layers = self._check_layer_list("pal_layers")
        if self.pal_task_groups is not None:
            self.pal_task_groups = self._check_groups(self.pal_task_groups)

    @property
    def pal_attention_dropout_rate(self) -> float:
        """`pal_attention_dropout`, or the dense model's attention dropout when unset (0 where it has none)."""
        if self.pal_attention_dropout is not None:
            return self.pal_attention_dropout
        for name in ("attention_probs_dropout_prob", "attention_dropout"):  # BERT-like; DistilBERT, ModernBERT
            rate = getattr(self.dense_config, name, None)
            if rate is not None:
                return float(rate)
        return 0.0

    # the task groups, the PAL layers and the per-group count mean what they mean on BERT: one definition
    _check_groups = BertPALsConfig._check_groups
    pal_layer_indices = BertPALsConfig.pal_layer_indices
    task_group_ids = BertPALsConfig.task_group_ids
    pal_groups = BertPALsConfig.pal_groups
    pal_parameters_per_group = BertPALsConfig.pal_parameters_per_group
