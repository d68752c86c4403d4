"""TaskRoutedForSeq2SeqLM: task-level routing over the encoder and decoder blocks of T5 / mT5, on tiny random
checkpoints built here: dense equivalence, save/load through the Auto classes, mixed-task batches, generation with the
key/value cache under hard and soft routes, `export_task`, learning, bf16 and the text-to-text pipeline. Plus the family
contract (`family_tester.FamilyContract`) on T5."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM, MT5Config, T5Config

import hf_taskmoe
from hf_taskmoe import TaskSpec
from hf_taskmoe.compat import T5_BLOCK_RETURNS_BIASES
from hf_taskmoe.models.task_routing import TaskRoutedForSeq2SeqLM, TaskRoutedSeq2SeqConfig
from hf_taskmoe.problem_types.seq2seq import ENCODER_DECODER_LAYOUT, text_to_text_layout

from .family_tester import FamilyCase, FamilyContract, fit

pytestmark = pytest.mark.skipif(
    not T5_BLOCK_RETURNS_BIASES,
    reason="this transformers' T5 block returns a tuple of varying length (the floor, 5.10.4): the family refuses it "
    "(tests/test_compat.py::test_task_routed_t5_is_refused_by_name_where_the_t5_block_differs)",
)

VOCAB = 40
TASKS = [TaskSpec(name=n, problem_type="seq2seq") for n in ("x", "y", "z")]
ARCHS = ["t5", "mt5"]
MIXED = torch.tensor([0, 1, 2, 1])


def dense_config(arch: str, vocab: int = VOCAB):
    small = dict(d_model=32, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, vocab_size=vocab,
                 dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    if arch == "t5":
        return T5Config(**small)
    if arch == "mt5":  # gated-GELU FFN, untied LM head
        return MT5Config(**small, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    raise ValueError(arch)


def dense_model(arch: str = "t5", seed: int = 0, vocab: int = VOCAB):
    torch.manual_seed(seed)
    return AutoModelForSeq2SeqLM.from_config(dense_config(arch, vocab)).eval()


def routed(arch: str = "t5", tasks=TASKS, **kwargs):
    kwargs.setdefault("expert_noise_variance", 0.0)
    return TaskRoutedForSeq2SeqLM.from_dense(dense_model(arch), tasks, **kwargs).eval()


def s2s_batch(model, task_ids: torch.Tensor, rows: torch.Tensor | None = None, seed: int = 0) -> dict:
    """Inputs (the last row right-padded) and targets (the last row shorter: -100) for rows of tasks `task_ids`."""
    generator = torch.Generator().manual_seed(seed)
    n = len(task_ids)
    input_ids = torch.randint(2, VOCAB, (n, 7), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[-1, -2:] = 0
    labels = torch.randint(2, VOCAB, (n, 5), generator=generator)
    labels[-1, -2:] = -100
    batch = dict(input_ids=input_ids.masked_fill(attention_mask == 0, 0), attention_mask=attention_mask,
                 labels=labels, task_ids=task_ids)
    return {k: v[rows] for k, v in batch.items()} if rows is not None else batch


def train(model, steps: int = 4, lr: float = 3e-2, seed: int = 0):
    """A few AdamW steps on a mixed batch: the experts (and the tasks' routes) move apart."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    ids = torch.arange(6) % model.config.num_tasks
    for step in range(steps):
        model(**s2s_batch(model, ids, seed=seed + step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def greedy_without_cache(model, ids, mask, task_ids, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding by a full forward (no cache) at every step: the reference the cache must reproduce. Returns
    the decoded ids and each step's logits `(batch, steps, vocab)`."""
    decoded = torch.full((len(ids), 1), model.generation_config.decoder_start_token_id)
    scores = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, decoder_input_ids=decoded, task_ids=task_ids,
                           use_cache=False).logits
        scores.append(logits[:, -1])
        decoded = torch.cat([decoded, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return decoded, torch.stack(scores, 1)


# ---------------------------------------------------------------------------------------------- config
def test_config_refuses_what_it_cannot_build():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match=r"not support model_type 'gpt2'.*\['bart', .*'mt5', .*'t5', 'umt5'\]"):
        TaskRoutedSeq2SeqConfig(dense_config=GPT2Config(), tasks=TASKS)
    with pytest.raises(ValueError, match="is not text-to-text"):
        TaskRoutedSeq2SeqConfig(dense_config=dense_config("t5"), tasks=[TaskSpec(name="c", num_labels=2)])
    with pytest.raises(ValueError, match="routed_decoder_layers"):
        TaskRoutedSeq2SeqConfig(dense_config=dense_config("t5"), tasks=TASKS, routed_decoder_layers=[2])
    with pytest.raises(ValueError, match="routed_encoder_layers"):
        TaskRoutedSeq2SeqConfig(dense_config=dense_config("t5"), tasks=TASKS, routed_layers=[0])
    config = TaskRoutedSeq2SeqConfig(dense_config=dense_config("t5"), tasks=TASKS, routed_encoder_layers=[1])
    assert config.route_names == ["E1", "D0", "D1"] and config.is_encoder_decoder
    assert text_to_text_layout(config) == ENCODER_DECODER_LAYOUT


# ---------------------------------------------------------------------------------------------- the matrix
@pytest.mark.parametrize("arch", ARCHS)
def test_fresh_model_computes_the_dense_model(arch):
    dense = dense_model(arch)
    model, report = TaskRoutedForSeq2SeqLM.from_dense(
        dense, TASKS, selection="softmax", expert_noise_variance=0.0, output_loading_info=True
    )
    model.eval()
    assert not report.unused and all(n.startswith("router.") for n in report.new), report.summary()
    assert isinstance(model.backbone, type(dense))
    batch = s2s_batch(model, MIXED)
    with torch.no_grad():
        got = model(**batch)
        expected = dense(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    got_logits = got.logits
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)
    assert set(got.task_losses) == {"x", "y", "z"}
    # greedy generation with the cache: the dense model's
    ids, mask = batch["input_ids"], batch["attention_mask"]
    got = model.generate(ids, attention_mask=mask, task_ids=MIXED, max_new_tokens=6, eos_token_id=None)
    expected = dense.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert torch.equal(got, expected)
    # a task's export is a plain model of the dense class (mT5: its untied LM head too); after training:
    # `test_save_load_through_the_auto_classes_and_export_task`
    plain = TaskRoutedForSeq2SeqLM.from_dense(dense, TASKS, expert_noise_variance=0.0).export_task("y")
    assert type(plain) is type(dense)
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids, attention_mask=mask, labels=batch["labels"]).logits,
                                   got_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("selection", ["hard", "softmax"])
def test_generation_with_the_cache_equals_decoding_without_it_after_training(selection):
    # every block routed, block 0's relative-position tables included; a small router init keeps soft routes mixed
    model = train(routed("t5", selection=selection, num_experts=2, router_init_std=0.05))
    routes = model.task_routing()
    if selection == "hard":
        assert set(routes.unique().tolist()) == {0.0, 1.0} and (routes[..., 1] == 1).any()
    else:
        assert (routes.amax(-1) < 1).all() and ((routes > 0.05) & (routes < 0.95)).any(), routes
    batch = s2s_batch(model, MIXED, seed=9)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    # the experts learned apart (their relative-position tables too): a route computes something else than expert 0
    first = model.routed_layers()[0].experts
    assert not torch.allclose(first[0].layer[0].SelfAttention.relative_attention_bias.weight,
                              first[1].layer[0].SelfAttention.relative_attention_bias.weight)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, labels=batch["labels"], task_ids=MIXED).logits
        only_first = torch.zeros(len(MIXED), model.config.num_routed_layers, 2)
        only_first[..., 0] = 1
        alone = model(ids, attention_mask=mask, labels=batch["labels"], task_ids=MIXED, routing_weights=only_first)
    assert not torch.allclose(logits, alone.logits, atol=1e-3)
    got = model.generate(ids, attention_mask=mask, task_ids=MIXED, max_new_tokens=6, eos_token_id=None,
                         return_dict_in_generate=True, output_logits=True)
    expected, scores = greedy_without_cache(model, ids, mask, MIXED, 6)
    assert torch.equal(got.sequences, expected)
    # every step's logits, not only their arg-max: the cached steps compute what a full forward computes
    torch.testing.assert_close(torch.stack(got.logits, 1), scores, atol=1e-5, rtol=1e-5)
    if selection == "hard":  # beam search reorders every expert's self- and cross-attention slot
        beams = model.generate(ids, attention_mask=mask, task_ids=MIXED, max_new_tokens=4, num_beams=2,
                               eos_token_id=None)
        assert beams.shape == (len(MIXED), 5)


def test_save_load_through_the_auto_classes_and_export_task(tmp_path, arch="t5"):
    model = train(routed(arch, selection="gumbel_softmax_st"), steps=3)
    batch = s2s_batch(model, MIXED)
    with torch.no_grad():
        expected = model(**batch)
    model.save_pretrained(tmp_path / "routed")
    assert isinstance(AutoConfig.from_pretrained(tmp_path / "routed"), TaskRoutedSeq2SeqConfig)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "routed").eval()  # AutoModel: the family contract
    assert type(loaded) is TaskRoutedForSeq2SeqLM and loaded.config.dense_config.model_type == arch
    with torch.no_grad():
        got = loaded(**batch)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=0)
    dense_class = type(model.backbone)
    plain_inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    for t, task in enumerate(model.config.task_names):
        plain = model.export_task(task)
        assert type(plain) is dense_class and plain.config.hf_taskmoe_task == task
        rows = torch.full((len(MIXED),), t)
        with torch.no_grad():
            torch.testing.assert_close(plain(**plain_inputs).logits, model(**plain_inputs, task_ids=rows).logits,
                                       atol=1e-5, rtol=1e-5)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        assert torch.equal(plain.generate(ids, attention_mask=mask, max_new_tokens=5, eos_token_id=None),
                           model.generate(ids, attention_mask=mask, task_ids=rows, max_new_tokens=5, eos_token_id=None))
    plain.save_pretrained(tmp_path / "plain")
    assert type(AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "plain")) is dense_class
    soft = routed(arch, selection="softmax")
    with pytest.raises(ValueError, match="soft route"):
        soft.export_task("x")
    assert type(soft.export_task("x", force_argmax=True)) is dense_class


