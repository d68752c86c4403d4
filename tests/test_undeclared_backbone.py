"""An architecture the package does not ship, declared in this file alone, runs every method that applies to it and
the LoRA export: all the package knows of an architecture is its `Backbone` declaration (issue 57).

Three transformers architectures no declaration of the package names, each declared here with the fields its
structure needs: BertGeneration (an encoder: MT-TaG, PALs, CA-MTL), Gemma 1 (a decoder whose RMSNorm scales by
`1 + w`: task routing with whole and low-rank experts, `export_task_adapters` folding its norms through
`norm_weight_offset`) and M2M100 (a pre-norm encoder-decoder with BART's names: task routing, its decoder's norms
folded through `decoder_norm_consumers`). The declarations are removed again when the module's tests end."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    BertGenerationConfig,
    GemmaConfig,
    M2M100Config,
)

from hf_taskmoe import TaskRoutedForCausalLM, TaskRoutedForSeq2SeqLM, TaskSpec
from hf_taskmoe.backbones import (
    BACKBONES,
    DECODER_BACKBONE,
    ENCODER_BACKBONE,
    ENCODER_DECODER_BACKBONE,
    Backbone,
    FFNSite,
    backbone_names,
    register_backbone,
)

from .test_backbones_new import ENCODER_METHODS
from .test_lora_export import FULL_RANK_ATOL, load_peft, move_apart

VOCAB = 40
SPECIAL = dict(pad_token_id=0, bos_token_id=2, eos_token_id=3)
CLASSIFY = [TaskSpec(name="a", num_labels=3), TaskSpec(name="b", num_labels=2)]
GENERATE = [TaskSpec(name=n, problem_type="seq2seq") for n in ("x", "y", "z")]

#: the declarations: nothing else in the package knows these architectures
BERT_GENERATION = Backbone(
    model_type="bert-generation", kind=ENCODER_BACKBONE, layers="encoder.layer",
    ffn=FFNSite(module="intermediate", w_in="intermediate.dense", act="intermediate.intermediate_act_fn",
                w_out="output.dense"),
    attention="attention.self", attention_output="attention.output.dense",
    norms=("attention.output.LayerNorm", "output.LayerNorm"), segment_ids=False,
)
GEMMA = Backbone(
    model_type="gemma", kind=DECODER_BACKBONE, layers="layers", ffn=FFNSite(module="mlp", gated=True),
    attention="self_attn", attention_output="self_attn.o_proj", norms=("input_layernorm", "post_attention_layernorm"),
    embeddings="embed_tokens", post_norm=False, segment_ids=False, norm_weight_offset=1.0,
    norm_consumers={"input_layernorm": ("self_attn.[qkv]_proj",),
                    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")},
)
_M2M100_NORMS = {"self_attn_layer_norm": ("self_attn.[qkv]_proj",), "final_layer_norm": ("fc1",)}
M2M100 = Backbone(
    model_type="m2m_100", kind=ENCODER_DECODER_BACKBONE, layers="encoder.layers", decoder_layers="decoder.layers",
    ffn=FFNSite(module="fc1", w_in="fc1", act="activation_fn", w_out="fc2"), attention="self_attn",
    cross_attention="encoder_attn", attention_output="self_attn.out_proj",
    norms=("self_attn_layer_norm", "final_layer_norm"), embeddings="shared", post_norm=False, segment_ids=False,
    norm_consumers=_M2M100_NORMS,
    decoder_norm_consumers={**_M2M100_NORMS, "encoder_attn_layer_norm": ("encoder_attn.q_proj",)},
    config_fields={"hidden_size": "d_model", "num_hidden_layers": "encoder_layers",
                   "num_attention_heads": "encoder_attention_heads"},
)
DECLARED = (BERT_GENERATION, GEMMA, M2M100)

CONFIGS = {
    "bert-generation": lambda: BertGenerationConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=40, **SPECIAL),
    "gemma": lambda: GemmaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, **SPECIAL),
    "m2m_100": lambda: M2M100Config(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
        decoder_start_token_id=SPECIAL["eos_token_id"], **SPECIAL),
}


@pytest.fixture(scope="module", autouse=True)
def declared():
    """The three declarations, for this module's tests only."""
    assert not {b.model_type for b in DECLARED} & set(backbone_names())  # the package ships none of them
    for backbone in DECLARED:
        register_backbone(backbone)
    yield
    for backbone in DECLARED:
        BACKBONES.pop(backbone.model_type)


