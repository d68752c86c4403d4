import sys

import datasets
import numpy as np
import pytest
import torch
from huggingface_hub import ModelCard
from transformers import TrainingArguments

from hf_taskmoe import BertForTaskMoE, TaskSpec
from hf_taskmoe.training import MultiTaskTrainer, MultiTaskTrainingArguments, register_task_sampler
from hf_taskmoe.training.samplers import TASK_SAMPLERS, ModelAwareSampling

from .conftest import tiny_config

TASKS = [
    TaskSpec(name="a", num_labels=3, dataset="org/data-a"),
    TaskSpec(name="b", problem_type="regression", dataset="org/data-b"),
    TaskSpec(name="c", num_labels=2, metrics=["accuracy", "f1"], dataset="org/data-c"),
]


def task_sets(config, sizes=(40, 24, 12), seed=0, extra_column=False):
    rng = np.random.default_rng(seed)
    out = {}
    for spec, n in zip(config.task_specs, sizes):
        lengths = rng.integers(4, 10, n)
        ids = [rng.integers(1, config.vocab_size, k).tolist() for k in lengths]
        if spec.problem_type == "regression":
            labels = rng.normal(size=n).round(3).tolist()
        else:
            labels = rng.integers(0, spec.num_labels, n).tolist()
        columns = {"input_ids": ids, "attention_mask": [[1] * k for k in lengths], "labels": labels}
        if extra_column:
            columns["raw_text"] = [f"row {i}" for i in range(n)]
        out[spec.name] = datasets.Dataset.from_dict(columns)
    return out


def make_trainer(tmp_path, name="run", model=None, train=None, evals=None, seed=0, **overrides):
    torch.manual_seed(seed)
    model = model or BertForTaskMoE(tiny_config(tasks=TASKS, num_experts=3))
    args = dict(
        output_dir=str(tmp_path / name), per_device_train_batch_size=8, per_device_eval_batch_size=16, max_steps=6,
        learning_rate=1e-3, logging_steps=2, save_strategy="no", report_to="none", use_cpu=True, seed=seed,
        disable_tqdm=True,
    )
    args.update(overrides)
    sets = train if train is not None else task_sets(model.config)
    return MultiTaskTrainer(
        model=model,
        args=MultiTaskTrainingArguments(**args),
        train_dataset=sets,
        eval_dataset=evals if evals is not None else task_sets(model.config, sizes=(10, 10, 10), seed=1),
    )


def test_trains_logs_per_task_losses_and_evaluates_each_task(tmp_path):
    trainer = make_trainer(tmp_path)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and all({"a_loss", "b_loss", "c_loss"} & set(h) for h in logged)
    metrics = trainer.evaluate()
    for key in ("eval_a_accuracy", "eval_b_pearson", "eval_b_spearmanr", "eval_c_accuracy", "eval_c_f1",
                "eval_a_loss", "eval_average", "eval_small_tasks_average"):
        assert key in metrics, key
    scores = [metrics["eval_a_accuracy"], (metrics["eval_b_pearson"] + metrics["eval_b_spearmanr"]) / 2,
              (metrics["eval_c_accuracy"] + metrics["eval_c_f1"]) / 2]
    assert metrics["eval_average"] == pytest.approx(np.mean(scores))


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("sampling", ["proportional", "annealed"])
def test_resume_from_checkpoint_ends_with_the_same_weights(tmp_path, sampling):
    # 3 optimizer steps per epoch: the checkpoint at step 4 lies inside the second epoch
    common = dict(max_steps=8, save_strategy="steps", save_steps=4, steps_per_epoch=3, task_sampling=sampling)
    full = make_trainer(tmp_path, "full", **common)
    full.train()
    expected = _weights(full.model)

    resumed = make_trainer(tmp_path, "resumed", **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-4"))
    assert resumed.state.global_step == 8
    got = _weights(resumed.model)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=1e-6, rtol=1e-5, msg=key)
    assert (tmp_path / "full" / "checkpoint-4" / "task_sampler.json").exists()

    fresh = make_trainer(tmp_path, "other", **{**common, "max_steps": 8}, seed=0)
    fresh.train()  # sanity: a run that does not resume also reaches the same weights (same seed)
    torch.testing.assert_close(
        _weights(fresh.model)["heads.a.classifier.weight"], expected["heads.a.classifier.weight"]
    )


