"""`run_multitask.py --model_family bart_routed` (the task-routing method) on a dense decoder-only checkpoint: for
GPT-2, Llama and Qwen2, a tiny random checkpoint saved with MiniLM's WordPiece tokenizer beside it trains two steps
on text-to-text tasks in the causal layout (prompt, then target), evaluates with `--predict_with_generate`, saves, and
loads with `AutoModelForCausalLM` / `AutoModel`. A WordPiece vocabulary has no EOS: [SEP] ends a target, and
generation stops there. Plus the trainer's causal prediction step: predictions are the generated continuation only."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

from hf_taskmoe import TaskRoutedForCausalLM, TaskSpec
from hf_taskmoe.models import family_of

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import run_multitask  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
#: MiniLM's WordPiece vocabulary ([PAD] 0, [CLS] 101, [SEP] 102); each architecture keeps its own special-token ids
#: (GPT-2's 50256 lies outside this vocabulary, Qwen2 has none): the script takes the tokenizer's
VOCAB = 30522
SEP = 102
DENSE_CONFIGS = {
    "gpt2": lambda: GPT2Config(n_embd=16, n_layer=2, n_head=2, n_positions=64, vocab_size=VOCAB),
    "llama": lambda: LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64),
    "qwen2": lambda: Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64),
}


def _tasks(folder: Path) -> Path:
    """Two text-to-text tasks of 6 rows each (training file = dev file)."""
    specs = []
    for k, name in enumerate(("alpha", "beta")):
        rows = [{"text": f"{name} example {i} about topic {k}", "label": ["yes", "no"][i % 2]} for i in range(6)]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        specs.append({"name": name, "problem_type": "seq2seq", "text_fields": ["text"],
                      "metrics": ["exact_match", "rouge1"], "train_file": f"{name}.jsonl",
                      "validation_file": f"{name}.jsonl"})
    (folder / "tasks.json").write_text(json.dumps({"tasks": specs}))
    return folder / "tasks.json"


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    return _tasks(tmp_path_factory.mktemp("lm_tasks"))


def _save_dense(arch: str, folder: Path, minilm: Path) -> Path:
    """A tiny random causal LM of `arch` saved in `folder` with MiniLM's WordPiece tokenizer beside it."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(DENSE_CONFIGS[arch]()).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm / name, folder / name)
    return folder


@pytest.fixture(scope="module", params=list(DENSE_CONFIGS))
def dense_checkpoint(request, tmp_path_factory, minilm):
    return request.param, _save_dense(request.param, tmp_path_factory.mktemp(request.param), minilm)