def dense(model_type: str):
    torch.manual_seed(0)
    auto = {"bert-generation": AutoModel, "gemma": AutoModelForCausalLM, "m2m_100": AutoModelForSeq2SeqLM}
    return auto[model_type].from_config(CONFIGS[model_type]()).eval()


def encoder_batch(task_ids) -> dict:
    g = torch.Generator().manual_seed(0)
    n = len(task_ids)
    ids = torch.randint(4, VOCAB, (n, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    labels = torch.tensor([float(t % 2) for t in task_ids])
    return dict(input_ids=ids, attention_mask=mask, task_ids=torch.tensor(task_ids), labels=labels)


def lm_batch(model, task_ids) -> dict:
    """A decoder's rows left-padded, labels its own tokens; an encoder-decoder's inputs right-padded, labels a
    target ending in eos."""
    g = torch.Generator().manual_seed(1)
    n = len(task_ids)
    ids = torch.randint(4, VOCAB, (n, 8), generator=g)
    mask = torch.ones_like(ids)
    if model.config.dense_config.is_encoder_decoder:
        mask[0, -2:] = 0
        labels = torch.randint(4, VOCAB, (n, 5), generator=g)
        labels[:, -1] = SPECIAL["eos_token_id"]
    else:
        mask[0, :2] = 0
        labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids.masked_fill(mask == 0, 0), attention_mask=mask, labels=labels,
                task_ids=torch.tensor(task_ids))


def model_inputs(model, batch: dict) -> dict:
    """The batch without its task ids (an encoder-decoder keeps its labels: both models make their decoder inputs
    from them)."""
    drop = ("task_ids",) if model.config.dense_config.is_encoder_decoder else ("task_ids", "labels")
    return {k: v for k, v in batch.items() if k not in drop}


def train_step_reaches(model, batch, prefixes: tuple[str, ...]) -> None:
    """One training step: a finite loss whose gradient reaches the method's own weights."""
    model.train()
    loss = model(**batch).loss
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if n.startswith(prefixes) and p.requires_grad]
    assert grads and any(g is not None and g.abs().sum() > 0 for g in grads)
    model.eval()


# ---------------------------------------------------------------------------------------------- the encoder
@pytest.mark.parametrize("method", sorted(ENCODER_METHODS))
def test_every_encoder_method_runs_on_the_undeclared_encoder(method, tmp_path):
    base = dense("bert-generation")
    model_cls, _, kwargs = ENCODER_METHODS[method]
    model = model_cls.from_dense(base, CLASSIFY, **kwargs).eval()
    batch = encoder_batch([0, 1, 0, 1])
    mask = batch["attention_mask"].bool()
    with torch.no_grad():  # upcycled: the dense model's hidden states
        got = model(**batch, output_hidden_states=True).hidden_states[-1][mask]
        expected = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state[mask]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    train_step_reaches(model, batch, ("heads.",))
    model.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).task_logits, model(**batch).task_logits, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------- task routing
ROUTED = {"gemma": TaskRoutedForCausalLM, "m2m_100": TaskRoutedForSeq2SeqLM}
AUTO = {"gemma": AutoModelForCausalLM, "m2m_100": AutoModelForSeq2SeqLM}


@pytest.mark.parametrize("model_type", sorted(ROUTED))
def test_task_routing_on_the_undeclared_lm_computes_it_trains_and_generates(model_type, tmp_path):
    plain = dense(model_type)
    model = ROUTED[model_type].from_dense(plain, GENERATE, num_experts=2, expert_noise_variance=0.0,
                                          selection="softmax").eval()
    batch = lm_batch(model, [0, 1, 2, 1])
    inputs = {k: v for k, v in batch.items() if k != "task_ids"}
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, plain(**inputs).logits, atol=1e-5, rtol=1e-5)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    new = model.generate(ids, attention_mask=mask, task_ids=batch["task_ids"], max_new_tokens=3, do_sample=False)
    assert torch.equal(new, plain.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False))
    train_step_reaches(model, batch, ("router.",))
    model.save_pretrained(tmp_path)
    loaded = AUTO[model_type].from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits, atol=1e-5, rtol=0)


