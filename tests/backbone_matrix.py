"""The encoder architectures every backbone-generic method is tested on: a tiny random dense config of each
(dropout off), built here, never downloaded; batches for them; and `method_cases`, which turns a method into one
`FamilyCase` per architecture for the shared family contract (`family_tester.FamilyContract`).

Adding an architecture: declare it (`hf_taskmoe.backbones.register_backbone`) and add its tiny config here."""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers
from transformers import AutoModel

from hf_taskmoe import TaskSpec
from hf_taskmoe.backbones import get_backbone

from .family_tester import FamilyCase

VOCAB = 60
_SIZES = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, vocab_size=VOCAB)
_BERT_LIKE = dict(_SIZES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=40)

#: a tiny dense config of every declared encoder architecture
ENCODER_CONFIGS: dict[str, Callable[[], transformers.PreTrainedConfig]] = {
    "bert": lambda: transformers.BertConfig(**_BERT_LIKE),
    "roberta": lambda: transformers.RobertaConfig(**_BERT_LIKE, pad_token_id=1),
    "xlm-roberta": lambda: transformers.XLMRobertaConfig(**_BERT_LIKE, pad_token_id=1),
    "electra": lambda: transformers.ElectraConfig(**_BERT_LIKE, embedding_size=8),
    "distilbert": lambda: transformers.DistilBertConfig(
        dim=16, n_layers=2, n_heads=2, hidden_dim=32, vocab_size=VOCAB, dropout=0.0, attention_dropout=0.0,
        max_position_embeddings=40,
    ),
    "deberta-v2": lambda: transformers.DebertaV2Config(
        **_BERT_LIKE, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"]
    ),
    "modernbert": lambda: transformers.ModernBertConfig(
        **_SIZES, max_position_embeddings=40, global_attn_every_n_layers=2, local_attention=4, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, mask_token_id=3, attention_dropout=0.0,
        mlp_dropout=0.0, embedding_dropout=0.0,
    ),
}
ENCODER_ARCHS = list(ENCODER_CONFIGS)

# ---------------------------------------------------------------------------------------- the newer architectures
#: special tokens inside the tiny vocabularies (transformers' defaults, 32000 and so on, are out of range)
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_DEC = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=64, **SPECIAL)
_S2S = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=48, decoder_ffn_dim=48, vocab_size=VOCAB, max_position_embeddings=64, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0, decoder_start_token_id=2, forced_eos_token_id=None,
            **SPECIAL)
#: two layers of each kind where an architecture alternates sliding-window and global attention
_SLIDING = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4, head_dim=8)

#: a tiny dense config of each architecture declared after the first fourteen (issue 57), from transformers' own config
#: classes, dropout off: the smoke matrix (`tests/test_backbones_new.py`) runs on every one in the default run, the
#: full family contract under `-m slow`
NEW_CONFIGS: dict[str, Callable[[], transformers.PreTrainedConfig]] = {
    # encoders
    "camembert": lambda: transformers.CamembertConfig(**_BERT_LIKE, pad_token_id=1),
    "data2vec-text": lambda: transformers.Data2VecTextConfig(**_BERT_LIKE, pad_token_id=1),
    "ernie": lambda: transformers.ErnieConfig(**_BERT_LIKE),
    "rembert": lambda: transformers.RemBertConfig(
        **_BERT_LIKE, input_embedding_size=8, output_embedding_size=8, classifier_dropout_prob=0.0
    ),
    "xlm-roberta-xl": lambda: transformers.XLMRobertaXLConfig(**_BERT_LIKE, pad_token_id=1),
    "mpnet": lambda: transformers.MPNetConfig(**_BERT_LIKE, pad_token_id=1),
    "albert": lambda: transformers.AlbertConfig(**_BERT_LIKE, embedding_size=8, classifier_dropout_prob=0.0),
    # decoders
    "qwen3": lambda: transformers.Qwen3Config(**_DEC, head_dim=8),
    "granite": lambda: transformers.GraniteConfig(**_DEC, residual_multiplier=0.5, embedding_multiplier=2.0),
    "smollm3": lambda: transformers.SmolLM3Config(**_DEC, no_rope_layers=[1, 0]),
    "phi3": lambda: transformers.Phi3Config(**_DEC, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
    "stablelm": lambda: transformers.StableLmConfig(**_DEC, hidden_dropout=0.0, attention_dropout=0.0),
    "gemma2": lambda: transformers.Gemma2Config(**_DEC, **_SLIDING),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**_DEC, **_SLIDING),
    "olmo2": lambda: transformers.Olmo2Config(**_DEC),
    "starcoder2": lambda: transformers.Starcoder2Config(**_DEC, residual_dropout=0.0, embedding_dropout=0.0),
    # logits unscaled (Command-R scales them by 1/16): the contract's "learns a few examples" in 40 steps
    "cohere": lambda: transformers.CohereConfig(**_DEC, logit_scale=1.0),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(
        **{k: v for k, v in _DEC.items() if k != "num_key_value_heads"}, hidden_dropout=0.0, attention_dropout=0.0
    ),
    "falcon": lambda: transformers.FalconConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB, hidden_dropout=0.0,
        attention_dropout=0.0, **SPECIAL,
    ),
    # encoder-decoders
    "mbart": lambda: transformers.MBartConfig(**_S2S),
    "pegasus": lambda: transformers.PegasusConfig(**_S2S),
    "marian": lambda: transformers.MarianConfig(**_S2S),
    "longt5": lambda: transformers.LongT5Config(
        d_model=32, d_ff=48, num_layers=2, num_heads=2, d_kv=8, vocab_size=VOCAB, dropout_rate=0.0, local_radius=2,
        global_block_size=2, decoder_start_token_id=0, **SPECIAL,
    ),
    "umt5": lambda: transformers.UMT5Config(
        d_model=32, d_ff=48, num_layers=2, num_heads=2, d_kv=8, vocab_size=VOCAB, dropout_rate=0.0,
        decoder_start_token_id=0, **SPECIAL,
    ),
}
NEW_ARCHS = list(NEW_CONFIGS)
TASKS = [TaskSpec(name="a", num_labels=3), TaskSpec(name="b", problem_type="regression")]
NEW_TASK = TaskSpec(name="c", num_labels=2)
#: output fields that count the layers (`test_hidden_states_and_attentions_as_arguments_and_from_the_config`)
LAYERS = {"hidden_states": "num_hidden_layers", "attentions": "num_hidden_layers"}