def test_resume_with_another_sampler_configuration_is_refused(tmp_path):
    make_trainer(tmp_path, "first", max_steps=4, save_strategy="steps", save_steps=2).train()
    other = make_trainer(tmp_path, "second", max_steps=4, task_sampling="uniform")
    with pytest.raises(ValueError, match="another task sampler configuration"):
        other.train(resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-2"))


class _Recorder:
    """Collator wrapper that remembers the task ids of every batch."""

    def __init__(self, collator):
        self.collator, self.batches = collator, []

    def __call__(self, features):
        batch = self.collator(features)
        self.batches.append(batch["task_ids"].tolist())
        return batch


@pytest.mark.parametrize("batching, mixed", [("homogeneous", False), ("heterogeneous", True)])
def test_batching_modes(tmp_path, batching, mixed):
    trainer = make_trainer(tmp_path, batching=batching, task_sampling="uniform", max_steps=8)
    trainer.data_collator = recorder = _Recorder(trainer.data_collator)
    trainer.train()
    multi = [len(set(b)) > 1 for b in recorder.batches[:8]]
    assert any(multi) == mixed and (all(multi) or not mixed or sum(multi) >= 6)


def test_bf16_training_on_cpu(tmp_path):
    trainer = make_trainer(tmp_path, bf16=True, max_steps=3)
    result = trainer.train()
    assert np.isfinite(result.training_loss)


def test_task_ids_survive_remove_unused_columns(tmp_path):
    model = BertForTaskMoE(tiny_config(tasks=TASKS, num_experts=2))
    trainer = make_trainer(
        tmp_path, model=model, train=task_sets(model.config, extra_column=True),
        evals=task_sets(model.config, sizes=(6, 6, 6), extra_column=True), remove_unused_columns=True, max_steps=2,
    )
    trainer.train()
    metrics = trainer.evaluate()
    # task a has 3 classes, c has 2: had task ids been dropped, heads and label checks would not line up
    assert {"eval_a_accuracy", "eval_c_f1", "eval_b_pearson"} <= set(metrics)


def test_task_specific_only_leaves_the_backbone_bit_identical(tmp_path):
    trainer = make_trainer(tmp_path, train_task_specific_only=True, max_steps=2)
    before = _weights(trainer.model)
    trainer.train()
    after = _weights(trainer.model)
    for key in before:
        same = torch.equal(before[key], after[key])
        task_specific = key.startswith("heads.") or ".router." in key
        assert same != task_specific or "scorer.bias" in key, key


class _PickFirstRows(ModelAwareSampling):
    name = "test_pick_first_rows"

    def select(self, model, inputs, batch_size, step):
        self.calls = getattr(self, "calls", 0) + 1
        return {k: v[:batch_size] for k, v in inputs.items()}


def test_model_aware_sampler_chooses_the_rows(tmp_path):
    register_task_sampler("test_pick_first_rows", _PickFirstRows, exist_ok=True)
    try:
        trainer = make_trainer(tmp_path, task_sampling="test_pick_first_rows", max_steps=3)
        rows = []
        trainer.model.register_forward_pre_hook(
            lambda m, a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True
        )
        trainer.train()
        assert trainer.task_sampler.strategy.calls == 3 and rows == [8, 8, 8]
    finally:
        TASK_SAMPLERS.pop("test_pick_first_rows")


def test_model_card_parses_with_one_eval_result_per_task_dataset_metric(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.train()
    trainer.evaluate()
    trainer.create_model_card()
    card = ModelCard.load(tmp_path / "run" / "README.md")
    results = {(r.task_name, r.dataset_name, r.metric_type) for r in card.data.eval_results}
    assert results == {
        ("a", "org/data-a", "accuracy"),
        ("b", "org/data-b", "pearson"),
        ("b", "org/data-b", "spearmanr"),
        ("c", "org/data-c", "accuracy"),
        ("c", "org/data-c", "f1"),
    }
    text = card.content
    for fragment in (
        "MT-TaG (task-aware gates)",
        "## Tasks",
        "## Results",
        "## Training set-up",
        "task sampling: proportional",
        "apache-2.0",
    ):
        assert fragment in text, fragment


def test_trainer_bad_inputs(tmp_path):
    model = BertForTaskMoE(tiny_config(tasks=TASKS))
    sets = task_sets(model.config)
    with pytest.raises(ValueError, match="unknown task 'zz'"):
        MultiTaskTrainer(
            model=model,
            args=MultiTaskTrainingArguments(output_dir=str(tmp_path), use_cpu=True),
            train_dataset={**sets, "zz": sets["a"]},
        )
    with pytest.raises(ValueError, match=r"`train_dataset\['b'\]` is empty: task 'b' has no examples"):
        MultiTaskTrainer(
            model=model,
            args=MultiTaskTrainingArguments(output_dir=str(tmp_path), use_cpu=True),
            train_dataset={**sets, "b": sets["b"].select([])},
        )
    with pytest.raises(ValueError, match="needs `MultiTaskTrainingArguments`"):
        MultiTaskTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path)), train_dataset=sets)
    with pytest.raises(ValueError, match="task_sampling"):
        MultiTaskTrainingArguments(output_dir=str(tmp_path), task_sampling="lottery")
    with pytest.raises(ValueError, match="at most one of"):
        MultiTaskTrainingArguments(output_dir=str(tmp_path), steps_per_epoch=3, training_proportion=0.5)


