"""examples/run_multitask.py end to end on a few rows of the shipped mixture (tiny BERT, real tokenizer)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModel

from hf_taskmoe import BertForTaskMoE, BertWithPALs, CAMTLModel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import run_multitask  # noqa: E402


def _argv(out, model, *extra):
    return [
        "--model_name_or_path", str(model), "--output_dir", str(out), "--do_train", "--do_eval",
        "--max_steps", "3", "--per_device_train_batch_size", "4", "--max_train_samples", "12", "--max_eval_samples", "8",
        "--max_seq_length", "32", "--use_cpu", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true",
        *extra,
    ]


def test_script_trains_evaluates_and_writes_its_outputs(tmp_path, tiny_dense, capsys):
    metrics = run_multitask.main(_argv(tmp_path / "out", tiny_dense, "--task_sampling", "sqrt", "--num_experts", "2"))
    printed = capsys.readouterr().out
    assert "Per-task results on the evaluation sets" in printed and "average (all tasks)" in printed
    for task in ("rotten_tomatoes", "trec", "sms_spam", "tweet_sentiment", "boolq"):
        assert any(k.startswith(f"eval_{task}_") and not k.endswith("loss") for k in metrics), task
    out = tmp_path / "out"
    for name in ("model.safetensors", "config.json", "tokenizer.json", "eval_results.json", "routing.json", "routing_heatmap.png", "README.md"):
        assert (out / name).exists(), name
    model = AutoModel.from_pretrained(out)
    assert isinstance(model, BertForTaskMoE) and model.config.num_experts == 2
    card = ModelCard.load(out / "README.md")
    assert len(card.data.eval_results) == 7  # (task, dataset, metric) triples of the mixture
    assert "routing_heatmap.png" in card.content


def test_script_continues_a_saved_model_from_a_json_file(tmp_path, tiny_dense):
    run_multitask.main(_argv(tmp_path / "first", tiny_dense, "--num_experts", "2"))
    config = {
        "model_name_or_path": str(tmp_path / "first"), "output_dir": str(tmp_path / "second"), "do_train": True,
        "do_eval": True, "max_steps": 2, "per_device_train_batch_size": 4, "max_train_samples": 8,
        "max_eval_samples": 4, "max_seq_length": 32, "use_cpu": True, "report_to": "none", "save_strategy": "no",
    }
    (tmp_path / "args.json").write_text(json.dumps(config))
    metrics = run_multitask.main([str(tmp_path / "args.json")])
    assert "eval_average" in metrics
    assert (tmp_path / "second" / "model.safetensors").exists()


def test_bad_input_stops_before_training(tmp_path, tiny_dense):
    with pytest.raises(ValueError, match="Unknown task 'no_such_task'"):
        run_multitask.main(_argv(tmp_path / "x", tiny_dense, "--tasks", "no_such_task"))
    bad = tmp_path / "bad"
    (bad / "t").mkdir(parents=True)
    (bad / "t" / "train.jsonl").write_text('{"text": "fine", "label": "pos"}\n{"text": "odd", "label": "meh"}\n')
    (bad / "tasks.json").write_text(json.dumps({"tasks": [{"name": "t", "label_names": ["neg", "pos"], "text_fields": ["text"],
                                                           "train_file": "t/train.jsonl", "validation_file": "t/train.jsonl"}]}))
    with pytest.raises(ValueError, match=r"Task 't', train row 1: label 'meh' is not one of the task's labels"):
        run_multitask.main(_argv(tmp_path / "y", tiny_dense, "--tasks", str(bad / "tasks.json")))
    assert not (tmp_path / "y" / "model.safetensors").exists()


def test_two_stage_protocol_options(tmp_path, tiny_dense):
    """--task_specific_steps (PALs' second stage) and --finetune_each_task (MT-TaG 4.5) run after joint training."""
    run_multitask.main(_argv(tmp_path / "out", tiny_dense, "--task_specific_steps", "1", "--finetune_each_task",
                             "--max_train_samples", "4", "--max_eval_samples", "4", "--max_steps", "1"))
    results = json.loads((tmp_path / "out" / "finetune_results.json").read_text())
    assert set(results) == {"rotten_tomatoes", "trec", "sms_spam", "tweet_sentiment", "boolq"}
    assert "eval_trec_accuracy" in results["trec"]
    assert (tmp_path / "out" / "task_specific").is_dir()
    assert (tmp_path / "out" / "finetune-boolq" / "model.safetensors").exists()


def test_script_builds_bert_with_pals(tmp_path, tiny_dense):
    """--model_family bert_pals with annealed sampling, a PAL group and the task-specific second stage."""
    run_multitask.main(_argv(
        tmp_path / "out", tiny_dense, "--model_family", "bert_pals", "--pal_size", "16", "--pal_num_heads", "4",
        "--pal_task_groups", "rotten_tomatoes,tweet_sentiment", "--task_sampling", "annealed", "--task_specific_steps", "1",
    ))
    model = AutoModel.from_pretrained(tmp_path / "out")
    assert isinstance(model, BertWithPALs) and model.config.pal_size == 16
    assert ["rotten_tomatoes", "tweet_sentiment"] in model.config.pal_groups and model.bert.pals.num_groups == 4
    assert not (tmp_path / "out" / "routing.json").exists()  # PALs do not route
    assert "Projected Attention Layers" in ModelCard.load(tmp_path / "out" / "README.md").content
    assert (tmp_path / "out" / "task_specific").is_dir()


def test_script_builds_camtl_with_uncertainty_sampling(tmp_path, tiny_dense):
    """--model_family camtl --task_sampling uncertainty: the CA-MTL recipe end to end, then a new task."""
    run_multitask.main(_argv(
        tmp_path / "out", tiny_dense, "--model_family", "camtl", "--task_sampling", "uncertainty",
        "--uncertainty_score_every", "2", "--logging_steps", "1",
    ))
    model = AutoModel.from_pretrained(tmp_path / "out")
    assert isinstance(model, CAMTLModel)
    assert model.config.conditional_attention_max_length == 32  # follows --max_seq_length
    assert model.config.frozen_layers == 1 and not model.bert.encoder.layer[0].output.dense.weight.requires_grad
    assert "CA-MTL" in ModelCard.load(tmp_path / "out" / "README.md").content
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    assert any(k.startswith("sampled/") for h in state["log_history"] for k in h)


def test_script_builds_bart_routed_from_a_bert(tmp_path, tiny_dense):
    """--model_family bart_routed on the text-to-text mixture: BART warm-started from the (tiny) BERT, routed
    layers, generation-based evaluation with text metrics, per-role learning rates, then the per-task export."""
    from hf_taskmoe import BartTaskRouted

    metrics = run_multitask.main(_argv(
        tmp_path / "out", tiny_dense, "--model_family", "bart_routed", "--tasks", str(ROOT / "examples/data/text2text/tasks.json"),
        "--max_target_length", "16", "--predict_with_generate", "--generation_max_length", "6", "--generation_num_beams", "2",
        "--group_learning_rates", "router=1e-3,task_embedding=1e-2", "--logging_steps", "1", "--log_routing",
    ))
    for key in ("eval_trec_exact_match", "eval_xsum_rouge1", "eval_xsum_rougeL", "eval_boolq_loss", "eval_average"):
        assert key in metrics
        assert key.endswith("loss") or 0.0 <= metrics[key] <= 1.0
    model = AutoModel.from_pretrained(tmp_path / "out")
    assert isinstance(model, BartTaskRouted) and model.config.num_experts == 3 and len(model.config.route_names) == 4
    assert model.config.decoder_start_token_id == 101  # [CLS] of the BERT vocabulary
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert "Task-level MoE over BART" in card.content and "evaluation examples per expert" in card.content
    metric_keys = [f"eval_{t.name}_{m}" for t in model.config.task_specs for m in t.metrics]
    assert len(card.data.eval_results) == len([k for k in metric_keys if k in metrics])  # one per (task, dataset, metric)
    assert {r.task_type for r in card.data.eval_results} == {"text2text-generation"}
    assert model.export_task("xsum").config.model_type == "bart"
    # routing analytics: training shares per (task, routed layer) in the logs; evaluation routes are the arg-max
    history = json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]
    logged = [h for h in history if "routing/trec/E0/expert0" in h]
    assert logged and all(sum(h[f"routing/trec/E0/expert{e}"] for e in range(3)) == pytest.approx(1.0, abs=1e-3) for h in logged)
    evaluated = json.loads((tmp_path / "out" / "routing.json").read_text())
    chosen = model.task_routing().argmax(-1)  # (tasks, routed layers)
    for t, task in enumerate(model.config.task_names):
        for i, layer in enumerate(evaluated["tasks"][task]["per_layer"]):
            assert layer["shares"][int(chosen[t, i])] == 1.0 and layer["unused_experts"] == 2
    assert (tmp_path / "out" / "routing_train.json").exists() and (tmp_path / "out" / "routing_heatmap.png").exists()