def test_the_script_routes_a_causal_lm_and_evaluates_by_generation(tmp_path, dense_checkpoint, task_file):
    arch, folder = dense_checkpoint
    out = tmp_path / "out"
    metrics = run_multitask.main([
        "--model_family", "bart_routed", "--model_name_or_path", str(folder), "--tasks", str(task_file),
        "--output_dir", str(out), "--do_train", "--do_eval", "--predict_with_generate", "--max_steps", "2",
        "--per_device_train_batch_size", "4", "--max_train_samples", "4", "--max_eval_samples", "2",
        "--max_seq_length", "24", "--max_target_length", "4", "--num_experts", "2", "--use_cpu", "--report_to", "none",
        "--save_strategy", "no", "--disable_tqdm", "true",
    ])
    for task in ("alpha", "beta"):  # generated, not teacher-forced
        assert 0.0 <= metrics[f"eval_{task}_exact_match"] <= 1.0 and f"eval_{task}_rouge1" in metrics
        assert f"eval_{task}_loss" in metrics and f"eval_{task}_exact_match_teacher_forced" not in metrics
    assert "eval_average" in metrics

    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model, TaskRoutedForCausalLM) and model.config.num_experts == 2
    assert model.config.dense_config.model_type == arch and family_of(model.config).method == "task-routing"
    stops = model.generation_config.eos_token_id  # [SEP] first, then the checkpoint's own in the vocabulary (Llama: 2)
    assert (stops if isinstance(stops, list) else [stops])[0] == SEP and model.generation_config.max_new_tokens == 4
    assert isinstance(AutoModel.from_pretrained(out), TaskRoutedForCausalLM)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "README.md", "routing.json",
                 "routing_heatmap.png", "generations.json"):
        assert (out / name).exists(), name
    assert "causal LM" in (out / "README.md").read_text()
    samples = json.loads((out / "generations.json").read_text())
    assert {s["task"] for s in samples} == {"alpha", "beta"}
    # generation stops at [SEP] (a sample's text is cut there)
    assert all("[SEP]" not in s["output"] for s in samples)

    if arch == "gpt2":  # the saved model is continued with a task added, and its pipeline loads by path
        from transformers import pipeline

        from hf_taskmoe.pipelines import TEXT2TEXT_PIPELINE_TASK

        pipe = pipeline(TEXT2TEXT_PIPELINE_TASK, model=str(out))
        assert pipe("alpha example 1 about topic 0", task="alpha", max_new_tokens=3)["task"] == "alpha"
        more = _tasks_with_gamma(tmp_path, task_file)
        metrics = run_multitask.main([
            "--model_name_or_path", str(out), "--tasks", str(more), "--output_dir", str(tmp_path / "more"),
            "--do_train", "--do_eval", "--predict_with_generate", "false", "--max_steps", "1",
            "--per_device_train_batch_size", "4", "--max_train_samples", "4", "--max_eval_samples", "2",
            "--max_seq_length", "24", "--max_target_length", "4", "--use_cpu", "--report_to", "none",
            "--save_strategy", "no", "--disable_tqdm", "true",
        ])
        assert "eval_gamma_exact_match_teacher_forced" in metrics
        continued = AutoModelForCausalLM.from_pretrained(tmp_path / "more")
        assert continued.config.task_names == ["alpha", "beta", "gamma"]


def _tasks_with_gamma(tmp_path: Path, task_file: Path) -> Path:
    config = json.loads(task_file.read_text())
    gamma = dict(config["tasks"][0], name="gamma")
    for spec in config["tasks"] + [gamma]:
        spec["train_file"] = str(task_file.parent / spec["train_file"])
        spec["validation_file"] = str(task_file.parent / spec["validation_file"])
    path = tmp_path / "more_tasks.json"
    path.write_text(json.dumps({"tasks": config["tasks"] + [gamma]}))
    return path