def test_predict_tasks_returns_each_tasks_predictions_and_metrics(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=1)
    trainer.train()
    test_sets = task_sets(trainer.model.config, sizes=(5, 4, 3), seed=2)
    out = trainer.predict_tasks(test_sets)
    assert set(out) == {"a", "b", "c"}
    assert out["a"].predictions.shape == (5, 3) and out["b"].predictions.shape == (4, 1)
    assert out["c"].label_ids.tolist() == test_sets["c"]["labels"]
    assert {"test_a_accuracy", "test_a_loss"} <= set(out["a"].metrics) and "test_b_spearmanr" in out["b"].metrics


def test_half_precision_full_eval_leaves_the_training_weights_as_they_were(tmp_path):
    """transformers casts the model to bf16 for `bf16_full_eval` and leaves it there: training would go on, and the
    model be saved, in bf16. The trainer puts the exact fp32 weights back after each evaluation."""
    trainer = make_trainer(tmp_path, bf16_full_eval=True, max_steps=2)
    trainer.train()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.evaluate()
    assert "eval_average" in metrics
    after = trainer.model.state_dict()
    assert all(after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in before)
    trainer.save_model(str(tmp_path / "saved"))
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(tmp_path / "saved" / "model.safetensors").values() if t.is_floating_point()} == {
        torch.float32
    }


def test_fsdp1_without_a_gpu_is_refused_not_replaced_by_ddp(tmp_path):
    """(FSDP2 runs on the CPU: MultiTaskTrainer turns accelerate's FSDP path on there, tests/test_distributed.py.)"""
    import torch

    if torch.cuda.is_available():
        pytest.skip("FSDP runs on a GPU")
    for fsdp in (True, "full_shard"):
        with pytest.raises(ValueError, match="silently falls back to DDP"):
            MultiTaskTrainingArguments(output_dir=str(tmp_path), fsdp=fsdp, fsdp_config={"version": 1}, use_cpu=True)


def test_release_freed_memory_every_k_steps_trims_the_heap_on_cpu(tmp_path):
    from hf_taskmoe.training.callbacks import ReleaseFreedMemoryCallback, glibc_malloc_trim

    assert not any(isinstance(c, ReleaseFreedMemoryCallback) for c in make_trainer(tmp_path).callback_handler.callbacks)
    trainer = make_trainer(tmp_path, release_freed_memory_every=2)
    (callback,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, ReleaseFreedMemoryCallback)]
    if sys.platform.startswith("linux"):
        assert callback.trim.__name__ == "malloc_trim" and glibc_malloc_trim()(0) in (0, 1)  # glibc's own
    calls = []
    callback.trim = lambda pad: calls.append(pad) or 1
    trainer.train()  # 6 steps
    assert calls == [0, 0, 0]


