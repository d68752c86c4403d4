"""Configuration of `CAMTLForMultiTask`: CA-MTL on any declared encoder."""

from __future__ import annotations

from ..backbone_encoder import BackboneTaskConfig
from ..camtl.configuration_camtl import AttentionBlocksSaved, CAMTLConfig, validate_camtl_fields

__all__ = ["ATTENTION_IMPLEMENTATIONS_WITH_BIAS", "CAMTLBackboneConfig", "check_attention_implementation"]

#: attention implementations that add a float attention mask to the scores (conditional attention's seam)
ATTENTION_IMPLEMENTATIONS_WITH_BIAS = ("eager", "sdpa")


def check_attention_implementation(implementation: str | None, model_type: str) -> None:
    """Refuse an attention implementation that takes no additive float mask (flash attention, flex attention's block
    masks, kernels) while conditional attention is on, naming the alternatives."""
    if implementation is None or implementation in ATTENTION_IMPLEMENTATIONS_WITH_BIAS:
        return
    raise ValueError(
        f"CA-MTL's conditional attention adds each task's block-diagonal matrix M(z) to the attention scores as an "
        f"additive float mask; the {implementation!r} attention implementation of this {model_type} model takes no "
        f"such mask. Use attn_implementation='sdpa' or 'eager' (model.set_attn_implementation('sdpa')), or build "
        "CA-MTL with `conditional_attention=False` (alignment, conditional layer norm and bottleneck still work)."
    )


class CAMTLBackboneConfig(AttentionBlocksSaved, BackboneTaskConfig):
    r"""
    Configuration of CA-MTL (Pilault et al. 2021) on a dense encoder of any declared architecture (RoBERTa, XLM-R,
    ELECTRA, DistilBERT, DeBERTa-v2/v3, ModernBERT, BERT: `hf_taskmoe.backbones.backbone_names("encoder")`): the
    upper layers are modulated by a learned embedding `z_t` of each task. The fields of `BackboneTaskConfig`
    (`dense_config`, `tasks`, `classifier_pooling`, ...) and CA-MTL's own, which mean what they mean in `CAMTLConfig`:

    Args:
        task_embedding_dim (`int`, *optional*): size of `z_t`; defaults to the hidden size.
        num_frozen_layers (`int`, *optional*): bottom layers whose dense weights are frozen; defaults to half.
        freeze_embeddings (`bool`, *optional*, defaults to `True`): freeze the dense model's embeddings module.
        conditional_layers (`list[int]`, *optional*): layers with conditional attention and CLN; defaults to the
            layers above the frozen ones.
        conditional_attention (`bool`, *optional*, defaults to `True`): add the task's block-diagonal `M(z)` to the
            attention scores of the conditional layers. Needs an architecture whose attention takes an additive mask
            (not DeBERTa-v2/v3: `Backbone.attention_bias`) and the `"eager"` or `"sdpa"` attention implementation.
        conditional_attention_max_length (`int`, *optional*, defaults to 128): the longest input `L` it covers.
        conditional_attention_blocks (`int`, *optional*): number `N` of diagonal blocks (default `hidden // L`,
            raised to `ceil(L / 64)` where a block would be longer than 64; saved with the config).
        conditional_attention_init_std (`float`, *optional*): std of the blocks `A_n` (default `initializer_range`);
            0 makes a fresh model compute exactly the dense model.
        conditional_alignment (`bool`, *optional*, defaults to `True`): the task-conditioned alignment between the
            embeddings and the first layer (eq. 2), starting as the identity.
        conditional_layer_norm (`bool`, *optional*, defaults to `True`): the declared LayerNorms of each conditional
            layer become Conditional Layer Norms (eq. 3), starting as the dense LayerNorms.
        conditional_bottleneck (`str`, *optional*, defaults to `"base"`): `"base"` (in parallel with the FFN of
            `bottleneck_layers`, default the top layer), `"large"` (a skip connection alongside every layer) or
            `"none"`; its up-projection starts at zero.
        bottleneck_size (`int`, *optional*): width of the bottleneck; defaults to `hidden_size // 3`.
        bottleneck_layers (`list[int]`, *optional*): layers with a `"base"` bottleneck; defaults to the top layer.
    """

    model_type = "taskmoe_camtl_any"
    method_name = "CA-MTL (CAMTLForMultiTask)"

    task_embedding_dim: int | None = None
    num_frozen_layers: int | None = None
    freeze_embeddings: bool = True
    conditional_layers: list | None = None
    conditional_attention: bool = True
    conditional_attention_max_length: int = 128
    conditional_attention_blocks: int | None = None
    conditional_attention_init_std: float | None = None
    conditional_alignment: bool = True
    conditional_layer_norm: bool = True
    conditional_bottleneck: str = "base"
    bottleneck_size: int | None = None
    bottleneck_layers: list | None = None

    # the BERT family's views, one definition (they read only the fields above and the dense sizes)
    task_dim = CAMTLConfig.task_dim
    frozen_layers = CAMTLConfig.frozen_layers
    conditional_layer_indices = CAMTLConfig.conditional_layer_indices
    bottleneck_layer_indices = CAMTLConfig.bottleneck_layer_indices
    attention_blocks = CAMTLConfig.attention_blocks
    uses_task_embedding = CAMTLConfig.uses_task_embedding

    def _validate(self) -> None:
        super()._validate()
        validate_camtl_fields(self)
        if self.uses_conditional_attention:
            backbone = self.backbone
            if not backbone.attention_bias:
                raise ValueError(
                    f"`conditional_attention=True` cannot be built on a {backbone.model_type} model: "
                    f"{backbone.why_no_bias}"
                )
            # asked for on this config (`attn_implementation=`, propagated to the dense one) or on the dense config
            implementation = getattr(self, "_attn_implementation_internal", None) or getattr(
                self.dense_config, "_attn_implementation_internal", None
            )
            check_attention_implementation(implementation, backbone.model_type)

    @property
    def uses_conditional_attention(self) -> bool:
        """Whether some layer adds `M(z)` to its attention scores."""
        return self.conditional_attention and bool(self.conditional_layer_indices)
