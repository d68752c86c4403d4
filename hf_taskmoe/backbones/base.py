"""The backbone layer: where each architecture keeps the modules a method wraps, declared once per `model_type`.

A method never re-implements an architecture. It builds the dense model's own base model
(`AutoModel.from_config`), then replaces or wraps a few of its modules in place, found through the architecture's
`Backbone` declaration: the feed-forward block (MT-TaG turns it into experts that are copies of it), the attention's
output projection (PALs add beside it), the layer norms and the embeddings (CA-MTL conditions them on the task).
The dense model's own `forward` then runs as it always does -- its attention kernels, masks, rotary positions and
local/global layers included -- and the wrapped modules read the batch's task ids from a `TaskContext` the family
fills before each call. This is peft's target-module maps and adapters' model mixins, for task-conditioned modules.

Adding an architecture is one `register_backbone(Backbone(...))` (see `encoders.py`) and one entry in the test matrix
(`tests/test_backbones.py`). Only public seams are used: module attributes (`get_submodule` / `set_submodule`) and
torch's module hooks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

#: what a backbone is (`Backbone.kind`)
ENCODER_BACKBONE = "encoder"
DECODER_BACKBONE = "decoder"
ENCODER_DECODER_BACKBONE = "encoder-decoder"

#: the methods an architecture is declared for, by the name their families give (`Family.method`): the label their
#: classes' `method_name` begins with, and the backbone kinds the method runs on (`Backbone.unsupported` keys)
METHODS: dict[str, tuple[str, tuple[str, ...]]] = {
    "mt-tag": ("MT-TaG", (ENCODER_BACKBONE,)),
    "pals": ("PALs", (ENCODER_BACKBONE,)),
    "ca-mtl": ("CA-MTL", (ENCODER_BACKBONE,)),
    "task-routing": ("Task-level routing", (DECODER_BACKBONE, ENCODER_DECODER_BACKBONE)),
}


def method_key(method: str) -> str | None:
    """The `METHODS` key of `method`: a key itself, or a class's `method_name` (`"PALs (PALsForMultiTask)"`) that
    begins with a method's label; None for a name of no declared method."""
    if method in METHODS:
        return method
    return next((key for key, (label, _) in METHODS.items() if method.startswith(label)), None)


@dataclass(frozen=True)
class FFNSite:
    """Where a layer's feed-forward block lives (paths relative to the layer).

    Two shapes are declared:

    - a *split* FFN (BERT and its descendants): `module` is the first half (`intermediate`, which runs `w_in` then the
      activation), `w_in` / `act` / `w_out` the paths of its input projection, activation and output projection.
      The output projection sits in a module that also adds the residual and normalises (`output.dense` inside
      `BertOutput`); the method's module replaces `module` and computes the whole FFN, and `w_out` becomes an identity.
    - a *whole* FFN module (DistilBERT's `ffn`, ModernBERT's gated `mlp`, Llama's `mlp`): `module` only; `w_in` /
      `w_out` stay None and experts are copies of the whole module.

    `gated`: the FFN is a GLU (its experts cannot use the plain two-projection grouped GEMM).
    """

    module: str
    w_in: str | None = None
    act: str | None = None
    w_out: str | None = None
    gated: bool = False

    @property
    def split(self) -> bool:
        return self.w_out is not None


