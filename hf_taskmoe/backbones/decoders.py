"""The decoder-only and encoder-decoder architectures task-level routing runs on, each declared once.

Paths are relative to the dense model's *base* model (`GPT2Model` of a `GPT2LMHeadModel`, `LlamaModel` of a
`LlamaForCausalLM`, `T5Model` of a `T5ForConditionalGeneration`, `BartModel` of a `BartForConditionalGeneration`).
Task-level routing forks whole layers; what it needs of a layer besides its place is `attention`: the self-attention
module whose `layer_idx` names the layer's key/value cache slot (each expert copy gets its own slot, see
`hf_taskmoe.models.task_routing`), and in an encoder-decoder's decoder `cross_attention`, likewise; for the LoRA
export, which linears each norm feeds (`norm_consumers`) and what it adds to its weight (`norm_weight_offset`); T5's
relative-position tables (`relative_table`, `relative_table_owner`).

`tests/test_task_routed_lm.py` builds a tiny random model of each and checks every path resolves.
"""

from __future__ import annotations

from dataclasses import replace

from .base import DECODER_BACKBONE, ENCODER_DECODER_BACKBONE, Backbone, FFNSite, register_backbone

#: Llama's pre-norm layer: what each norm feeds (the LoRA export folds a task's norm into these linears)
_LLAMA_NORM_CONSUMERS = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}


def _llama_like(model_type: str, **fields) -> Backbone:
    """Llama and its descendants (Qwen2, Mistral, ...): pre-norm layers, gated (SwiGLU) `mlp`, rotary positions;
    `fields` override what a descendant changes (its norms, a plain `mlp`). The norm consumers are Llama's unless
    given: a descendant whose norm feeds other linears (a parallel block's norm feeds the attention and the FFN)
    declares its own, or none (`{}`: nothing is folded)."""
    return Backbone(**{
        "norm_consumers": _LLAMA_NORM_CONSUMERS,
        "model_type": model_type,
        "kind": DECODER_BACKBONE,
        "layers": "layers",
        "ffn": FFNSite(module="mlp", gated=True),
        "attention": "self_attn",
        "attention_output": "self_attn.o_proj",
        "norms": ("input_layernorm", "post_attention_layernorm"),
        "embeddings": "embed_tokens",
        "post_norm": False,
        "segment_ids": False,
        **fields,
    })