def test_a_prompt_and_target_longer_than_the_positions_are_refused(tmp_path, minilm, task_file, capsys):
    folder = _save_dense("gpt2", tmp_path / "gpt2", minilm)  # 64 positions
    code = run_multitask.cli([
        "--model_family", "task-routing", "--model_name_or_path", str(folder), "--tasks", str(task_file),
        "--output_dir", str(tmp_path / "out"), "--max_steps", "1", "--max_seq_length", "48",
        "--max_target_length", "32", "--use_cpu", "--report_to", "none",
    ])
    assert code == 2
    assert "exceed the 64 positions of this causal LM" in capsys.readouterr().err
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_the_causal_prediction_step_returns_the_continuation_only(tmp_path, minilm_tokenizer):
    """With `predict_with_generate` the predictions are what `generate` adds after the prompt (never the prompt nor
    the target the batch carries); teacher-forced, position t's arg-max lines up with the label at t + 1."""
    from datasets import Dataset

    from hf_taskmoe.problem_types.seq2seq import text_to_text_layout
    from hf_taskmoe.training import MultiTaskTrainer, MultiTaskTrainingArguments, tokenize_task

    tasks = [TaskSpec(name="x", problem_type="seq2seq")]
    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(DENSE_CONFIGS["llama"]())
    model = TaskRoutedForCausalLM.from_dense(dense, tasks, num_experts=2).eval()
    model.generation_config.eos_token_id = None  # never stops: every row generates max_new_tokens
    data = Dataset.from_dict({"sentence": ["a short prompt", "a longer prompt than the first one"],
                              "label": ["yes", "no way"]})
    rows = tokenize_task(tasks[0], data, minilm_tokenizer, 0, max_length=16, layout=text_to_text_layout(model))
    args = MultiTaskTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                      predict_with_generate=True, generation_max_length=3)
    trainer = MultiTaskTrainer(model=model, args=args, processing_class=minilm_tokenizer)
    batch = trainer.data_collator([{**r, "task_ids": 0} for r in rows])
    prompts = [(batch["labels"][i] == -100) & (batch["attention_mask"][i] == 1) for i in range(2)]
    _, predictions, labels = trainer.prediction_step(model, dict(batch), prediction_loss_only=False)
    assert predictions.shape == (2, 3) and torch.equal(labels, batch["labels"])
    for i in range(2):  # the continuation of the prompt alone: greedy decoding from it, step by step
        ids = batch["input_ids"][i][prompts[i]][None]
        expected = model.generate(ids, task_ids=torch.tensor([0]), max_new_tokens=3, do_sample=False)[:, ids.shape[1]:]
        assert torch.equal(predictions[i], expected[0])

    # generation stops at the end token: a row that generates it first is padded after it
    first = int(predictions[0, 0])
    model.generation_config.eos_token_id = first
    model.generation_config.pad_token_id = minilm_tokenizer.pad_token_id
    _, predictions, _ = trainer.prediction_step(model, dict(batch), prediction_loss_only=False)
    assert predictions[0].tolist()[:1] == [first] and set(predictions[0].tolist()[1:]) <= {0}

    trainer.args.predict_with_generate = False
    _, predictions, labels = trainer.prediction_step(model, dict(batch), prediction_loss_only=False)
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    assert torch.equal(labels, batch["labels"][:, 1:])
    expected = logits[:, :-1].argmax(-1).masked_fill(labels == -100, -100)
    assert torch.equal(predictions, expected)


@pytest.mark.skipif(not __import__("hf_taskmoe.compat").compat.T5_BLOCK_RETURNS_BIASES,
                    reason="TaskRoutedForSeq2SeqLM refuses this transformers' T5 block (the floor release)")
@pytest.mark.parametrize("arch", ["t5", "mt5"])
def test_the_script_routes_a_t5(tmp_path, task_file, minilm, arch):
    """--model_family bart_routed on a T5 / mT5 checkpoint builds TaskRoutedForSeq2SeqLM (the encoder-decoder path
    of the script): trains two steps, evaluates by generation, saves, loads with AutoModelForSeq2SeqLM."""
    from transformers import AutoModelForSeq2SeqLM, MT5Config, T5Config

    from hf_taskmoe import TaskRoutedForSeq2SeqLM

    config_cls = T5Config if arch == "t5" else MT5Config
    folder = tmp_path / arch
    torch.manual_seed(0)
    AutoModelForSeq2SeqLM.from_config(config_cls(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=SEP,
    )).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm / name, folder / name)
    out = tmp_path / "out"
    metrics = run_multitask.main([
        "--model_family", "task-routing", "--model_name_or_path", str(folder), "--tasks", str(task_file),
        "--output_dir", str(out), "--do_train", "--do_eval", "--predict_with_generate", "--max_steps", "2",
        "--per_device_train_batch_size", "4", "--max_train_samples", "4", "--max_eval_samples", "2",
        "--max_seq_length", "24", "--max_target_length", "4", "--num_experts", "2", "--use_cpu", "--report_to", "none",
        "--save_strategy", "no", "--disable_tqdm", "true",
    ])
    assert all(f"eval_{task}_exact_match" in metrics for task in ("alpha", "beta"))
    model = AutoModelForSeq2SeqLM.from_pretrained(out)
    assert isinstance(model, TaskRoutedForSeq2SeqLM) and model.config.dense_config.model_type == arch
    assert (out / "README.md").exists() and (out / "routing.json").exists()
