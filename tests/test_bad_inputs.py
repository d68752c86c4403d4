"""Every bad input raises a ValueError that names what is wrong, before any layer runs."""

import pytest
import torch

from hf_taskmoe import BertForTaskMoE, BertTaskMoEConfig, TaskSpec

from .conftest import ALL_KINDS, TINY, random_batch, tiny_config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return BertForTaskMoE(tiny_config(tasks=ALL_KINDS[:3])).eval()  # sst2 (2 classes), mnli (3), stsb (regression)


def _batch(model, **changes):
    batch = random_batch(model.config, batch=4, seq=7, task_ids=torch.tensor([0, 1, 2, 0]))
    batch["labels"] = torch.tensor([1.0, 2.0, 0.5, 0.0])
    batch.update(changes)
    return {k: v for k, v in batch.items() if v is not None}


CASES = {
    "missing task_ids": (dict(task_ids=None), r"`task_ids` is required: this model has 3 tasks"),
    "task id out of range": (
        dict(task_ids=torch.tensor([0, 1, 3, 0])),
        r"Only 3 tasks available.*found task id = 3 \(row 2\)",
    ),
    "negative task id": (dict(task_ids=torch.tensor([0, -1, 2, 0])), r"found task id = -1"),
    "float task ids": (dict(task_ids=torch.tensor([0.0, 1.0, 2.0, 0.0])), r"`task_ids` must be an integer tensor"),
    "task_ids batch mismatch": (
        dict(task_ids=torch.tensor([0, 1, 2])),
        r"`task_ids` must have shape \(batch,\) = \(4,\)",
    ),
    "class index >= num_labels": (
        dict(labels=torch.tensor([2.0, 2.0, 0.5, 0.0])),
        r"task 'sst2' must be in \[0, 2\).*rows \[0\]",
    ),
    "regression labels not float": (
        dict(task_ids=torch.tensor([2, 2, 2, 2]), labels=torch.tensor([1, 2, 3, 4])),
        r"regression task 'stsb' must be floating point",
    ),
    "one-hot labels for a single-label task": (
        dict(task_ids=torch.tensor([0, 0, 0, 0]), labels=torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0]])),
        r"single-label task 'sst2' must have shape \(batch,\) or \(batch, 1\), got \(4, 2\)",
    ),
    "three targets for a one-output regression": (
        dict(task_ids=torch.tensor([2, 2, 2, 2]), labels=torch.rand(4, 3)),
        r"regression task 'stsb' must have shape \(batch,\) or \(batch, 1\), got \(4, 3\)",
    ),
    "task names as task_ids": (
        dict(task_ids=["sst2", "mnli", "stsb", "sst2"]),
        r"`task_ids` must hold task indices.*got task names.*torch.tensor\(\[0, 1, 2, 0\]\)",
    ),
    "unknown task name as task_ids": (dict(task_ids=["sst2", "cola", "stsb", "sst2"]), r"'cola' is not one of"),
    "labels batch mismatch": (dict(labels=torch.tensor([1.0, 2.0, 0.5])), r"`labels` must have 4 rows"),
    "attention_mask shape": (
        dict(attention_mask=torch.ones(4, 6, dtype=torch.long)),
        r"`attention_mask` must have shape \(batch, seq\) = \(4, 7\)",
    ),
    "token_type_ids batch": (
        dict(token_type_ids=torch.zeros(3, 7, dtype=torch.long)),
        r"`token_type_ids` must have shape",
    ),
    "input_ids 3-D": (
        dict(input_ids=torch.ones(4, 2, 7, dtype=torch.long)),
        r"`input_ids` must have shape \(batch, seq\)",
    ),
    "empty batch": (
        dict(
            input_ids=torch.ones(0, 7, dtype=torch.long),
            attention_mask=None,
            token_type_ids=None,
            task_ids=torch.zeros(0, dtype=torch.long),
            labels=None,
        ),
        r"batch is empty \(0 rows\)",
    ),
    "zero-length sequences": (
        dict(input_ids=torch.ones(4, 0, dtype=torch.long), attention_mask=None, token_type_ids=None),
        r"sequences are empty \(0 tokens\)",
    ),
    "longer than the position table": (
        dict(input_ids=torch.ones(4, 65, dtype=torch.long), attention_mask=None, token_type_ids=None),
        r"65 tokens; this model takes at most 64 \(`max_position_embeddings`\)",
    ),
    "misspelt keyword": (
        dict(lables=torch.tensor([1.0, 2.0, 0.5, 0.0])),
        r"Unexpected keyword argument\(s\) \['lables'\] \(did you mean `labels`",
    ),
}