@dataclass(frozen=True)
class Backbone:
    """One architecture, as the methods see it. Paths are dotted attribute paths.

    Args:
        model_type: transformers' `model_type` of the dense config (`"roberta"`, `"modernbert"`, ...).
        kind: `"encoder"`, `"decoder"` (a causal LM) or `"encoder-decoder"`.
        layers: path from the base model to the `ModuleList` of its (encoder) layers.
        ffn: the feed-forward block of a layer (`FFNSite`).
        attention: path, in a layer, of the self-attention module that receives the attention mask (a keyword
            `attention_mask` or its second positional argument).
        attention_output: path, in a layer, of the projection whose output joins the residual stream after attention
            (PALs add their output beside it).
        norms: paths, in a layer, of its layer norms (CA-MTL's conditional layer norm replaces them), in order.
        embeddings: path from the base model to the embeddings module (its output is the first layer's input).
        post_norm: the layer normalises after adding the residual (BERT) rather than before the sub-layer (ModernBERT).
        segment_ids: the model takes `token_type_ids` (segment embeddings); without them a tokenizer's segment ids are
            not passed on.
        pooler: path of the base model's pooler (BERT's tanh pooler over [CLS]); None: the architecture has none.
        attention_bias: whether an additive float mask reaches the attention scores as they are computed
            (CA-MTL's conditional attention adds its task bias there); None: no such seam, said by `why_no_bias`.
        why_no_bias: the reason and the alternative, when `attention_bias` is False.
        config_fields: names of the dense config's fields for the hidden size, the number of layers and heads, and
            the maximum input length (`hidden_size`, `num_hidden_layers`, ...: DistilBERT calls them `dim`,
            `n_layers`).
        decoder_layers: path of an encoder-decoder's decoder layers.
        cross_attention: path, in a decoder layer of an encoder-decoder, of its cross-attention module (whose
            `layer_idx` names its cross-attention cache slot, as `attention`'s names the self-attention one).
        unsupported: `{method: reason}` for the methods (`METHODS` keys) whose assumptions the architecture's structure
            breaks (ALBERT shares one layer's weights across its depth): building such a model raises a `ValueError`
            naming the architecture, the method and the reason. Default: none, every method of the kind applies.
        low_rank_only: the methods of `unsupported` that do run on the architecture with low-rank experts
            (`expert_rank`): their reason concerns whole copies of a layer (mixing the copies' outputs), and a model
            with low-rank experts keeps one copy of each layer whose linears carry the experts' deltas, so nothing is
            mixed. Building such a model without `expert_rank` is refused with the reason. Default: none.
        norm_consumers: `{norm: linears}` of a pre-norm layer (`layers`'): each norm (a path in the layer) whose output
            is exactly the input of the linears named (`fnmatch` patterns of paths in the layer, each matching at least
            one: `"self_attn.[qkv]_proj"`, T5's `"layer.1.DenseReluDense.wi*"` for its plain or gated FFN). The LoRA
            export folds a task's differing norm into those linears (`hf_taskmoe.lora_export`); a norm not named here
            -- a post-norm layer's (`post_norm`), OLMo 2's, which normalise each sub-layer's output before the residual
            sum and feed no linear -- is carried by no adapter: a difference there is dropped and reported. Default:
            none (nothing is folded).
        decoder_norm_consumers: `norm_consumers` of an encoder-decoder's decoder layers (T5's `layer.1` is the
            cross-attention there, the FFN's norm `layer.2`); None: the same as `norm_consumers` (BART's names).
        norm_weight_offset: what the norms add to their weight before scaling (Gemma's RMSNorm scales by `1 + w`):
            folding a norm divides by the base's `offset + w`. Default 0.
        relative_table: path, in a layer, of its attention's relative-position table (T5's
            `layer.0.SelfAttention.relative_attention_bias`: an embedding looked up by position bucket, which no LoRA
            adapter carries); None: the layers have none.
        relative_table_owner: which layers own `relative_table`: `"first"` (T5: the first layer of each stack
            computes the position bias and every layer returns it beside its hidden states, for the next; task
            routing mixes the experts' biases with their hidden states, `T5RoutedBlock`) or `"each"` (UMT5: every
            layer has its own table and returns its hidden states only).
    """

    model_type: str
    kind: str
    layers: str
    ffn: FFNSite
    attention: str | None = None
    attention_output: str | None = None
    norms: tuple[str, ...] = ()
    embeddings: str = "embeddings"
    post_norm: bool = True
    segment_ids: bool = True
    pooler: str | None = None
    attention_bias: bool = True
    why_no_bias: str = ""
    config_fields: dict = field(default_factory=dict)
    decoder_layers: str | None = None
    cross_attention: str | None = None
    unsupported: dict = field(default_factory=dict)
    low_rank_only: tuple[str, ...] = ()
    norm_consumers: dict = field(default_factory=dict)
    decoder_norm_consumers: dict | None = None
    norm_weight_offset: float = 0.0
    relative_table: str | None = None
    relative_table_owner: str = "first"

    def supports(self, method: str, low_rank: bool = False) -> bool:
        """Whether `method` (a `METHODS` key) runs on this architecture: of its kind and not refused (with low-rank
        experts, `low_rank`: not refused, or refused for whole experts only, `low_rank_only`)."""
        refused = method in self.unsupported and not (low_rank and method in self.low_rank_only)
        return self.kind in METHODS[method][1] and not refused

    @property
    def passes_position_bias(self) -> bool:
        """The layers return their relative-position bias beside their hidden states, for the next layer (T5)."""
        return self.relative_table is not None and self.relative_table_owner == "first"

    def layer_norm_consumers(self, decoder: bool = False) -> dict:
        """`norm_consumers` of the (encoder or decoder-only) layers, or of an encoder-decoder's decoder layers."""
        if decoder and self.decoder_norm_consumers is not None:
            return self.decoder_norm_consumers
        return self.norm_consumers

    def config_value(self, config, name: str):
        """The dense config's value for one of the canonical names (`hidden_size`, `num_hidden_layers`,
        `num_attention_heads`, `max_position_embeddings`, `layer_norm_eps`, `hidden_dropout_prob`)."""
        return getattr(config, self.config_fields.get(name, name), None)

    def layer_list(self, base_model: nn.Module) -> nn.ModuleList:
        return base_model.get_submodule(self.layers)