def test_group_learning_rates_reach_the_optimizer(tmp_path, tiny_dense):
    from hf_taskmoe import BartTaskRouted, TaskSpec, bart_from_bert
    from hf_taskmoe.training import MultiTaskTrainer, MultiTaskTrainingArguments

    model = BartTaskRouted.from_dense(bart_from_bert(tiny_dense), [TaskSpec(name="a", problem_type="seq2seq")])
    args = MultiTaskTrainingArguments(output_dir=str(tmp_path), learning_rate=1e-5, group_learning_rates="router=1e-3,task_embedding=1e-2",
                                      report_to=[], use_cpu=True)
    trainer = MultiTaskTrainer(model=model, args=args)
    optimizer = trainer.create_optimizer()
    rates = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            rates[id(p)] = group["lr"]
    assert rates[id(model.router.task_embeddings.weight)] == 1e-2
    assert rates[id(model.router.net.dense_in.weight)] == 1e-3
    assert rates[id(model.model.encoder.layers[0].experts[1].fc1.weight)] == 1e-5
    assert len(rates) == sum(1 for p in model.parameters() if p.requires_grad)
    bad = MultiTaskTrainingArguments(output_dir=str(tmp_path), group_learning_rates={"gate": 1e-3}, report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="parameter roles"):
        MultiTaskTrainer(model=model, args=bad).create_optimizer()
    with pytest.raises(ValueError, match="role=rate"):
        MultiTaskTrainingArguments(output_dir=str(tmp_path), group_learning_rates="router", report_to=[], use_cpu=True)