@pytest.mark.parametrize("changes, message", CASES.values(), ids=CASES.keys())
def test_bad_input_raises_before_compute(model, changes, message):
    calls = []
    hook = model.backbone.embeddings.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=message):
            model(**_batch(model, **changes))
    finally:
        hook.remove()
    assert not calls, "the encoder ran before the input was rejected"


def test_both_or_neither_inputs(model):
    with pytest.raises(ValueError, match="exactly one of `input_ids` or `inputs_embeds`"):
        model(task_ids=torch.tensor([0]))


def test_a_config_without_tasks_is_an_architecture_a_model_refuses():
    """transformers builds default configs (`Config()`) to compare with; a model needs tasks."""
    from hf_taskmoe import BertForTaskMoE

    config = BertTaskMoEConfig(**TINY)
    assert config.tasks is None and BertTaskMoEConfig().tasks is None
    with pytest.raises(ValueError, match="`tasks` is required"):
        BertForTaskMoE(config)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(gating="per-token"), "gating"),
        (dict(num_experts=0), "num_experts"),
        (dict(num_experts=2, top_k=3), "top_k"),
        (dict(expert_weighting="soft"), "expert_weighting"),
        (dict(classifier_pooling="max"), "classifier_pooling"),
        (dict(moe_layers=[0, 5]), "moe_layers"),
        (dict(moe_layers=[1, 1]), "moe_layers"),
        (dict(router_init_std=-1.0), "router_init_std"),
        (dict(router_aux_loss_coef="x"), "router_aux_loss_coef"),
        (dict(hidden_size=30), "hidden_size"),
        (dict(hidden_size="32"), "hidden_size"),
        (dict(hidden_dropout_prob="a"), "hidden_dropout_prob"),
        (dict(tasks=[{"name": "x", "problem_type": "ranking", "num_labels": 2}]), "problem_type"),
        (dict(tasks=[{"name": "s", "problem_type": "seq2seq"}]), "needs a decoder"),
    ],
)
def test_bad_config_values_name_the_field(overrides, field):
    kwargs = {**TINY, "tasks": [{"name": "a", "num_labels": 2}], **overrides}
    with pytest.raises(ValueError, match=field):
        BertTaskMoEConfig(**kwargs)


def test_unknown_problem_type_in_taskspec():
    with pytest.raises(ValueError, match="problem_type"):
        TaskSpec(name="x", problem_type="ranking")


def test_all_ignored_labels_give_a_zero_loss_the_trainer_can_use(model):
    """A batch whose labels are all -100 yields loss 0 on the graph (was None, which crashed the Trainer)."""
    batch = _batch(model, task_ids=torch.tensor([0, 1, 0, 1]), labels=torch.full((4,), -100))
    model.train()
    out = model(**batch)
    model.eval()
    assert out.loss is not None and out.loss.item() == 0.0 and out.loss.requires_grad
    out.loss.backward()
    assert model.heads["sst2"].classifier.weight.grad is not None