#: every declared architecture, by `model_type`
BACKBONES: dict[str, Backbone] = {}


def register_backbone(backbone: Backbone, exist_ok: bool = False) -> Backbone:
    """Declare an architecture: the methods of its kind then accept its checkpoints."""
    unknown = sorted(set(backbone.unsupported) - set(METHODS))
    if unknown:
        raise ValueError(f"`unsupported` of backbone {backbone.model_type!r} names no method: {unknown}; the methods "
                         f"are {sorted(METHODS)}.")
    if backbone.relative_table_owner not in ("first", "each"):
        raise ValueError(f"`relative_table_owner` of backbone {backbone.model_type!r} must be 'first' or 'each', got "
                         f"{backbone.relative_table_owner!r}.")
    loose = sorted(set(backbone.low_rank_only) - set(backbone.unsupported))
    if loose:
        raise ValueError(f"`low_rank_only` of backbone {backbone.model_type!r} names methods it does not refuse: "
                         f"{loose}; it lifts a refusal of `unsupported` for low-rank experts.")
    if backbone.model_type in BACKBONES and not exist_ok and BACKBONES[backbone.model_type] != backbone:
        raise ValueError(f"A backbone for model_type {backbone.model_type!r} is already declared; pass exist_ok=True.")
    BACKBONES[backbone.model_type] = backbone
    return backbone


def backbone_names(kind: str | None = None) -> list[str]:
    """The declared `model_type`s (of one `kind`), sorted."""
    return sorted(name for name, b in BACKBONES.items() if kind is None or b.kind == kind)


def get_backbone(model_type: str, kind: str | None = None, method: str = "This method",
                 low_rank: bool = False) -> Backbone:
    """The declaration of `model_type`; a `ValueError` listing the supported ones otherwise, or naming the reason
    when the declaration refuses `method` (a `METHODS` key or a class's `method_name`; `Backbone.unsupported`) --
    unless the model has low-rank experts (`low_rank`) and the refusal is for whole experts only
    (`Backbone.low_rank_only`)."""
    backbone = BACKBONES.get(model_type)
    key = method_key(method)
    if backbone is None or (kind is not None and backbone.kind != kind):
        supported = [name for name in backbone_names(kind) if key is None or key not in BACKBONES[name].unsupported]
        raise ValueError(
            f"{method} does not support model_type {model_type!r}; supported {kind or ''} backbones: "
            f"{supported}. A new architecture is one hf_taskmoe.backbones.register_backbone(...) "
            "declaration (docs/backbones.md)."
        )
    reason = backbone.unsupported.get(key)
    if reason is not None and not (low_rank and key in backbone.low_rank_only):
        raise ValueError(f"{method} cannot run on a {model_type!r} backbone: {reason}")
    return backbone