def test_a_forward_with_the_cache_equals_one_without_where_block_0_takes_another_expert():
    # a fresh cache's first forward (what `model(...)` in eval does, and peft's comparison with an export): the later
    # experts of decoder block 0 read their own slot's past length (0) for their position bias, not expert 0's slot,
    # filled a moment before (a regression: the routed cache's fallback to a filled slot gave them an offset)
    model = routed("t5", num_experts=3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    decoder_block_0 = len(model.config.encoder_route_layers)
    weights = torch.zeros(3, model.config.num_routed_layers, 3)
    weights[torch.arange(3), :, torch.arange(3)] = 1  # task t takes expert t at every block
    batch = s2s_batch(model, MIXED)
    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  decoder_input_ids=batch["labels"].clamp(min=0))
    rows = weights[MIXED]
    with torch.no_grad():
        cached = model(**inputs, task_ids=MIXED, routing_weights=rows, use_cache=True).logits
        plain = model(**inputs, task_ids=MIXED, routing_weights=rows, use_cache=False).logits
    assert rows[:, decoder_block_0].argmax(-1).tolist() == [0, 1, 2, 1]
    torch.testing.assert_close(cached, plain, atol=1e-5, rtol=1e-5)


def test_bf16_autocast_and_every_selection_and_router():
    model = routed("t5", selection="hard").train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**s2s_batch(model, MIXED))
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    combinations = [(s, "mlp") for s in ("average", "softmax", "gumbel_softmax", "gumbel_softmax_st", "hard")]
    for selection, router_type in combinations + [("gumbel_softmax_st", "lstm"), ("softmax", "transformer")]:
        model = routed("t5", selection=selection, router_type=router_type, routed_encoder_layers=[1],
                       routed_decoder_layers=[0]).train()
        out = model(**s2s_batch(model, MIXED), output_router_logits=True)
        out.loss.backward()
        assert out.routing_decisions.shape == (4, 2, 3) and out.routing_counts.shape == (2, 3, 3)
        assert model.router.task_embeddings.weight.grad is not None or selection == "average"