GPT2 = register_backbone(
    Backbone(
        model_type="gpt2",
        kind=DECODER_BACKBONE,
        layers="h",
        ffn=FFNSite(module="mlp", w_in="mlp.c_fc", act="mlp.act", w_out="mlp.c_proj"),
        attention="attn",
        attention_output="attn.c_proj",
        norms=("ln_1", "ln_2"),
        embeddings="wte",
        post_norm=False,
        # GPT-2 would add `token_type_ids` through its token embedding; a prompt + continuation has no segments
        segment_ids=False,
        norm_consumers={"ln_1": ("attn.c_attn",), "ln_2": ("mlp.c_fc",)},
        config_fields={
            "hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
            "max_position_embeddings": "n_positions", "layer_norm_eps": "layer_norm_epsilon",
            "hidden_dropout_prob": "resid_pdrop",
        },
    )
)
LLAMA = register_backbone(_llama_like("llama"))
QWEN2 = register_backbone(_llama_like("qwen2"))
MISTRAL = register_backbone(_llama_like("mistral"))
#: Llama's layer under other names for its scaling (Granite's multipliers), its attention (Qwen3's q/k norms, SmolLM3's
#: layers without rotary positions, Phi-3's fused `qkv_proj` and `gate_up_proj`), or LayerNorm in place of RMSNorm
#: (StableLM; its `use_parallel_residual` variant has no `post_attention_layernorm`)
QWEN3 = register_backbone(_llama_like("qwen3"))
GRANITE = register_backbone(_llama_like("granite"))
SMOLLM3 = register_backbone(_llama_like("smollm3"))
PHI3 = register_backbone(_llama_like("phi3", norm_consumers={
    "input_layernorm": ("self_attn.qkv_proj",), "post_attention_layernorm": ("mlp.gate_up_proj",),
}))
#: (StableLM's parallel variant feeds the attention and the FFN from `input_layernorm`: no norm is folded)
STABLELM = register_backbone(_llama_like("stablelm", norm_consumers={}))
#: Gemma 2 / Gemma 3 (text): a norm before and after each sub-layer ("sandwich"), sliding-window and global layers
#: alternating (`config.layer_types`, fixed per layer when it is built, so a forked layer's copies keep their kind);
#: the RMSNorm scales by `1 + weight`; the norms after the sub-layers feed the residual stream, not a linear
_GEMMA_NORMS = (
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
)
_GEMMA = dict(norms=_GEMMA_NORMS, norm_weight_offset=1.0, norm_consumers={
    "input_layernorm": _LLAMA_NORM_CONSUMERS["input_layernorm"],
    "pre_feedforward_layernorm": _LLAMA_NORM_CONSUMERS["post_attention_layernorm"],
})
GEMMA2 = register_backbone(_llama_like("gemma2", **_GEMMA))
GEMMA3_TEXT = register_backbone(_llama_like("gemma3_text", **_GEMMA))
#: OLMo 2: its norms follow each sub-layer, before the residual sum (`post_attention_layernorm`,
#: `post_feedforward_layernorm`); no norm feeds the sub-layers' projections, so none is folded
OLMO2 = register_backbone(_llama_like(
    "olmo2", norms=("post_attention_layernorm", "post_feedforward_layernorm"), norm_consumers={},
))
#: Starcoder2: Llama's layout with a plain two-projection `mlp` (`c_fc`, `c_proj`) and LayerNorms
STARCODER2 = register_backbone(_llama_like(
    "starcoder2", ffn=FFNSite(module="mlp"),
    norm_consumers={**_LLAMA_NORM_CONSUMERS, "post_attention_layernorm": ("mlp.c_fc",)},
    config_fields={"layer_norm_eps": "norm_epsilon", "hidden_dropout_prob": "residual_dropout"},
))
#: Cohere (Command-R): one norm feeding the attention and the gated `mlp` in parallel (`x + attn(n(x)) + mlp(n(x))`)
COHERE = register_backbone(_llama_like("cohere", norms=("input_layernorm",), norm_consumers={
    "input_layernorm": (*_LLAMA_NORM_CONSUMERS["input_layernorm"], *_LLAMA_NORM_CONSUMERS["post_attention_layernorm"]),
}))
#: GPT-NeoX (Pythia): `attention` (`query_key_value`, `dense`) and a plain `mlp`, in parallel from two norms by default
#: (`use_parallel_residual`), sequential otherwise
GPT_NEOX = register_backbone(_llama_like(
    "gpt_neox", ffn=FFNSite(module="mlp"), attention="attention", attention_output="attention.dense",
    norm_consumers={"input_layernorm": ("attention.query_key_value",),
                    "post_attention_layernorm": ("mlp.dense_h_to_4h",)},
    embeddings="embed_in", config_fields={"hidden_dropout_prob": "hidden_dropout"},
))
#: Falcon: `h` layers whose `self_attention` and plain `mlp` run in parallel from `input_layernorm` (the 7B layout;
#: `new_decoder_architecture` checkpoints -- 40B, 180B -- have `ln_attn` and `ln_mlp` instead)
FALCON = register_backbone(_llama_like(
    "falcon", layers="h", ffn=FFNSite(module="mlp"), attention="self_attention",
    attention_output="self_attention.dense", norms=("input_layernorm",), embeddings="word_embeddings",
    norm_consumers={"input_layernorm": ("self_attention.query_key_value", "mlp.dense_h_to_4h")},
    config_fields={"layer_norm_eps": "layer_norm_epsilon", "hidden_dropout_prob": "hidden_dropout"},
    unsupported={"task-routing": (
        "Falcon's layers return a tuple (hidden states, attention weights) and take their key/value cache as "
        "`layer_past`, where task-level routing mixes its experts' outputs as the hidden-states tensor a layer "
        "returns and finds the cache among the layer's cache arguments: the experts' outputs cannot be mixed. Use a "
        "checkpoint of a declared decoder whose layers return their hidden states (Llama, Qwen, Gemma, GPT-NeoX, ...), "
        "or low-rank experts (`expert_rank`), which keep one copy of each layer and mix nothing."
    )},
    low_rank_only=("task-routing",),
))


