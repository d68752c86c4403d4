"""TaskRoutedForCausalLM: task-level routing over the layers of decoder-only causal LMs (GPT-2, Llama, Qwen2, Mistral),
on tiny random checkpoints built here: dense equivalence, save/load through the Auto classes, mixed-task batches,
generation with the key/value cache under hard and soft routes, `export_task`, learning, bf16, the causal data layout
and the text-to-text pipeline. Plus the family contract (`family_tester.FamilyContract`) on GPT-2."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

import hf_taskmoe
from hf_taskmoe import TaskSpec
from hf_taskmoe.backbones import backbone_names, get_backbone
from hf_taskmoe.models.task_routing import TaskRoutedForCausalLM, TaskRoutedLMConfig
from hf_taskmoe.problem_types.seq2seq import CAUSAL_LAYOUT, text_to_text_layout

from .family_tester import FamilyCase, FamilyContract, fit

VOCAB = 40
TASKS = [TaskSpec(name=n, problem_type="seq2seq") for n in ("x", "y", "z")]
SPECIAL = dict(bos_token_id=2, eos_token_id=3, pad_token_id=0)


def dense_config(arch: str):
    if arch == "gpt2":
        return GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, vocab_size=VOCAB, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, **SPECIAL)
    small = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, **SPECIAL)
    if arch == "llama":
        return LlamaConfig(**small)
    if arch == "qwen2":  # a sliding window on the second layer: the cache keeps a layer of each kind
        return Qwen2Config(**small, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    if arch == "mistral":
        return MistralConfig(**small, sliding_window=None)
    raise ValueError(arch)


ARCHS = ["gpt2", "llama", "qwen2", "mistral"]


def dense_model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(dense_config(arch)).eval()


def routed(arch: str, tasks=TASKS, **kwargs):
    kwargs.setdefault("expert_noise_variance", 0.0)
    return TaskRoutedForCausalLM.from_dense(dense_model(arch), tasks, **kwargs).eval()


def lm_batch(model, task_ids: torch.Tensor, rows: torch.Tensor | None = None, seed: int = 0) -> dict:
    """Prompt + target rows: ids in [4, VOCAB), the first 3 tokens of each row a prompt (label -100), the last row
    shorter (right padding, label -100)."""
    generator = torch.Generator().manual_seed(seed)
    n = len(task_ids)
    input_ids = torch.randint(4, VOCAB, (n, 9), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[-1, -3:] = 0
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :3] = -100
    batch = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels, task_ids=task_ids)
    return {k: v[rows] for k, v in batch.items()} if rows is not None else batch


def prompts(n: int = 4, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of different lengths (what a decoder-only model generates from)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (n, 6), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[-1, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


MIXED = torch.tensor([0, 1, 2, 1])


def train(model, steps: int = 4, lr: float = 3e-2, seed: int = 0):
    """A few AdamW steps on a mixed batch: the experts (and the tasks' routes) move apart."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    ids = torch.arange(6) % model.config.num_tasks
    for step in range(steps):
        loss = model(**lm_batch(model, ids, seed=seed + step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


# ---------------------------------------------------------------------------------------------- declarations
@pytest.mark.parametrize("arch", ARCHS + ["t5"])
def test_declared_paths_resolve(arch):
    from transformers import AutoModel, T5Config

    declared = get_backbone(arch)
    if arch == "t5":
        base = AutoModel.from_config(T5Config(d_model=32, d_ff=48, num_layers=2, num_heads=2, d_kv=8, vocab_size=VOCAB))
    else:
        base = dense_model(arch).base_model
    layer = base.get_submodule(declared.layers)[0]
    for path in (declared.ffn.module, declared.attention, declared.attention_output, *declared.norms):
        layer.get_submodule(path)
    assert isinstance(layer.get_submodule(declared.attention).layer_idx, int)
    if declared.decoder_layers:  # a T5 decoder block: self-attention first, its FFN last (`layer.2`)
        decoder_layer = base.get_submodule(declared.decoder_layers)[0]
        assert isinstance(decoder_layer.get_submodule(declared.attention).layer_idx, int)
    base.get_submodule(declared.embeddings)


def test_config_refuses_what_it_cannot_build():
    from transformers import BertConfig

    with pytest.raises(ValueError, match=r"not support model_type 'bert'.*'gpt2', .*'llama', .*'mistral', .*'qwen2'"):
        TaskRoutedLMConfig(dense_config=BertConfig(), tasks=TASKS)
    with pytest.raises(ValueError, match="is not text-to-text"):
        TaskRoutedLMConfig(dense_config=dense_config("gpt2"), tasks=[TaskSpec(name="c", num_labels=2)])
    with pytest.raises(ValueError, match="routed_layers"):
        TaskRoutedLMConfig(dense_config=dense_config("gpt2"), tasks=TASKS, routed_layers=[2])
    assert set(ARCHS) <= set(backbone_names("decoder"))  # the later ones: tests/test_backbones_new.py
    assert text_to_text_layout(TaskRoutedLMConfig(dense_config=dense_config("gpt2"), tasks=TASKS)) == CAUSAL_LAYOUT


# ---------------------------------------------------------------------------------------------- the matrix
@pytest.mark.parametrize("arch", ARCHS)
def test_fresh_model_computes_the_dense_model(arch):
    dense = dense_model(arch)
    model, report = TaskRoutedForCausalLM.from_dense(
        dense, TASKS, selection="softmax", expert_noise_variance=0.0, output_loading_info=True
    )
    model.eval()
    assert not report.unused and all(n.startswith("router.") for n in report.new), report.summary()
    assert isinstance(model.backbone, type(dense))
    batch = lm_batch(model, MIXED)
    with torch.no_grad():
        got = model(**batch)
        expected = dense(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)
    assert set(got.task_losses) == {"x", "y", "z"}


@pytest.mark.parametrize("arch", ARCHS)
def test_generation_at_initialisation_is_the_dense_models(arch):
    dense = dense_model(arch)
    model = TaskRoutedForCausalLM.from_dense(dense, TASKS, selection="gumbel_softmax_st", expert_noise_variance=0.0)
    model.eval()
    ids, mask = prompts()
    got = model.generate(ids, attention_mask=mask, task_ids=MIXED, max_new_tokens=6, do_sample=False)
    expected = dense.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, expected)


def greedy_without_cache(model, ids, mask, task_ids, steps: int) -> torch.Tensor:
    """Greedy decoding by a full forward (no cache) at every step: the reference the cache must reproduce."""
    for _ in range(steps):
        position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, position_ids=position_ids, task_ids=task_ids,
                           use_cache=False).logits
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return ids


@pytest.mark.parametrize("selection", ["hard", "softmax"])
@pytest.mark.parametrize("arch", ARCHS)
def test_generation_with_the_cache_equals_decoding_without_it_after_training(arch, selection):
    # a small router init keeps the soft routes mixed (every expert counts in every layer)
    model = train(routed(arch, selection=selection, num_experts=2, router_init_std=0.05))
    routes = model.task_routing()
    if selection == "hard":
        assert set(routes.unique().tolist()) == {0.0, 1.0}
    else:
        assert (routes.amax(-1) < 1).all() and ((routes > 0.05) & (routes < 0.95)).any(), routes
    # the experts learned apart: a mixed route computes something else than expert 0 alone
    ids, mask = prompts()
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, task_ids=MIXED).logits
        only_first = torch.zeros(len(MIXED), model.config.num_routed_layers, 2)
        only_first[..., 0] = 1
        first = model(ids, attention_mask=mask, task_ids=MIXED, routing_weights=only_first).logits
    assert not torch.allclose(logits, first, atol=1e-3)
    got = model.generate(ids, attention_mask=mask, task_ids=MIXED, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert torch.equal(got, greedy_without_cache(model, ids, mask, MIXED, 6))
    if arch == "llama" and selection == "hard":  # beam search reorders every expert's cache slot
        beams = model.generate(ids, attention_mask=mask, task_ids=MIXED, max_new_tokens=4, num_beams=2)
        assert beams.shape == (len(MIXED), ids.shape[1] + 4)


@pytest.mark.parametrize("arch", ARCHS)
def test_save_load_through_the_auto_classes(arch, tmp_path):
    model = train(routed(arch, selection="gumbel_softmax_st"), steps=2)
    batch = lm_batch(model, MIXED)
    with torch.no_grad():
        expected = model(**batch)
    model.save_pretrained(tmp_path)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), TaskRoutedLMConfig)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is TaskRoutedForCausalLM and loaded.config.dense_config.model_type == arch
    with torch.no_grad():
        got = loaded(**batch)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_export_task_gives_a_plain_model_of_the_dense_class(arch, tmp_path):
    model = train(routed(arch, selection="gumbel_softmax_st"))
    dense_class = type(model.backbone)
    ids, mask = prompts()
    for t, task in enumerate(model.config.task_names):
        plain = model.export_task(task)
        assert type(plain) is dense_class and plain.config.hf_taskmoe_task == task
        rows = torch.full((len(ids),), t)
        with torch.no_grad():
            torch.testing.assert_close(
                plain(ids, attention_mask=mask).logits, model(ids, attention_mask=mask, task_ids=rows).logits,
                atol=1e-5, rtol=1e-5,
            )
    plain.save_pretrained(tmp_path)
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)) is dense_class
    # the special tokens set on the routed model after it was built (run_multitask.py sets its tokenizer's) travel
    model.config.eos_token_id, model.config.pad_token_id = [3, 5], 4
    plain = model.export_task(model.config.task_names[0])
    assert (plain.config.eos_token_id, plain.config.pad_token_id) == ([3, 5], 4)
    soft = routed(arch, selection="softmax")
    with pytest.raises(ValueError, match="soft route"):
        soft.export_task("x")
    assert type(soft.export_task("x", force_argmax=True)) is dense_class


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_autocast_training_step(arch):
    model = routed(arch, selection="hard").train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**lm_batch(model, MIXED))
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_every_selection_and_router_runs_and_routes_per_task():
    for selection in ("average", "softmax", "gumbel_softmax", "gumbel_softmax_st", "hard"):
        for router_type in ("mlp", "lstm", "transformer"):
            model = routed("llama", selection=selection, router_type=router_type, routed_layers=[1]).train()
            out = model(**lm_batch(model, MIXED), output_router_logits=True)
            out.loss.backward()
            assert out.routing_decisions.shape == (4, 1, 3) and out.routing_counts.shape == (1, 3, 3)
            assert model.router.task_embeddings.weight.grad is not None or selection == "average"


