"""BartTaskRouted generates what it learned: overfit tests for every seq2seq path, and the regressions of the
target / generation convention (no leading BOS or [CLS] in targets, one decoder start, no hidden loops)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForSeq2SeqLM,
    BartConfig,
    BartForConditionalGeneration,
    PreTrainedTokenizerFast,
    pipeline,
)

from hf_taskmoe import BartTaskRouted, TaskSpec, bart_from_bert
from hf_taskmoe.metrics import decode_texts
from hf_taskmoe.training.data import target_token_ids

TASKS = [TaskSpec(name="label", problem_type="seq2seq"), TaskSpec(name="reverse", problem_type="seq2seq")]
# two tasks over the same words: a label word for a phrase, and the phrase's three words reversed
EXAMPLES = [
    ("label", "a wonderful heartfelt film", "fresh"),
    ("label", "dull and lifeless", "rotten"),
    ("label", "a triumph of acting", "fresh"),
    ("label", "boring from start to end", "rotten"),
    ("reverse", "red green blue", "blue green red"),
    ("reverse", "one two three", "three two one"),
    ("reverse", "cat dog bird", "bird dog cat"),
    ("reverse", "sun moon star", "star moon sun"),
]
SELECTIONS = {  # name -> BartTaskRouted settings; "dense" is the dense path (one expert, no routing)
    "dense": dict(num_experts=1),
    "average": dict(selection="average"),
    "gumbel_softmax_st": dict(selection="gumbel_softmax_st"),
    "hard": dict(selection="hard"),
}


def bart_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with BART's own special tokens (`<s> text </s>`, `<pad>`), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = sorted({w for _, x, y in EXAMPLES for w in (x + " " + y).split()})
    vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>", *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def tiny_bart(tokenizer, convention: str) -> BartForConditionalGeneration:
    """A random tiny BART whose special tokens follow `convention`: `"bert"` ([CLS] starts the decoder, [SEP] ends,
    as `bart_from_bert` sets them) or `"bart"` (`</s>` starts the decoder, `</s>` ends, `<s>` is BOS)."""
    if convention == "bert":
        special = dict(bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id,
                       pad_token_id=tokenizer.pad_token_id, decoder_start_token_id=tokenizer.cls_token_id)
    else:
        special = dict(bos_token_id=0, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2)
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=len(tokenizer),
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        max_position_embeddings=64,
        dropout=0.0,
        **special,
    )
    return BartForConditionalGeneration(config)


def encode(model, tokenizer):
    texts = [x for _, x, _ in EXAMPLES]
    batch = tokenizer(texts, padding=True, return_tensors="pt")  # a BERT tokenizer adds token_type_ids: dropped
    targets = target_token_ids(tokenizer, [y for _, _, y in EXAMPLES], 16)
    width = max(map(len, targets))
    labels = torch.tensor([t + [-100] * (width - len(t)) for t in targets])
    task_ids = model.task_ids_for([t for t, _, _ in EXAMPLES])
    return batch, labels, task_ids


def overfit(
    model, tokenizer, lr: float, max_steps: int, check_every: int = 25, batch_rows: int | None = None
) -> tuple[list[str], int]:
    """Plain AdamW on the examples until greedy generation reproduces every target; returns (texts, steps)."""
    batch, labels, task_ids = encode(model, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    texts: list[str] = []
    for step in range(1, max_steps + 1):
        model.train()
        model.set_training_step(step)
        rows = torch.randperm(len(EXAMPLES), generator=generator)[: batch_rows or len(EXAMPLES)]
        out = model(input_ids=batch["input_ids"][rows], attention_mask=batch["attention_mask"][rows],
                    labels=labels[rows], task_ids=task_ids[rows])
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % check_every == 0:
            texts = generate(model, tokenizer)
            if texts == [y for _, _, y in EXAMPLES]:
                return texts, step
    return texts, max_steps


def generate(model, tokenizer, **kwargs) -> list[str]:
    """Greedy generation as the README shows it: the tokenizer's whole output and the task ids."""
    model.eval()
    batch, _, task_ids = encode(model, tokenizer)
    with torch.no_grad():
        generated = model.generate(**batch, task_ids=task_ids, do_sample=False, **kwargs)
    return decode_texts(generated[:, 1:], tokenizer, model.generation_config.eos_token_id)


@pytest.fixture(scope="module")
def tokenizers(minilm_tokenizer):
    return {"bert": minilm_tokenizer, "bart": bart_tokenizer()}


