"""The encoder architectures MT-TaG, PALs and CA-MTL run on, each declared once.

Paths were read off transformers 5.x's modules (`tests/test_backbones.py` builds a tiny random model of each and
checks every path resolves to a module of the expected kind, so an upstream rename fails there by name).
"""

from __future__ import annotations

from .base import ENCODER_BACKBONE, Backbone, FFNSite, register_backbone

#: BERT's layer: `attention` (self + output with its LayerNorm), `intermediate` (w_in + act), `output` (w_out,
#: dropout, LayerNorm of the residual sum). RoBERTa, XLM-R, ELECTRA and DeBERTa-v2 keep these names.
BERT_FFN = FFNSite(module="intermediate", w_in="intermediate.dense", act="intermediate.intermediate_act_fn",
                   w_out="output.dense")
BERT_NORMS = ("attention.output.LayerNorm", "output.LayerNorm")


def _bert_like(model_type: str, pooler: bool = True, **kwargs) -> Backbone:
    return Backbone(**{
        "model_type": model_type,
        "kind": ENCODER_BACKBONE,
        "layers": "encoder.layer",
        "ffn": BERT_FFN,
        "attention": "attention.self",
        "attention_output": "attention.output.dense",
        "norms": BERT_NORMS,
        "pooler": "pooler" if pooler else None,
        **kwargs,
    })


BERT = register_backbone(_bert_like("bert"))
ROBERTA = register_backbone(_bert_like("roberta"))
XLM_ROBERTA = register_backbone(_bert_like("xlm-roberta"))
ELECTRA = register_backbone(_bert_like("electra", pooler=False))
DEBERTA_V2 = register_backbone(
    _bert_like(
        "deberta-v2",
        pooler=False,
        attention_bias=False,
        why_no_bias=(
            "DeBERTa-v2/v3's disentangled attention takes a boolean mask and adds its own relative-position scores "
            "inside the module, with no seam for an additive bias: build CA-MTL with `conditional_attention=False` "
            "(its other conditional modules work), or use a BERT/RoBERTa/XLM-R/ELECTRA/DistilBERT/ModernBERT backbone."
        ),
    )
)
DISTILBERT = register_backbone(
    Backbone(
        model_type="distilbert",
        kind=ENCODER_BACKBONE,
        layers="transformer.layer",
        ffn=FFNSite(module="ffn"),
        attention="attention",
        attention_output="attention.out_lin",
        norms=("sa_layer_norm", "output_layer_norm"),
        segment_ids=False,
        config_fields={
            "hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
            "intermediate_size": "hidden_dim", "hidden_dropout_prob": "dropout",
        },
    )
)
MODERNBERT = register_backbone(
    Backbone(
        model_type="modernbert",
        kind=ENCODER_BACKBONE,
        layers="layers",
        ffn=FFNSite(module="mlp", gated=True),
        attention="attn",
        attention_output="attn.Wo",
        norms=("attn_norm", "mlp_norm"),  # pre-norm; layer 0's attn_norm is an Identity (nothing to condition)
        post_norm=False,
        segment_ids=False,
        config_fields={"layer_norm_eps": "norm_eps", "hidden_dropout_prob": "mlp_dropout"},
    )
)

# ------------------------------------------------------------------------------------ the BERT family's descendants
#: CamemBERT (RoBERTa trained on French), ERNIE (BERT with optional task-type embeddings), Data2Vec-text (RoBERTa's
#: layout) and RemBERT (BERT with a narrower input embedding, `encoder.embedding_hidden_mapping_in` widening it before
#: the first layer) keep BERT's module names
CAMEMBERT = register_backbone(_bert_like("camembert"))
ERNIE = register_backbone(_bert_like("ernie"))
DATA2VEC_TEXT = register_backbone(_bert_like("data2vec-text"))
REMBERT = register_backbone(_bert_like("rembert"))
#: XLM-RoBERTa-XL / XXL: BERT's names but pre-norm -- `attention.self_attn_layer_norm` before the attention, the
#: layer's own `LayerNorm` before the FFN; `attention.output` and `output` add the residual and normalise nothing
XLM_ROBERTA_XL = register_backbone(
    _bert_like("xlm-roberta-xl", norms=("attention.self_attn_layer_norm", "LayerNorm"), post_norm=False)
)
#: MPNet: BERT's layout, its self-attention `attention.attn` (q, k, v, o) adding the relative position bias the
#: encoder computes once; one LayerNorm after each sub-layer's residual sum; no segment embeddings
MPNET = register_backbone(
    Backbone(
        model_type="mpnet",
        kind=ENCODER_BACKBONE,
        layers="encoder.layer",
        ffn=BERT_FFN,
        attention="attention.attn",
        attention_output="attention.attn.o",
        norms=("attention.LayerNorm", "output.LayerNorm"),
        pooler="pooler",
        segment_ids=False,
    )
)

#: why no method of the encoder kind takes ALBERT
_ALBERT_SHARED = (
    "ALBERT shares one layer's weights across its depth (`encoder.albert_layer_groups[0].albert_layers[0]` runs "
    "`num_hidden_layers` times), so {what} per layer would be one module applied at every depth, not the method's "
    "per-layer modules; unsharing the layer first would make it another model. Use a BERT/RoBERTa-like checkpoint."
)
#: ALBERT: declared so that a checkpoint is refused with the reason, not as an unknown architecture
ALBERT = register_backbone(
    Backbone(
        model_type="albert",
        kind=ENCODER_BACKBONE,
        layers="encoder.albert_layer_groups.0.albert_layers",
        ffn=FFNSite(module="ffn", w_in="ffn", act="activation", w_out="ffn_output"),
        attention="attention",
        attention_output="attention.dense",
        norms=("attention.LayerNorm", "full_layer_layer_norm"),
        unsupported={
            "mt-tag": _ALBERT_SHARED.format(what="upcycling each FFN into experts"),
            "pals": _ALBERT_SHARED.format(what="adding a PAL"),
            "ca-mtl": _ALBERT_SHARED.format(what="conditioning the norms, attention and FFN"),
        },
    )
)