def test_labels_and_inputs_are_checked_before_compute():
    model = routed("gpt2")
    batch = lm_batch(model, MIXED)
    with pytest.raises(ValueError, match="task"):
        model(**{**batch, "task_ids": torch.tensor([0, 1, 2, 3])})
    with pytest.raises(ValueError, match="labels"):
        model(**{**batch, "labels": torch.cat([batch["labels"], batch["labels"]], 1)})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(**{**batch, "labels": batch["labels"].masked_fill(batch["labels"] == 5, VOCAB)})
    # labels narrower than the inputs (a collator's `pad_to_multiple_of`): the rest has no loss
    wide = {**batch, "input_ids": torch.nn.functional.pad(batch["input_ids"], (0, 3)),
            "attention_mask": torch.nn.functional.pad(batch["attention_mask"], (0, 3))}
    with torch.no_grad():
        torch.testing.assert_close(model(**wide).loss, model(**batch).loss)


def test_hidden_states_and_attentions_count_layers_not_experts():
    model = routed("llama", num_experts=2)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(**lm_batch(model, MIXED), output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == 3 and len(out.attentions) == 2
    torch.testing.assert_close(out.attentions[-1].sum(-1), torch.ones_like(out.attentions[-1].sum(-1)))


# ---------------------------------------------------------------------------------------------- data and pipeline
WORDS = ["one", "two", "three", "four", "red", "green", "blue", "cat", "dog", "sun", "moon", "fresh", "rotten"]
EXAMPLES = [  # (task, prompt, continuation)
    ("x", "one two", "fresh"),
    ("x", "red green blue", "rotten"),
    ("y", "cat dog", "dog cat"),
    ("y", "sun moon", "moon sun"),
]


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with BERT's special tokens (`[CLS] text [SEP]`), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", unk_token="[UNK]"
    )