def test_mmoe_refuses_infinite_labels_fractional_codes_and_misspelt_keywords():
    from hf_taskmoe import MMoEConfig, MMoEModel

    tasks = [TaskSpec(name="y", problem_type="regression"), TaskSpec(name="c", num_labels=2)]
    model = MMoEModel(
        MMoEConfig(tasks=tasks, numeric_features=["a"], categorical_features=["k"], categorical_cardinalities=[3])
    )
    x, k = torch.zeros(2, 1), torch.tensor([[0], [2]])
    with pytest.raises(ValueError, match=r"Task 'y': label inf in row 1 is not finite"):
        model(numeric_features=x, categorical_features=k, labels=torch.tensor([[0.5, 1.0], [float("inf"), 0.0]]))
    with pytest.raises(ValueError, match=r"must hold integer codes; row 0, feature 'k' holds 1.7"):
        model(numeric_features=x, categorical_features=torch.tensor([[1.7], [2.0]]))
    with pytest.raises(ValueError, match=r"\['label'\] \(did you mean `labels`"):
        model(numeric_features=x, categorical_features=k, label=torch.zeros(2, 2))
    missing = torch.tensor([[float("nan"), 1.0], [0.2, 0.0]])  # NaN: a missing label, still fine
    assert torch.isfinite(model(numeric_features=x, categorical_features=k, labels=missing).loss)


def test_task_names_and_weights_are_checked_whole():
    for name in ("sst2\n", "sst2 ", "../x", "<b>", ""):
        with pytest.raises(ValueError, match="`name` must be"):
            TaskSpec(name=name)
    for weight in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="loss_weight"):
            TaskSpec(name="t", num_labels=2, loss_weight=weight)


def test_metric_names_are_data_no_code_runs_from_them(tmp_path, monkeypatch):
    """A metric named in a task spec or a saved config that hf_taskmoe does not ship is refused before any compute;
    `evaluate.load` would import a local folder's script (here one that writes a marker file)."""
    from hf_taskmoe.metrics import check_metric_names, load_metric, register_metric
    from hf_taskmoe.training import MultiTaskTrainer, MultiTaskTrainingArguments

    marker = tmp_path / "ran.txt"
    module = tmp_path / "evil"
    module.mkdir()
    (module / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('code ran')\n")
    monkeypatch.chdir(tmp_path)
    tasks = [TaskSpec(name="t", num_labels=2, metrics=["evil"])]
    with pytest.raises(ValueError, match=r"Metric\(s\) 'evil' \(task 't'\) are not shipped.*trust_remote_metrics=True"):
        check_metric_names(tasks)
    with pytest.raises(ValueError, match="loading it would run code"):
        load_metric("evil")
    model = BertForTaskMoE(tiny_config(tasks=tasks))
    with pytest.raises(ValueError, match="trust_remote_metrics"):
        MultiTaskTrainer(model=model, args=MultiTaskTrainingArguments(output_dir=str(tmp_path / "o"), report_to=[]))
    assert not marker.exists()
    # a metric registered in code is fine, and so is an opt-in
    register_metric("always_half", lambda predictions, references: 0.5, overwrite=True)
    check_metric_names([TaskSpec(name="t", num_labels=2, metrics=["always_half"])])
    check_metric_names(tasks, trust_remote_metrics=True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch_size=-1), r"`batch_size` must be a positive integer, got -1"),
    (dict(batch_size=0), r"`batch_size` must be a positive integer, got 0"),
    (dict(top_k=0), r"`top_k` must be a positive integer"),
    (dict(top_k=-1), r"`top_k` must be a positive integer"),
    (dict(max_length=0), r"`max_length` must be a positive integer"),
])
def test_pipeline_refuses_bad_limits(model, minilm_tokenizer, kwargs, message):
    from transformers import pipeline

    pipe = pipeline("multitask-text-classification", model=model, tokenizer=minilm_tokenizer)
    with pytest.raises(ValueError, match=message):
        pipe(["a fine film", "a dull one"], task="sst2", **kwargs)