class TaskContext:
    """What the wrapped modules of one model read during a forward: the batch's task ids and token mask, and what
    they report back (each MoE layer's routing). A plain object, not a module: it holds no weights, is not saved,
    and torch.export / torch.compile trace its attribute writes like any Python side effect.

    The family fills it (`begin`) before calling the dense model and empties it (`end`) after, so no tensor of a
    batch outlives its forward."""

    def __init__(self):
        self.end()

    def begin(self, task_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **flags) -> None:
        self.end()  # nothing of an earlier forward stays
        self.task_ids, self.attention_mask, self.flags = task_ids, attention_mask, flags

    def end(self) -> None:
        self.task_ids = None
        self.attention_mask = None
        self._token_mask = None
        self.flags = {}
        self.reports = []
        self.layer_input = None

    @property
    def token_mask(self) -> torch.Tensor | None:
        """The batch's `(batch, seq)` attention mask as bool (True for real tokens), None without one: made when a
        module first reads it (most forwards read none: one operation saved), then kept for the forward's others."""
        mask = self._token_mask
        if mask is None and self.attention_mask is not None:
            mask = self._token_mask = self.attention_mask.bool()
        return mask

    def checkpoint_kwargs(self, kwargs: dict | None) -> dict:
        """`torch.utils.checkpoint` keywords for activation checkpointing of a model whose modules read this context:
        a checkpointed layer is run again during the backward pass, after the forward emptied the context, so a
        `context_fn` snapshots the context when the layer first runs and restores that snapshot while it is recomputed
        (right even when several forwards precede one backward). `context_fn` needs the non-reentrant checkpoint."""
        kwargs = dict(kwargs or {})
        if kwargs.get("use_reentrant"):
            raise ValueError(
                "Activation checkpointing of a task model needs `use_reentrant=False` (its layers read the batch's "
                "task ids, which are restored for the recomputation through torch.utils.checkpoint's `context_fn`)."
            )
        if "context_fn" in kwargs:
            raise ValueError("A task model sets the checkpoint's `context_fn` itself (to restore the task ids).")
        return {**kwargs, "use_reentrant": False, "context_fn": self._checkpoint_contexts}

    def _checkpoint_contexts(self):
        # at the layer's first run
        state = (self.task_ids, self.attention_mask, self._token_mask, self.flags, self.layer_input)
        return contextlib.nullcontext(), self._restoring(state)

    @contextlib.contextmanager
    def _restoring(self, state):
        saved = (self.task_ids, self.attention_mask, self._token_mask, self.flags, self.reports, self.layer_input)
        self.task_ids, self.attention_mask, self._token_mask, self.flags, self.layer_input = state
        self.reports = []  # what a recomputed module reports is the forward's again: not kept
        try:
            yield
        finally:
            self.task_ids, self.attention_mask, self._token_mask, self.flags, self.reports, self.layer_input = saved

    def require_task_ids(self) -> torch.Tensor:
        if self.task_ids is None:
            raise RuntimeError(
                "A task-conditioned module ran outside its model's forward (no task ids were set): call the model, "
                "not its backbone, with `task_ids`."
            )
        return self.task_ids


def replace_module(root: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """Put `new` at `path` under `root`; return the module that was there."""
    old = root.get_submodule(path)
    root.set_submodule(path, new)
    return old


def layer_hidden_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states a layer (or its attention) was called with: `hidden_states=` or the first argument."""
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