def test_inputs_are_checked_and_the_encoder_needs_task_ids():
    model = routed("t5")
    batch = s2s_batch(model, MIXED)
    with pytest.raises(ValueError, match="task"):
        model(**{**batch, "task_ids": torch.tensor([0, 1, 2, 3])})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(**{**batch, "labels": batch["labels"].index_fill(1, torch.tensor([0]), VOCAB)})
    with pytest.raises(ValueError, match="task_ids` is required"):
        model.generate(batch["input_ids"], max_new_tokens=2)
    with pytest.raises(ValueError, match="static cache"):
        model.generate(batch["input_ids"], task_ids=MIXED, max_new_tokens=2, cache_implementation="static")
    assert model.task_context.task_ids is None  # nothing of a failed call stays behind


# ---------------------------------------------------------------------------------------------- data and pipeline
WORDS = ["one", "two", "three", "four", "red", "green", "blue", "cat", "dog", "sun", "moon", "fresh", "rotten"]
EXAMPLES = [  # (task, input, target)
    ("x", "one two", "fresh"),
    ("x", "red green blue", "rotten"),
    ("y", "cat dog", "dog cat"),
    ("y", "sun moon", "moon sun"),
]


def word_tokenizer():
    """A word-level tokenizer with BERT's special tokens (`[CLS] text [SEP]`), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", unk_token="[UNK]"
    )


def test_learns_a_few_examples_and_generates_them_through_the_pipeline():
    from datasets import Dataset
    from transformers import pipeline

    from hf_taskmoe.pipelines import TEXT2TEXT_PIPELINE_TASK
    from hf_taskmoe.training.batches import MultiTaskCollator
    from hf_taskmoe.training.data import tokenize_task

    tokenizer = word_tokenizer()
    tasks = [TaskSpec(name="x", problem_type="seq2seq"), TaskSpec(name="y", problem_type="seq2seq")]
    torch.manual_seed(0)
    dense = AutoModelForSeq2SeqLM.from_config(T5Config(
        d_model=32, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, vocab_size=len(tokenizer),
        dropout_rate=0.0, decoder_start_token_id=2, pad_token_id=0, eos_token_id=3,  # start [CLS], end [SEP]
    ))
    model = TaskRoutedForSeq2SeqLM.from_dense(dense, tasks, selection="gumbel_softmax_st", num_experts=2)
    layout = text_to_text_layout(model)
    rows = []
    for t, spec in enumerate(tasks):
        data = Dataset.from_dict({"sentence": [p for n, p, _ in EXAMPLES if n == spec.name],
                                  "label": [c for n, _, c in EXAMPLES if n == spec.name]})
        rows.extend(tokenize_task(spec, data, tokenizer, t, max_length=16, layout=layout))
    batch = MultiTaskCollator(pad_token_id=0)(rows)
    losses = fit(model, batch, steps=40, lr=1e-2)
    assert losses[-1] < 0.1 * losses[0], losses[::5]
    model.eval()
    pipe = pipeline(TEXT2TEXT_PIPELINE_TASK, model=model, tokenizer=tokenizer)
    got = pipe([{"text": p, "task": n} for n, p, _ in EXAMPLES], max_new_tokens=4)
    assert [g["generated_text"] for g in got] == [c for _, _, c in EXAMPLES]
    assert [g["task"] for g in got] == [n for n, _, _ in EXAMPLES]


# ---------------------------------------------------------------------------------------------- the family contract
def _contract_case(arch: str) -> FamilyCase:
    def equivalence():
        dense = dense_model(arch)
        fresh = TaskRoutedForSeq2SeqLM.from_dense(dense, TASKS, selection="softmax", expert_noise_variance=0.0).eval()
        batch = s2s_batch(fresh, torch.arange(6) % 3)

        def reference(model):
            with torch.no_grad():
                return model(**batch).logits, dense(**{k: batch[k] for k in ("input_ids", "attention_mask",
                                                                              "labels")}).logits

        return fresh, reference

    return FamilyCase(
        f"task_routed_t5[{arch}]",
        TASKS,
        lambda tasks: TaskRoutedForSeq2SeqLM.from_dense(dense_model(arch), tasks, selection="gumbel_softmax_st"),
        s2s_batch,
        TaskSpec(name="w", problem_type="seq2seq"),
        learns_steps=40,
        learns_lr=1e-2,
        dense_equivalent=equivalence,
        extra={
            "layers": {
                "encoder_hidden_states": "num_layers",
                "encoder_attentions": "num_layers",
                "decoder_hidden_states": "num_decoder_layers",
                "decoder_attentions": "num_decoder_layers",
                "cross_attentions": "num_decoder_layers",
            }
        },
    )


@pytest.fixture(params=["t5"])  # mT5: the matrix above
def contract_arch(request):
    return request.param


class TestContract(FamilyContract):
    @pytest.fixture(autouse=True)
    def _case(self, contract_arch):
        self.case = _contract_case(contract_arch)


def test_public_names():
    assert hf_taskmoe.TaskRoutedForSeq2SeqLM is TaskRoutedForSeq2SeqLM
    assert hf_taskmoe.TaskRoutedSeq2SeqConfig is TaskRoutedSeq2SeqConfig
    family = hf_taskmoe.models.family_for("bart_routed", "mt5")
    assert family.model_class is TaskRoutedForSeq2SeqLM and family.method == "task-routing"
