"""Configuration of CA-MTL (Pilault et al. 2021): `CAMTLBackboneConfig` on any declared encoder (`CAMTLConfig`, its
BERT variant, is in `bert.py`)."""

from __future__ import annotations

import math

from ...utils import check_choice, check_float, check_int
from ..encoder import TaskEncoderConfig

__all__ = [
    "ATTENTION_IMPLEMENTATIONS_WITH_BIAS", "BOTTLENECK_PLACEMENTS", "MAX_ATTENTION_BLOCK", "CAMTLBackboneConfig",
    "check_attention_implementation", "default_attention_blocks",
]

BOTTLENECK_PLACEMENTS = ("none", "base", "large")

#: attention implementations that add a float attention mask to the scores (conditional attention's seam)
ATTENTION_IMPLEMENTATIONS_WITH_BIAS = ("eager", "sdpa")

#: the largest diagonal block `L / N` of conditional attention by default. The paper's N = d / L makes the block
#: L^2 / d, and the FiLM maps R^d -> R^(block^2) grow with its square (L^4 / d^2): BERT-base at L = 512 would be one
#: 512 x 512 block and 2.4 billion FiLM parameters. 64 is the largest block of the paper's own settings (BERT-large,
#: d = 1024, at L = 256); beyond it N grows with L instead, so the block, and the FiLM, stay this size.
MAX_ATTENTION_BLOCK = 64