def test_causal_layout_learns_a_few_examples_and_generates_them_through_the_pipeline(tmp_path):
    from datasets import Dataset
    from transformers import pipeline

    from hf_taskmoe.pipelines import TEXT2TEXT_PIPELINE_TASK
    from hf_taskmoe.training.batches import MultiTaskCollator
    from hf_taskmoe.training.data import tokenize_task

    tokenizer = word_tokenizer()
    tasks = [TaskSpec(name="x", problem_type="seq2seq"), TaskSpec(name="y", problem_type="seq2seq")]
    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(GPT2Config(
        n_embd=32, n_layer=2, n_head=2, n_positions=32, vocab_size=len(tokenizer), resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=2, eos_token_id=3, pad_token_id=0,
    ))
    model = TaskRoutedForCausalLM.from_dense(dense, tasks, selection="gumbel_softmax_st", num_experts=2)
    layout = text_to_text_layout(model)
    rows = []
    for t, spec in enumerate(tasks):
        data = Dataset.from_dict({"sentence": [p for n, p, _ in EXAMPLES if n == spec.name],
                                  "label": [c for n, _, c in EXAMPLES if n == spec.name]})
        rows.extend(tokenize_task(spec, data, tokenizer, t, max_length=16, layout=layout))
    first = rows[0]  # [CLS] one two [SEP] | fresh [SEP]: the loss on the continuation and its end only
    assert first["input_ids"] == [2, 4, 5, 3, 15, 3] and first["labels"] == [-100] * 4 + [15, 3]
    batch = MultiTaskCollator(pad_token_id=0, pad_to_multiple_of=4)(rows)
    losses = fit(model, batch, steps=30, lr=1e-2)
    assert losses[-1] < 0.25 * losses[0], losses[::5]
    model.eval()
    pipe = pipeline(TEXT2TEXT_PIPELINE_TASK, model=model, tokenizer=tokenizer)
    got = pipe([{"text": p, "task": n} for n, p, _ in EXAMPLES], max_new_tokens=4)
    assert [g["generated_text"] for g in got] == [c for _, _, c in EXAMPLES]
    assert [g["task"] for g in got] == [n for n, _, _ in EXAMPLES]