@pytest.mark.parametrize("dense_pad, warned", [(0, False), (1, True)])
def test_no_special_token_warning_where_the_tokenizer_agrees_with_the_dense_config(
    tmp_path, minilm_tokenizer, monkeypatch, dense_pad, warned
):
    """A backbone-generic family keeps PAD/BOS/EOS in its dense config: Trainer.train's alignment with the tokenizer
    (pad 0, no BOS/EOS) warns only where the dense config really differs (pad 1), not on every non-BERT run."""
    import transformers
    from transformers import trainer_utils

    from hf_taskmoe import TaskMoEForMultiTask

    messages = []
    monkeypatch.setattr(trainer_utils.logger, "warning", lambda msg, *a, **k: messages.append(str(msg)))
    dense = transformers.RobertaModel(transformers.RobertaConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        pad_token_id=dense_pad, bos_token_id=0, eos_token_id=2))
    model = TaskMoEForMultiTask.from_dense(dense, tasks=TASKS, num_experts=2)
    args = MultiTaskTrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=8, max_steps=1,
                                      save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True)
    MultiTaskTrainer(model=model, args=args, train_dataset=task_sets(model.config),
                     processing_class=minilm_tokenizer).train()
    aligns = hasattr(trainer_utils, "align_special_tokens")  # transformers releases that align at all
    assert any("PAD/BOS/EOS" in m for m in messages) == (warned and aligns)
    assert model.config.pad_token_id == (0 if aligns else dense_pad)  # the tokenizer's, where transformers aligns


def test_evaluation_reads_each_tasks_own_labels_from_a_mixtures_padded_ones(tmp_path):
    """With a multi-label task in the mixture the collator pads every batch's labels to its width (issue 59 item 3);
    the evaluation drops the padding (`ProblemType.own_labels`): each task's metrics are those of its own labels and
    the model's predictions, computed here by hand."""
    tasks = [TaskSpec(name="a", num_labels=3), TaskSpec(name="b", problem_type="regression"),
             TaskSpec(name="m", problem_type="multi_label_classification", num_labels=4, metrics=["f1_micro"])]
    torch.manual_seed(0)
    model = BertForTaskMoE(tiny_config(tasks=tasks, num_experts=3))
    rng = np.random.default_rng(0)
    evals = {}
    for spec in tasks:
        labels = (rng.integers(0, 3, 10).tolist() if spec.name == "a" else rng.normal(size=10).round(3).tolist()
                  if spec.name == "b" else rng.integers(0, 2, (10, 4)).tolist())
        evals[spec.name] = datasets.Dataset.from_dict(
            {"input_ids": rng.integers(1, 99, (10, 6)).tolist(), "attention_mask": [[1] * 6] * 10, "labels": labels})
    trainer = make_trainer(tmp_path, model=model, evals=evals, train=evals)
    rows = [{**evals["a"][0], "task_ids": 0}, {**evals["b"][0], "task_ids": 1}]  # no multi-label row
    assert tuple(trainer.data_collator(rows)["labels"].shape) == (2, 4)
    metrics = trainer.evaluate()
    model.eval()
    with torch.no_grad():
        ids = {name: torch.tensor(data["input_ids"]) for name, data in evals.items()}
        logits = {name: model(input_ids=ids[name], task_ids=torch.full((10,), t)).logits
                  for t, name in enumerate(evals)}
    accuracy = (logits["a"].argmax(-1) == torch.tensor(evals["a"]["labels"])).float().mean().item()
    assert metrics["eval_a_accuracy"] == pytest.approx(accuracy)
    predicted, gold = (logits["m"] > 0).long(), torch.tensor(evals["m"]["labels"])
    true_positives = (predicted & gold).sum().item()
    f1 = 2 * true_positives / (predicted.sum().item() + gold.sum().item())
    assert metrics["eval_m_f1_micro"] == pytest.approx(f1)
    expected_b = torch.nn.functional.mse_loss(logits["b"][:, 0], torch.tensor(evals["b"]["labels"])).item()
    assert metrics["eval_b_loss"] == pytest.approx(expected_b, rel=1e-4)