def moved_apart(model_type: str):
    """A hard-routed model of three experts whose every parameter (weights, norms, biases) was moved apart, its tasks
    on pairwise different routes."""
    return move_apart(ROUTED[model_type].from_dense(dense(model_type), GENERATE, num_experts=3,
                                                   expert_noise_variance=0.0, selection="gumbel_softmax_st"))


@pytest.mark.parametrize("model_type", sorted(ROUTED))
def test_the_full_rank_adapter_export_of_the_undeclared_lm_is_exact(model_type, tmp_path):
    """Every norm is folded through the declaration (Gemma's `1 + w` through `norm_weight_offset`, M2M100's decoder
    norms through `decoder_norm_consumers`): nothing is dropped and the peft model gives the routed model's logits."""
    model = moved_apart(model_type)
    result = model.export_task_adapters(tmp_path / "out", rank="full", lossless=True)
    assert result.exact and set(result.weight_error.values()) == {0.0}
    folded = {f.rsplit(".", 1)[-1] if model_type == "gemma" else f.split(".layers.")[-1].split(".", 1)[-1]
              for fs in result.folded.values() for f in fs}
    assert folded == set(GEMMA.norm_consumers if model_type == "gemma" else M2M100.decoder_norm_consumers)
    peft_model = load_peft(tmp_path / "out", list(model.config.task_names), AUTO[model_type])
    batch = lm_batch(model, [0, 1, 2, 1, 0])
    names = list(model.config.task_names)
    inputs = model_inputs(model, batch)
    with torch.no_grad():
        expected = model(**inputs, task_ids=batch["task_ids"]).logits
        got = peft_model(**inputs, adapter_names=[names[i] for i in batch["task_ids"]]).logits
    assert float((got - expected).abs().max()) < FULL_RANK_ATOL


def test_without_the_norm_offset_the_gemma_export_would_be_wrong(tmp_path):
    """The offset is what makes Gemma's export exact: declared without it, the folded norms miss by the offset."""
    model = moved_apart("gemma")
    names = list(model.config.task_names)
    batch = lm_batch(model, [0, 1, 2])
    inputs = model_inputs(model, batch)
    register_backbone(replace(GEMMA, norm_weight_offset=0.0), exist_ok=True)  # the export reads the declaration
    try:
        model.export_task_adapters(tmp_path / "wrong", rank="full")
    finally:
        register_backbone(GEMMA, exist_ok=True)
    peft_model = load_peft(tmp_path / "wrong", names, AutoModelForCausalLM)
    with torch.no_grad():
        expected = model(**inputs, task_ids=batch["task_ids"]).logits
        got = peft_model(**inputs, adapter_names=[names[i] for i in batch["task_ids"]]).logits
    assert float((got - expected).abs().max()) > 100 * FULL_RANK_ATOL


@pytest.mark.parametrize("model_type", sorted(ROUTED))
def test_low_rank_experts_on_the_undeclared_lm_export_their_deltas(model_type, tmp_path):
    model = ROUTED[model_type].from_dense(dense(model_type), GENERATE, num_experts=3, expert_rank=4,
                                          selection="hard")
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    model.eval()
    batch = lm_batch(model, [0, 1, 2])
    train_step_reaches(model, batch, ("router.", "backbone."))
    result = model.export_task_adapters(tmp_path / "out")
    assert result.method == "low_rank_experts" and result.exact
    names = list(model.config.task_names)
    peft_model = load_peft(tmp_path / "out", names, AUTO[model_type])
    inputs = model_inputs(model, batch)
    with torch.no_grad():
        expected = model(**inputs, task_ids=batch["task_ids"]).logits
        got = peft_model(**inputs, adapter_names=[names[i] for i in batch["task_ids"]]).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