def dense_config(arch: str):
    return (ENCODER_CONFIGS.get(arch) or NEW_CONFIGS[arch])()


def dense_model(arch: str):
    """The tiny dense base model of `arch`, seeded."""
    torch.manual_seed(0)
    return AutoModel.from_config(dense_config(arch)).eval()


def token_batch(model_type: str, vocab: int, ids: torch.Tensor, seq: int = 9, seed: int = 0) -> dict:
    """Token inputs for rows of tasks `ids`: the first row padded, segment ids where the architecture has them."""
    g = torch.Generator().manual_seed(seed)
    batch = {"input_ids": torch.randint(4, vocab, (len(ids), seq), generator=g),
             "attention_mask": torch.ones(len(ids), seq, dtype=torch.long), "task_ids": torch.as_tensor(ids)}
    batch["attention_mask"][0, -3:] = 0
    if get_backbone(model_type).segment_ids and getattr(dense_config(model_type), "type_vocab_size", 2) > 1:
        batch["token_type_ids"] = (torch.arange(seq) >= seq // 2).long().expand(len(ids), seq).clone()
    return batch


def labelled_batch(model, ids, rows=None, seed=0) -> dict:
    """`token_batch` plus a label per row in its task's format (the family contract's `batch`)."""
    config = model.config
    batch = token_batch(config.dense_config.model_type, config.vocab_size, ids, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    specs = config.task_specs
    batch["labels"] = torch.tensor([
        float(torch.randint(0, specs[t].num_labels, (1,), generator=g)) if specs[t].problem_type != "regression"
        else float(torch.randn(1, generator=g)) for t in torch.as_tensor(ids).tolist()
    ])
    return batch if rows is None else {k: v[rows] for k, v in batch.items()}


def dense_equivalence(model_cls, arch: str, **from_dense_kwargs):
    """`FamilyCase.dense_equivalent`: a model built with `from_dense` on `arch`'s dense model, and a reference that
    compares their last hidden states on the real tokens of a mixed-task batch."""

    def build():
        dense = dense_model(arch)
        fresh = model_cls.from_dense(dense, tasks=TASKS, **from_dense_kwargs).eval()

        def reference(model):
            batch = token_batch(arch, VOCAB, torch.tensor([0, 1, 0, 1]))
            plain = {k: v for k, v in batch.items() if k != "task_ids"}
            with torch.no_grad():
                got = model(**batch, output_hidden_states=True).hidden_states[-1]
                expected = dense(**plain).last_hidden_state
            mask = batch["attention_mask"].bool()
            return got[mask], expected[mask]

        return fresh, reference

    return build


def method_cases(method: str, model_cls, config_cls, archs=None, config_kwargs=None, from_dense_kwargs=None,
                 dense_equivalent: bool = True, **case_kwargs) -> dict[str, FamilyCase]:
    """One `FamilyCase` per architecture for a backbone-generic method (`"<method>-<arch>"`)."""
    config_kwargs = config_kwargs or {}
    cases = {}
    for arch in archs or ENCODER_ARCHS:
        def build(tasks, arch=arch):
            return model_cls(config_cls(dense_config=dense_config(arch), tasks=tasks, **config_kwargs))

        cases[f"{method}-{arch}"] = FamilyCase(
            f"{method}-{arch}", TASKS, build, labelled_batch, NEW_TASK,
            dense_equivalent=dense_equivalence(model_cls, arch, **(from_dense_kwargs or config_kwargs))
            if dense_equivalent else None,
            extra={"layers": LAYERS, "arch": arch}, **case_kwargs,
        )
    return cases