def test_pipeline_truncates_at_what_the_model_takes(minilm_tokenizer):
    """Inputs are cut at the trained length (the tokenizer's `model_max_length`, which run_multitask saves) and never
    beyond the model's positions; the tokenizer alone would allow 512."""
    import copy

    from transformers import pipeline

    model = BertForTaskMoE(tiny_config(tasks=ALL_KINDS[:3], vocab_size=minilm_tokenizer.vocab_size)).eval()
    lengths = []
    model.backbone.embeddings.register_forward_pre_hook(
        lambda m, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    long_text = " ".join(["word"] * 300)
    pipe = pipeline("multitask-text-classification", model=model, tokenizer=minilm_tokenizer)
    assert pipe.max_length() == 64 and pipe(long_text, task="sst2")["task"] == "sst2" and lengths[-1] == 64
    trained = copy.deepcopy(minilm_tokenizer)
    trained.model_max_length = 32
    pipe = pipeline("multitask-text-classification", model=model, tokenizer=trained)
    out = pipe(long_text, task="stsb")
    assert lengths[-1] == 32 and set(out) == {"task", "score"}


# ------------------------------------------------------------------------------- issue 44 item 3: at the model
def test_ids_beyond_the_models_tables_are_refused_at_the_forward(model):
    """Ids passed straight to a forward (no collator) that do not index the vocabulary or the token type table: a
    ValueError naming them, not `IndexError: index out of range in self`; a routed causal LM and T5 alike."""
    batch = _batch(model)
    too_big = batch["input_ids"].clone()
    too_big[1, 2] = model.config.vocab_size
    with pytest.raises(ValueError, match=r"`input_ids` holds 99 \(row 1, position 2.*`vocab_size`\) has 99 entries"):
        model(**{**batch, "input_ids": too_big})
    with pytest.raises(ValueError, match=r"`token_type_ids` holds 2 .*`type_vocab_size`\) has 2 entries"):
        model(**{**batch, "token_type_ids": batch["token_type_ids"] * 2})

    from .test_task_routed_lm import MIXED, VOCAB, lm_batch, routed

    lm = routed("gpt2")
    lm_inputs = lm_batch(lm, MIXED)
    with pytest.raises(ValueError, match=rf"`input_ids` holds {VOCAB} .*`vocab_size`\) has {VOCAB} entries"):
        lm(**{**lm_inputs, "input_ids": lm_inputs["input_ids"].masked_fill(lm_inputs["input_ids"] == 5, VOCAB)})


def test_a_static_cache_on_a_routed_causal_lm_is_refused_by_name_and_why():
    from .test_task_routed_lm import MIXED, prompts, routed

    lm = routed("gpt2")
    ids, mask = prompts()
    with pytest.raises(ValueError, match=r"TaskRoutedForCausalLM cannot decode with a static cache .*one cache slot "
                                         r"per expert"):
        lm.generate(ids, attention_mask=mask, task_ids=MIXED, max_new_tokens=2, cache_implementation="static")
    lm.generation_config.cache_implementation = "static"  # set on the model's generation config: the same
    with pytest.raises(ValueError, match="cannot decode with a static cache"):
        lm.generate(ids, attention_mask=mask, task_ids=MIXED, max_new_tokens=2)


def test_pipeline_refuses_a_list_as_a_text_pair_and_a_batch_size_of_zero(model, minilm_tokenizer):
    from transformers import pipeline

    pipe = pipeline("multitask-text-classification", model=model, tokenizer=minilm_tokenizer)
    with pytest.raises(ValueError, match=r"holds one string per field, got \{'text_pair': 'list'\}.*a list of dicts"):
        pipe({"text": "a man plays", "text_pair": ["a man is playing", "nobody plays"]}, task="mnli")
    zero = pipeline("multitask-text-classification", model=model, tokenizer=minilm_tokenizer, batch_size=0)
    with pytest.raises(ValueError, match=r"`batch_size` must be a positive integer, got 0"):
        zero(["a fine film"], task="sst2")


# ------------------------------------------------------------------------------- issue 59 item 2
def _encoder_model(model_cls, config_cls, arch, **kwargs):
    from .backbone_matrix import TASKS, dense_config

    torch.manual_seed(0)
    return model_cls(config_cls(dense_config=dense_config(arch), tasks=TASKS, **kwargs)).eval()


def _position_cases():
    from hf_taskmoe import (
        CAMTLBackboneConfig,
        CAMTLForMultiTask,
        PALsConfig,
        PALsForMultiTask,
        TaskMoEConfig,
        TaskMoEForMultiTask,
    )

    return [
        ("mt-tag", TaskMoEForMultiTask, TaskMoEConfig, {"num_experts": 2}),
        ("pals", PALsForMultiTask, PALsConfig, {"pal_size": 8, "pal_num_heads": 2}),
        ("ca-mtl", CAMTLForMultiTask, CAMTLBackboneConfig, {}),
    ]


@pytest.mark.parametrize("method", ["mt-tag", "pals", "ca-mtl"])
@pytest.mark.parametrize("arch", ["bert", "roberta", "distilbert"])
def test_position_ids_outside_the_position_table_are_refused_naming_them(method, arch):
    """`position_ids` beyond the position table or negative: a ValueError naming the argument and the table
    (`max_position_embeddings`), not `IndexError: index out of range in self` inside the embeddings; by the host
    check of a collated batch (`BatchChecker`) too. A batch marked checked is not read again (no host sync)."""
    from hf_taskmoe.training.batches import BatchChecker

    from .backbone_matrix import VOCAB, token_batch

    _, model_cls, config_cls, kwargs = next(c for c in _position_cases() if c[0] == method)
    model = _encoder_model(model_cls, config_cls, arch, **kwargs)
    table = model.config.max_position_embeddings
    assert model.position_table_size() == table
    batch = token_batch(arch, VOCAB, torch.tensor([0, 1, 0]), seq=5)
    good = torch.arange(5).expand(3, 5).clone()
    with torch.no_grad():
        model(**batch, position_ids=good)  # in range: runs
    for value in (table, -1):
        bad = good.clone()
        bad[2, 3] = value
        pattern = rf"`position_ids` holds {value} \(row 2, position 3.*position table \(`max_position_embeddings`\) " \
                  rf"has {table} entries"
        with pytest.raises(ValueError, match=pattern):
            model(**batch, position_ids=bad)
        with pytest.raises(ValueError, match=pattern):
            model.encode(**batch, position_ids=bad)
        with pytest.raises(ValueError, match=pattern):
            BatchChecker.for_model(model).check({**batch, "position_ids": bad})


@pytest.mark.parametrize("arch", ["modernbert", "deberta-v2"])
def test_positions_without_a_table_have_no_table_check(arch):
    """Rotary (ModernBERT) and relative-only (DeBERTa-v3: `position_biased_input=False`) positions index no table:
    nothing to refuse there. A DeBERTa-v2 that adds absolute positions has the table and its check."""
    from hf_taskmoe import TaskMoEConfig, TaskMoEForMultiTask
    from hf_taskmoe.input_checks import token_table_sizes

    from .backbone_matrix import TASKS, dense_config

    dense = dense_config(arch)
    if arch == "deberta-v2":
        assert _encoder_model(TaskMoEForMultiTask, TaskMoEConfig, arch, num_experts=2).position_table_size() == 40
        dense.position_biased_input = False
    model = TaskMoEForMultiTask(TaskMoEConfig(dense_config=dense, tasks=TASKS, num_experts=2))
    assert model.position_table_size() is None and token_table_sizes(model)["position_ids"] is None


def test_a_cache_filled_for_another_batch_size_is_refused_at_the_forward():
    """A key/value cache a forward filled for 3 rows, passed by hand with 2 rows: a ValueError naming `cache`, not a
    RuntimeError on tensor sizes inside the attention. The same rows continue from it."""
    from .test_task_routed_lm import routed

    lm = routed("gpt2")
    ids = torch.randint(4, 40, (3, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = lm(input_ids=ids, task_ids=torch.tensor([0, 1, 2]), use_cache=True).past_key_values
        with pytest.raises(ValueError, match=r"`cache` \(`past_key_values`\) was filled for 3 rows .* inputs have 2 "
                                             r"rows"):
            lm(input_ids=ids[:2, :1], task_ids=torch.tensor([0, 1]), cache=cache)
        step = lm(input_ids=ids[:, :1], task_ids=torch.tensor([0, 1, 2]), cache=cache)
    assert step.logits.shape[:2] == (3, 1)