def _t5_like(model_type: str, relative_table_owner: str = "first") -> Backbone:
    """T5 / mT5: `block`s of `layer[0]` self-attention, (decoder: `layer[1]` cross-attention), last: the FFN (`wi`, or
    gated `wi_0` and `wi_1`), each sub-layer's `layer_norm` feeding its inputs (the cross-attention's: its queries).
    The first block of each stack owns the relative-position table (`relative_table_owner`)."""
    return Backbone(
        model_type=model_type,
        kind=ENCODER_DECODER_BACKBONE,
        layers="encoder.block",
        decoder_layers="decoder.block",
        ffn=FFNSite(module="layer.1.DenseReluDense"),  # the encoder's; a decoder block's is `layer.2`
        attention="layer.0.SelfAttention",
        cross_attention="layer.1.EncDecAttention",
        attention_output="layer.0.SelfAttention.o",
        norms=("layer.0.layer_norm", "layer.1.layer_norm"),
        embeddings="shared",
        post_norm=False,
        segment_ids=False,
        attention_bias=False,
        why_no_bias="T5 adds its relative position bias inside its attention module.",
        norm_consumers={"layer.0.layer_norm": ("layer.0.SelfAttention.[qkv]",),
                        "layer.1.layer_norm": ("layer.1.DenseReluDense.wi*",)},
        decoder_norm_consumers={"layer.0.layer_norm": ("layer.0.SelfAttention.[qkv]",),
                                "layer.1.layer_norm": ("layer.1.EncDecAttention.q",),
                                "layer.2.layer_norm": ("layer.2.DenseReluDense.wi*",)},
        relative_table="layer.0.SelfAttention.relative_attention_bias",
        relative_table_owner=relative_table_owner,
        config_fields={
            "hidden_size": "d_model", "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
            "intermediate_size": "d_ff", "layer_norm_eps": "layer_norm_epsilon", "hidden_dropout_prob": "dropout_rate",
        },
    )


T5 = register_backbone(_t5_like("t5"))
MT5 = register_backbone(_t5_like("mt5"))
#: UMT5: T5's blocks, each with its own relative-position table (no bias passed from block to block)
UMT5 = register_backbone(_t5_like("umt5", relative_table_owner="each"))


def _bart_like(model_type: str, post_norm: bool = True) -> Backbone:
    """BART and its descendants: `layers` of `self_attn` (decoder: `encoder_attn`) and `fc1` / `fc2`; pre-norm ones
    (mBART, Pegasus) normalise each sub-layer's input (the cross-attention's: its queries)."""
    consumers = {"self_attn_layer_norm": ("self_attn.[qkv]_proj",), "final_layer_norm": ("fc1",)}
    return Backbone(
        norm_consumers={} if post_norm else consumers,
        decoder_norm_consumers={} if post_norm else {**consumers, "encoder_attn_layer_norm": ("encoder_attn.q_proj",)},
        model_type=model_type,
        kind=ENCODER_DECODER_BACKBONE,
        layers="encoder.layers",
        decoder_layers="decoder.layers",
        ffn=FFNSite(module="fc1", w_in="fc1", act="activation_fn", w_out="fc2"),
        attention="self_attn",
        cross_attention="encoder_attn",
        attention_output="self_attn.out_proj",
        norms=("self_attn_layer_norm", "final_layer_norm"),
        embeddings="shared",
        post_norm=post_norm,
        segment_ids=False,
        config_fields={
            "hidden_size": "d_model", "num_hidden_layers": "encoder_layers", "num_decoder_layers": "decoder_layers",
            "num_attention_heads": "encoder_attention_heads", "intermediate_size": "encoder_ffn_dim",
            "hidden_dropout_prob": "dropout",
        },
    )


#: BART: post-norm layers, learned positions
BART = register_backbone(_bart_like("bart"))
#: mBART and Pegasus: BART's layers made pre-norm (each norm before its sub-layer); Marian (Opus-MT): BART's post-norm
#: layers with sinusoidal positions
MBART = register_backbone(_bart_like("mbart", post_norm=False))
PEGASUS = register_backbone(_bart_like("pegasus", post_norm=False))
MARIAN = register_backbone(_bart_like("marian"))
#: LongT5: T5's blocks with local or transient-global attention in the encoder, declared so that a checkpoint is
#: refused with the reason
#: (its encoder's self-attention is `LocalSelfAttention`, or `TransientGlobalSelfAttention` with
#: `encoder_attention_type="transient-global"`; its decoder's is T5's `SelfAttention`)
LONGT5 = register_backbone(replace(
    _t5_like("longt5"), attention="layer.0.LocalSelfAttention", attention_output="layer.0.LocalSelfAttention.o",
    relative_table="layer.0.LocalSelfAttention.relative_attention_bias",
    unsupported={"task-routing": (
    "LongT5's blocks return a tuple (hidden states, then the relative-position bias of its local / transient-global "
    "attention, which the first block computes and the later ones reuse), and the routed block that carries such a "
    "bias from block to block knows T5's full attention only (T5RoutedBlock, for t5 / mt5): mixing the experts' "
    "outputs would mix tuples. Use a T5, mT5 or UMT5 checkpoint."
)}))