def default_attention_blocks(hidden_size: int, max_length: int) -> int:
    """The number `N` of diagonal blocks when `conditional_attention_blocks` is not set: the paper's `N = d / L`
    (at least 1), raised where needed so that no block is longer than `MAX_ATTENTION_BLOCK`."""
    return max(1, hidden_size // max_length, math.ceil(max_length / MAX_ATTENTION_BLOCK))


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


class CAMTLBackboneConfig(TaskEncoderConfig):
    r"""
    Configuration of CA-MTL (Pilault et al. 2021, section 2.1) on a dense encoder of any declared architecture (BERT,
    RoBERTa, XLM-R, ELECTRA, DistilBERT, DeBERTa-v2/v3, ModernBERT: `hf_taskmoe.backbones.backbone_names("encoder")`):
    the upper layers are modulated by a learned embedding `z_t` of each task, with one head per task. The fields of
    `TaskEncoderConfig` (`dense_config`, `tasks`, `classifier_pooling`, ...) and CA-MTL's own (each component has a
    switch, for the paper's Table 1 ablation):

    Args:
        task_embedding_dim (`int`, *optional*):
            Size of the task embeddings `z_t`; defaults to the hidden size (the paper's `z in R^d`).
        num_frozen_layers (`int`, *optional*):
            The bottom layers whose dense weights are frozen; defaults to half the layers (appendix A.8). 0 trains
            every layer.
        freeze_embeddings (`bool`, *optional*, defaults to `True`):
            Freeze the dense model's embeddings module (the paper freezes it with the bottom layers).
        conditional_layers (`list[int]`, *optional*):
            Layers modulated by the task embedding (conditional attention and CLN); defaults to the layers above the
            frozen ones (Figure 1).
        conditional_attention (`bool`, *optional*, defaults to `True`):
            Add the block-diagonal task matrix `M(z)` to the attention scores of the conditional layers. Needs an
            architecture whose attention takes an additive mask (not DeBERTa-v2/v3: `Backbone.attention_bias`) and the
            `"eager"` or `"sdpa"` attention implementation.
        conditional_attention_max_length (`int`, *optional*, defaults to 128):
            The longest sequence `L` conditional attention covers (the paper's sequence length).
        conditional_attention_blocks (`int`, *optional*):
            Number `N` of diagonal blocks of size `ceil(L / N)`; defaults to the paper's `N = d / L` (at least 1),
            raised to `ceil(L / 64)` where that block would be longer than 64 (`MAX_ATTENTION_BLOCK`: the FiLM maps
            grow with the block's square). Saved with the config.
        conditional_attention_init_std (`float`, *optional*):
            Standard deviation of the random blocks `A_n`; defaults to `initializer_range`. 0 makes a fresh model
            compute exactly the dense model.
        conditional_alignment (`bool`, *optional*, defaults to `True`):
            Task-conditioned alignment matrix between the embeddings and the first layer (eq. 2), starting as the
            identity.
        conditional_layer_norm (`bool`, *optional*, defaults to `True`):
            The declared LayerNorms of each conditional layer become Conditional Layer Norms (eq. 3), which start as
            the dense LayerNorms.
        conditional_bottleneck (`str`, *optional*, defaults to `"base"`):
            `"base"`: a conditional bottleneck in parallel with the FFN of `bottleneck_layers` (default: the top
            layer), its output added to the FFN's after the FFN's dropout, so both enter the layer's (conditional)
            norm (Figure 3a). `"large"`: a skip connection alongside every layer, `s_j = CFF_j(h_j + s_{j-1})`, added
            to the last layer's output (Figure 3b). `"none"`: no bottleneck. Its up-projection starts at zero.
        bottleneck_size (`int`, *optional*):
            Width of the bottleneck; defaults to `hidden_size // 3`.
        bottleneck_layers (`list[int]`, *optional*):
            Layers with a `"base"` bottleneck; defaults to the top layer.
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

    def _validate(self) -> None:
        super()._validate()
        if self.task_embedding_dim is not None:
            check_int(self.task_embedding_dim, "task_embedding_dim", minimum=1)
        if self.num_frozen_layers is not None:
            check_int(self.num_frozen_layers, "num_frozen_layers", 0, self.num_hidden_layers)
        for name in ("freeze_embeddings", "conditional_attention", "conditional_alignment", "conditional_layer_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be a bool, got {getattr(self, name)!r}.")
        check_int(self.conditional_attention_max_length, "conditional_attention_max_length", minimum=1)
        if self.conditional_attention_blocks is not None:
            check_int(self.conditional_attention_blocks, "conditional_attention_blocks", 1,
                      self.conditional_attention_max_length)
        if self.conditional_attention_init_std is not None:
            check_float(self.conditional_attention_init_std, "conditional_attention_init_std", minimum=0.0)
        check_choice(self.conditional_bottleneck, BOTTLENECK_PLACEMENTS, "conditional_bottleneck")
        if self.bottleneck_size is not None:
            check_int(self.bottleneck_size, "bottleneck_size", minimum=1)
        self.conditional_layers = self._check_layer_list("conditional_layers")
        self.bottleneck_layers = self._check_layer_list("bottleneck_layers")
        if self.bottleneck_layers is not None and self.conditional_bottleneck != "base":
            raise ValueError(
                "`bottleneck_layers` places `conditional_bottleneck='base'` bottlenecks; with "
                f"{self.conditional_bottleneck!r} leave it unset."
            )
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

    # ------------------------------------------------------------------ saved block count
    def to_diff_dict(self) -> dict:
        # a saved config holds the block count N its model was built with, so a later default cannot change its shapes
        out = super().to_diff_dict()
        out["conditional_attention_blocks"] = self.attention_blocks
        return out

    # ------------------------------------------------------------------ views
    @property
    def task_dim(self) -> int:
        return self.task_embedding_dim or self.hidden_size

    @property
    def frozen_layers(self) -> int:
        return self.num_hidden_layers // 2 if self.num_frozen_layers is None else self.num_frozen_layers

    @property
    def conditional_layer_indices(self) -> list[int]:
        if self.conditional_layers is not None:
            return list(self.conditional_layers)
        return list(range(self.frozen_layers, self.num_hidden_layers))

    @property
    def bottleneck_layer_indices(self) -> list[int]:
        if self.conditional_bottleneck == "large":
            return list(range(self.num_hidden_layers))
        if self.conditional_bottleneck == "none":
            return []
        return list(self.bottleneck_layers) if self.bottleneck_layers is not None else [self.num_hidden_layers - 1]

    @property
    def attention_blocks(self) -> int:
        if self.conditional_attention_blocks is not None:
            return self.conditional_attention_blocks
        return default_attention_blocks(self.hidden_size, self.conditional_attention_max_length)

    @property
    def uses_conditional_attention(self) -> bool:
        """Whether some layer adds `M(z)` to its attention scores."""
        return self.conditional_attention and bool(self.conditional_layer_indices)

    @property
    def uses_task_embedding(self) -> bool:
        """Whether any component reads the task embedding (the plain MTL baseline of Table 1 has none)."""
        conditional = bool(self.conditional_layer_indices) and (
            self.conditional_attention or self.conditional_layer_norm
        )
        return conditional or self.conditional_alignment or self.conditional_bottleneck != "none"