@pytest.mark.parametrize("convention", ["bert", "bart"])
@pytest.mark.parametrize("name", list(SELECTIONS))
def test_tiny_model_overfits_every_path(name, convention, tokenizers, tmp_path):
    tokenizer = tokenizers[convention]
    model = BartTaskRouted.from_dense(tiny_bart(tokenizer, convention), TASKS, **SELECTIONS[name])
    texts, steps = overfit(model, tokenizer, lr=3e-3, max_steps=400)
    targets = [y for _, _, y in EXAMPLES]
    assert texts == targets, f"{name}/{convention}: after {steps} steps generated {texts}"
    # the same texts through the pipeline (mixed tasks in one call) and after an AutoModelForSeq2SeqLM reload
    pipe = pipeline("multitask-text2text-generation", model=model, tokenizer=tokenizer)
    out = pipe([{"text": x, "task": t} for t, x, _ in EXAMPLES], batch_size=8)
    assert [o["generated_text"] for o in out] == targets
    model.save_pretrained(tmp_path)
    again = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    # the task-routing family's seq2seq model (BartTaskRouted's config has its model_type), the same generations
    assert type(again).__name__ == "TaskRoutedForSeq2SeqLM" and generate(again, tokenizer) == targets


def test_targets_never_begin_with_the_start_token(tokenizers):
    for convention, tokenizer in tokenizers.items():
        ids = target_token_ids(tokenizer, ["fresh", "blue green red"], max_length=3)
        first = {row[0] for row in ids}
        assert not first & {tokenizer.bos_token_id, tokenizer.cls_token_id}, convention
        assert all(
            row[-1] == (tokenizer.eos_token_id if convention == "bart" else tokenizer.sep_token_id) for row in ids
        )
        assert max(map(len, ids)) == 3  # the end token counts towards max_length
        model = BartTaskRouted.from_dense(tiny_bart(tokenizer, convention), TASKS)
        labels = torch.tensor([row + [-100] * (3 - len(row)) for row in ids])
        decoder_inputs = model.prepare_decoder_input_ids_from_labels(labels)
        assert (decoder_inputs[:, 0] == model.config.decoder_start_token_id).all()
        assert (decoder_inputs[:, 1] != model.config.decoder_start_token_id).all()  # no "[CLS] [CLS] ..." input


def test_generation_config_follows_one_convention(tokenizers):
    dense = tiny_bart(tokenizers["bart"], "bart")
    dense.generation_config.forced_bos_token_id = 0  # as facebook/bart-base ships it (its targets began with <s>)
    model = BartTaskRouted.from_dense(dense, TASKS)
    config = model.generation_config
    assert config.forced_bos_token_id is None and config.decoder_start_token_id == 2 and config.eos_token_id == 2
    assert config.max_new_tokens == 64  # not transformers' 20 positions: XSum summaries are longer
    assert dense.generation_config.forced_bos_token_id == 0  # the dense model's config is not changed
    bert = tiny_bart(tokenizers["bert"], "bert")
    model = BartTaskRouted.from_dense(bert, TASKS)
    assert model.generation_config.decoder_start_token_id == tokenizers["bert"].cls_token_id
    assert model.generation_config.eos_token_id == tokenizers["bert"].sep_token_id


def test_token_type_ids_of_a_bert_tokenizer_are_accepted(tokenizers):
    tokenizer = tokenizers["bert"]
    model = BartTaskRouted.from_dense(tiny_bart(tokenizer, "bert"), TASKS).eval()
    batch = tokenizer(["one two three", "dull and lifeless"], ["a", "b"], padding=True, return_tensors="pt")
    assert "token_type_ids" in batch and batch["token_type_ids"].any()
    task_ids = model.task_ids_for(["reverse", "label"])
    with torch.no_grad():
        out = model(**batch, task_ids=task_ids, labels=batch["input_ids"])
        without = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], task_ids=task_ids,
                        labels=batch["input_ids"])
    assert torch.equal(out.logits, without.logits)
    generated = model.generate(**batch, task_ids=task_ids, max_new_tokens=3, do_sample=False)
    assert generated.shape == (2, 4)


def test_router_choice_matters_from_the_start():
    """At initialisation the router's logits must dominate the Gumbel noise: a task's sampled route agrees with
    its arg-max route far more often than chance (1/3 with 3 experts; the old init std gave 0.36)."""
    tokenizer = bart_tokenizer()
    tasks = [TaskSpec(name=f"t{i}", problem_type="seq2seq") for i in range(5)]
    model = BartTaskRouted.from_dense(tiny_bart(tokenizer, "bart"), tasks)
    logits = model.router.task_logits().detach()
    torch.manual_seed(0)
    agree = torch.stack([
        (model.router.select(logits, training=True).argmax(-1) == logits.argmax(-1)).float().mean() for _ in range(200)
    ]).mean()
    assert agree > 0.6, agree


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SELECTIONS))
def test_minilm_warm_start_overfits(name, minilm, minilm_tokenizer):
    """`bart_from_bert` of the real MiniLM: 8 examples of 2 tasks reproduced exactly by greedy generation."""
    model = BartTaskRouted.from_dense(bart_from_bert(minilm), TASKS, **SELECTIONS[name])
    texts, steps = overfit(model, minilm_tokenizer, lr=1e-4, max_steps=300, batch_rows=6)
    assert texts == [y for _, _, y in EXAMPLES], f"{name}: after {steps} steps generated {texts}"
    pipe = pipeline("multitask-text2text-generation", model=model, tokenizer=minilm_tokenizer)
    assert pipe("cat dog bird", task="reverse")["generated_text"] == "bird dog cat"