# ---------------------------------------------------------------------------------------------- the family contract
def _contract_case(arch: str) -> FamilyCase:
    def equivalence():
        dense = dense_model(arch)
        fresh = TaskRoutedForCausalLM.from_dense(dense, TASKS, selection="softmax", expert_noise_variance=0.0).eval()
        batch = lm_batch(fresh, torch.arange(6) % 3)

        def reference(model):
            with torch.no_grad():
                return model(**batch).logits, dense(input_ids=batch["input_ids"],
                                                    attention_mask=batch["attention_mask"]).logits

        return fresh, reference

    return FamilyCase(
        f"task_routed_lm[{arch}]",
        TASKS,
        lambda tasks: TaskRoutedForCausalLM.from_dense(dense_model(arch), tasks, selection="gumbel_softmax_st"),
        lm_batch,
        TaskSpec(name="w", problem_type="seq2seq"),
        learns_steps=40,
        learns_lr=1e-2,
        dense_equivalent=equivalence,
        # hidden states and attentions: `test_hidden_states_and_attentions_count_layers_not_experts`
    )


@pytest.fixture(params=["gpt2"])  # the other architectures: the matrix above
def contract_arch(request):
    return request.param


class TestContract(FamilyContract):
    @pytest.fixture(autouse=True)
    def _case(self, contract_arch):
        self.case = _contract_case(contract_arch)


def test_public_names():
    assert hf_taskmoe.TaskRoutedForCausalLM is TaskRoutedForCausalLM
    assert hf_taskmoe.TaskRoutedLMConfig is TaskRoutedLMConfig
    family = hf_taskmoe.models.family_for("bart_routed", "qwen2")
    assert family.model_class is TaskRoutedForCausalLM and family.method == "task-routing"
