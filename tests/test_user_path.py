"""The user path of `examples/run_multitask.py` (issue 36): no secret reaches a file or the Hub, a failed push exits
non-zero, seq2seq scores come from generated text, every score sits beside its baseline, errors are sorted into the
user's and ours, cards name data and models truthfully and escape what users wrote, eval-only and resumed runs say
what they did."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from hf_taskmoe.cli import train
from hf_taskmoe.cli.errors import UsageError
from hf_taskmoe.cli.push import files_to_push, redacted_argv, take_secrets
from hf_taskmoe.cli.reporting import baseline_scores, results_table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import run_multitask  # noqa: E402

SECRET = "hf_FAKEtokenNEVERwritten0123456789abcd"
ENV_SECRET = "sk-ENVsecretNEVERwritten9876"


def _argv(out, model, *extra):
    return [
        "--model_name_or_path",
        str(model),
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
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
        "--disable_tqdm",
        "true",
        "--num_experts",
        "2",
        *extra,
    ]


def _files_holding(folder: Path, needle: str) -> list[str]:
    return [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


# ------------------------------------------------------------------------------------------- secrets and push
def test_a_token_reaches_no_file_and_the_push_uploads_only_the_allow_list(tmp_path, tiny_dense, monkeypatch, capsys):
    import huggingface_hub

    monkeypatch.setenv("WANDB_API_KEY", ENV_SECRET)
    uploads = []
    monkeypatch.setattr(huggingface_hub, "create_repo", lambda *a, **k: None)
    monkeypatch.setattr(huggingface_hub, "upload_folder", lambda **kwargs: uploads.append(kwargs))
    out = tmp_path / "run"
    code = run_multitask.cli(
        _argv(
            out,
            tiny_dense,
            "--save_strategy",
            "steps",
            "--save_steps",
            "1",
            "--hub_token",
            SECRET,
            "--push_to_hub",
            "--hub_model_id",
            "someone/run",
        )
    )
    assert code == 0, capsys.readouterr().err
    assert (out / "checkpoint-2" / "training_args.bin").exists() and (out / "run_summary.json").exists()
    assert _files_holding(out, SECRET) == [] and _files_holding(out, ENV_SECRET) == []
    assert "--hub_token" in json.loads((out / "run_summary.json").read_text())["argv"]  # recorded, value redacted
    # the upload: this folder, the token, and exactly the allow-listed files
    (upload,) = uploads
    assert upload["token"] == SECRET and upload["folder_path"] == str(out)
    pushed = set(upload["allow_patterns"])
    assert {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "README.md",
        "eval_results.json",
        "routing_heatmap.png",
    } <= pushed
    assert not pushed & {"training_args.bin", "run_summary.json", "trainer_state.json"}
    assert all("/" not in name and (out / name).is_file() for name in pushed)  # top-level files only: no checkpoint


def test_a_failed_push_exits_1_after_saving_and_prints_the_same_allow_list(tmp_path, tiny_dense, monkeypatch, capsys):
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise ConnectionError(f"Hub unreachable (token {kwargs.get('token')})")

    monkeypatch.setattr(huggingface_hub, "create_repo", refuse)
    out = tmp_path / "pushed"
    code = run_multitask.cli(
        _argv(out, tiny_dense, "--hub_token", SECRET, "--push_to_hub", "--hub_model_id", "someone/pushed")
    )
    err = capsys.readouterr().err
    assert code == 1
    assert (out / "model.safetensors").exists() and (out / "README.md").exists() and (out / "tokenizer.json").exists()
    assert "The upload to the Hub failed" in err and "Traceback" not in err and SECRET not in err
    command = next(line.strip() for line in err.splitlines() if line.strip().startswith("hf upload"))
    included = command.split(" . ", 1)[1].split()[1::2]
    assert command.startswith(f"hf upload someone/pushed {out} . --include ")
    assert sorted(included) == files_to_push(str(out)) and "run_summary.json" not in included
    assert _files_holding(out, SECRET) == []


def test_secret_named_options_are_redacted_and_taken_out_of_the_arguments():
    argv = [
        "--hub_token",
        "a",
        "--x_password=b",
        "--api_key",
        "c",
        "--max_steps",
        "3",
        "--include_tokens_per_second",
        "true",
    ]
    assert redacted_argv(argv) == [
        "--hub_token", "<redacted>", "--x_password=<redacted>", "--api_key", "<redacted>", "--max_steps", "3",
        "--include_tokens_per_second", "true",
    ]
    *_, training_args = run_multitask.parse_args(["--hub_token", "abc", "--output_dir", "/tmp/x"])
    assert take_secrets(training_args) == {"hub_token": "abc"} and training_args.hub_token is None


# ------------------------------------------------------------------------------------------- truthful scores
def test_seq2seq_scores_under_plain_names_come_from_generated_text(tmp_path, tiny_dense):
    """An untrained routed BART: the plain-named scores are those of the text it generates (recomputed here from
    generations.json, which holds every dev example); teacher-forced scores only under their own names."""
    from hf_taskmoe.metrics import load_metric

    tasks = str(ROOT / "examples/data/text2text/tasks.json")
    common = (
        "--model_family",
        "bart_routed",
        "--tasks",
        tasks,
        "--task_names",
        "xsum",
        "trec",
        "--max_eval_samples",
        "3",
        "--max_target_length",
        "8",
        "--max_steps",
        "1",
    )
    metrics = run_multitask.main(_argv(tmp_path / "gen", tiny_dense, *common))
    assert {"eval_xsum_rouge1", "eval_trec_exact_match", "eval_average"} <= set(metrics)
    assert not any(k.endswith("_teacher_forced") for k in metrics)
    samples = json.loads((tmp_path / "gen" / "generations.json").read_text())
    xsum = [s for s in samples if s["task"] == "xsum"]
    assert len(xsum) == 3
    rouge = load_metric("rouge1").compute(
        predictions=[s["output"] for s in xsum], references=[s["target"] for s in xsum]
    )
    assert metrics["eval_xsum_rouge1"] == pytest.approx(rouge["rouge1"], abs=1e-6)

    forced = run_multitask.main(_argv(tmp_path / "forced", tiny_dense, *common, "--predict_with_generate", "false"))
    assert "eval_xsum_rouge1_teacher_forced" in forced and "eval_xsum_rouge1" not in forced
    assert "eval_average" not in forced  # teacher-forced scores are kept out of the averages
    card = ModelCard.load(tmp_path / "forced" / "README.md")
    assert (
        "rouge1_teacher_forced" in card.content and not card.data.eval_results
    )  # in the table, not in the model-index


def test_every_score_sits_beside_its_baseline_and_a_task_at_it_is_flagged():
    from hf_taskmoe import TaskSpec

    clf = TaskSpec(name="clf", label_names=["a", "b", "c"], metrics=["accuracy"])
    reg = TaskSpec(name="reg", problem_type="regression", metrics=["pearson"])
    base = {"clf": baseline_scores(clf, [2, 2, 1, 0, 2], [2, 1, 2, 0]),
            "reg": baseline_scores(reg, [1.0, 2.0, 3.0], [0.5, 2.5])}
    assert base == {"clf": {"accuracy": 0.5}, "reg": {"pearson": 0.0}}  # majority class 2; a constant's correlation: 0
    metrics = {
        "eval_clf_accuracy": 0.5,
        "eval_reg_pearson": 0.8,
        "eval_average": 0.65,
        "eval_small_tasks_average": 0.65,
    }
    table = results_table([clf, reg], metrics, baselines=base)
    rows = {line.split()[0]: line for line in table.splitlines()}
    assert "50.00" in rows["clf"] and rows["clf"].count("50.00") == 2 and "at or below its baseline" in rows["clf"]
    assert "80.00" in rows["reg"] and "0.00" in rows["reg"] and "baseline" not in rows["reg"]
    assert table.count("average") == 1  # every task small: one average, not the same number twice
    metrics["eval_small_tasks_average"] = 0.5
    assert "average (small tasks)" in results_table([clf, reg], metrics, baselines=base)


def test_the_script_prints_baselines_and_task_names_on_evaluation_bars(tmp_path, tiny_dense, capsys):
    run_multitask.main(_argv(tmp_path / "out", tiny_dense, "--disable_tqdm", "false"))
    captured = capsys.readouterr()
    header = next(line for line in captured.out.splitlines() if line.startswith("task "))
    assert "baseline" in header
    for task in ("rotten_tomatoes", "trec", "sms_spam", "tweet_sentiment", "newsgroups"):
        assert f"Evaluation [{task}]" in captured.err
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert set(summary["baselines"]) == {"rotten_tomatoes", "trec", "sms_spam", "tweet_sentiment", "newsgroups"}
    saved = json.loads(
        (tmp_path / "out" / "eval_results.json").read_text()
    )  # the metrics file: each score's baseline too
    assert saved["eval_newsgroups_accuracy_baseline"] == summary["baselines"]["newsgroups"]["accuracy"]
    printed = captured.out[captured.out.index("eval metrics"):].splitlines()
    at = next(i for i, line in enumerate(printed) if line.split()[0] == "eval_trec_accuracy")
    assert printed[at + 1].split()[0] == "eval_trec_accuracy_baseline"  # beside it in transformers' metrics print


# ------------------------------------------------------------------------------------------- exit status
def test_user_errors_are_one_paragraph_and_internal_errors_keep_their_traceback(
    tmp_path, tiny_dense, monkeypatch, capsys
):
    code = run_multitask.cli(_argv(tmp_path / "a", tiny_dense, "--tasks", "no_such_task"))
    err = capsys.readouterr().err
    assert code == 2 and "Unknown task 'no_such_task'" in err and "Traceback" not in err and "internal error" not in err

    code = run_multitask.cli(_argv(tmp_path / "b", tiny_dense, "--per_device_train_batch_size", "4", "--fp16"))
    assert code == 2 and "Traceback" not in capsys.readouterr().err  # refused by the arguments' own checks

    def api_changed(*args, **kwargs):  # a ValueError raised inside transformers: not the user's mistake
        from transformers import AutoConfig

        AutoConfig.for_model("no_such_model_type")

    monkeypatch.setattr(train, "build_model", api_changed)
    code = run_multitask.cli(_argv(tmp_path / "c", tiny_dense))
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" in err and "internal error: ValueError" in err and "--debug" in err
    with pytest.raises(ValueError):
        run_multitask.cli(_argv(tmp_path / "d", tiny_dense, "--debug"))


def test_an_offline_preset_fails_in_one_paragraph_that_says_presets_download(tmp_path, tiny_dense, capsys):
    code = run_multitask.cli(
        _argv(tmp_path / "p", tiny_dense, "--tasks", "rte")
    )  # the tests run with HF_DATASETS_OFFLINE=1
    captured = capsys.readouterr()
    assert code == 2 and "downloading from the Hugging Face Hub" in captured.out
    # the task and its Hub dataset are named (issue 59 item 9)
    assert "Could not download the data of preset task 'rte' (Hub dataset nyu-mll/glue (rte))" in captured.err
    assert "Traceback" not in captured.err
    assert len(captured.err.strip().splitlines()) == 2  # the paragraph and the --debug pointer


def test_an_offline_preset_in_a_task_config_names_its_task_and_dataset(tmp_path):
    """The preset's name and Hub dataset, whichever task of a mixture failed (not "the preset task data")."""
    import json

    from hf_taskmoe.cli.loading import load_task_data

    config = tmp_path / "tasks.json"
    config.write_text(json.dumps({"tasks": [{"preset": "boolq"}]}))
    with pytest.raises(UsageError) as caught:
        load_task_data([str(config)], ["train"], str(tmp_path / "cache"))
    assert "preset task 'boolq' (Hub dataset aps/super_glue (boolq))" in str(caught.value)


# ------------------------------------------------------------------------------------------- help
def test_help_all_works_and_help_shows_the_values_the_run_uses(capsys):
    assert run_multitask.cli(["--help_all"]) == 0
    text = capsys.readouterr().out
    assert "--push_to_hub" in text and "no checkpoints, no training_args.bin" in " ".join(text.split())
    assert run_multitask.cli(["--help"]) == 0
    text = capsys.readouterr().out
    assert "A bare --debug shows the full" in text
    demo = {line.split()[0]: line for line in text.splitlines() if line.startswith("  --")}
    assert demo["--max_steps"].endswith("[200]") and demo["--max_seq_length"].endswith("[96]")
    assert demo["--output_dir"].endswith("[runs/demo]") and demo["--save_total_limit"].endswith("[2]")
    assert "upload the model, tokenizer, card" in demo["--push_to_hub"]
    assert run_multitask.cli(["--help", "--tasks", "mine.json", "--learning_rate", "3e-5", "--hub_token", SECRET]) == 0
    text = capsys.readouterr().out
    own = {line.split()[0]: line for line in text.splitlines() if line.startswith("  --")}
    assert own["--max_seq_length"].endswith("[128]") and own["--learning_rate"].endswith("[3e-05]")
    assert own["--output_dir"].endswith("[runs/mine]") and SECRET not in text


# ------------------------------------------------------------------------------------------- cards
def test_the_card_names_local_data_by_what_it_is_and_types_regression(tmp_path, tiny_dense, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "card"
    run_multitask.main(_argv(out, tiny_dense))
    card = ModelCard.load(out / "README.md")
    results = card.data.eval_results
    assert {r.dataset_type for r in results} == {"json"}  # local JSON-lines files, not a Hub dataset
    assert all(r.dataset_name.endswith("(local files)") for r in results)
    assert {r.task_type for r in results if r.task_name == "tweet_sentiment"} == {"text-regression"}
    assert {r.task_type for r in results if r.task_name == "trec"} == {"text-classification"}
    assert (
        "Read from: examples/data/demo_mixture/tasks.json (sources and licences: "
        "examples/data/demo_mixture/PROVENANCE.md)"
        in card.content
    )
    for made_up in ("pang-lee/", "li-roth/", "hutto-gilbert/", "uci/sms"):
        assert made_up not in card.content
    # the usage snippet loads the folder the run saved, and it does load there
    assert f'AutoModel.from_pretrained("{out}")' in card.content
    assert "examples seen per task" in card.content
    import re

    assert re.search(r"^\| trec \| (\d+\.\d\d \(\d+\.\d\d\) \| )+", card.content, re.M)  # score (baseline)


def test_the_card_escapes_every_user_supplied_string(tiny_dense):
    from hf_taskmoe import BertForTaskMoE, TaskSpec
    from hf_taskmoe.hub import check_model_card, render_model_card

    evil = "<img src=x onerror=alert(1)>|x"
    task = TaskSpec(name="t", label_names=["<b>a</b>", "b|c"], metrics=["accuracy"], description=evil, dataset=evil)
    model = BertForTaskMoE.from_dense(tiny_dense, [task], num_experts=2)
    card = render_model_card(model, metrics={"eval_t_accuracy": 0.5}, model_name=evil, training={"<script>": "x|y"},
                             data_provenance=[evil])
    body = card.content.split("---", 2)[2]  # the YAML metadata quotes its strings itself
    code = body.split("```python\n", 1)[1].split("```", 1)[0]  # the usage snippet: a Python string literal
    assert 'from_pretrained("<img src=x onerror=alert(1)>|x")' in code
    text = body.replace(code, "")  # rendered markdown: no HTML and no table syntax of the user's
    for raw in ("<img", "<b>", "<script>", "b|c", "x|y"):
        assert raw not in text, raw
    assert "# &lt;img src=x onerror=alert(1)&gt;&#124;x" in text  # the title
    assert "Read from: &lt;img src=x onerror=alert(1)&gt;&#124;x" in text
    task_row = next(line for line in text.splitlines() if line.startswith("| t | single_label_classification"))
    assert task_row.count("|") == 7  # six cells: the labels' and the dataset's pipes are escaped
    assert check_model_card(card) == []


def test_a_metric_name_with_html_and_a_pipe_stays_one_cell(tiny_dense):
    from hf_taskmoe import BertForTaskMoE, TaskSpec
    from hf_taskmoe.hub import render_model_card

    task = TaskSpec(name="t", label_names=["a", "b"], metrics=["accuracy"])
    model = BertForTaskMoE.from_dense(tiny_dense, [task], num_experts=2)
    model.config.tasks[0]["metrics"] = ["acc|<u>x</u>"]  # as a hand-edited config would carry it
    card = render_model_card(model, metrics={"eval_t_acc|<u>x</u>": 0.5})
    header = next(
        line for line in card.content.splitlines() if line.startswith("| task |") and "problem type" not in line
    )
    row = next(line for line in card.content.splitlines() if line.startswith("| t | 50.00"))
    assert header.count("|") == row.count("|") == 3 and "<u>" not in card.content.split("---", 2)[2]


# ------------------------------------------------------------------------------------------- eval-only and resume
def test_an_eval_only_run_says_what_it_wrote_and_its_card_shows_no_training(tmp_path, tiny_dense, capsys):
    run_multitask.main(_argv(tmp_path / "trained", tiny_dense))
    capsys.readouterr()
    out = tmp_path / "eval-only"
    run_multitask.main(_argv(out, tmp_path / "trained", "--do_train", "false"))
    printed = capsys.readouterr().out
    assert "Evaluation only" in printed and "no model was saved" in printed and "Model, tokenizer" not in printed
    assert not (out / "model.safetensors").exists() and (out / "eval_results.json").exists()
    card = ModelCard.load(out / "README.md")
    assert "Not trained in this run" in card.content and "optimizer steps" not in card.content
    assert f'from_pretrained("{tmp_path / "trained"}")' in card.content  # the model it evaluated


def test_a_resumed_run_counts_examples_and_time_from_its_first_step(tmp_path, tiny_dense):
    out = tmp_path / "resumed"
    first = _argv(out, tiny_dense, "--save_strategy", "steps", "--save_steps", "2")
    run_multitask.main(first)
    progress = json.loads((out / "checkpoint-2" / "training_progress.json").read_text())
    assert sum(progress["examples_seen"].values()) == 2 * 4 and progress["train_seconds"] > 0
    run_multitask.main(
        first[: first.index("--max_steps")]
        + ["--max_steps", "4"]
        + first[first.index("--max_steps") + 2 :]
        + ["--resume_from_checkpoint", "latest"]
    )
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 4 and sum(summary["examples_seen"].values()) == 4 * 4  # 2 steps before, 2 after
    assert summary["counts_cover_whole_run"] and summary["train_time_s"] > summary["train_time_s_this_run"] > 0
    assert "after resuming from checkpoint-2" in ModelCard.load(out / "README.md").content


# ------------------------------------------------------------------------------------------- README snippets
def _snippet(readme: str, after_heading: str) -> str:
    import re

    return re.search(re.escape(after_heading) + r".*?```python\n(.*?)```", readme, re.S).group(1)


def _run_as_written(code: str, cwd: Path, minilm: Path) -> subprocess.CompletedProcess:
    """A snippet pasted into a fresh interpreter, the MiniLM's path in place of the placeholder, nothing else."""
    code = code.replace('"path/or/hub-id-of-a-bert"', repr(str(minilm)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def test_quick_start_then_pipeline_snippets_run_as_written_in_a_fresh_interpreter(minilm, tmp_path):
    readme = (ROOT / "README.md").read_text()
    quick = _run_as_written(_snippet(readme, "## Quick start"), tmp_path, minilm)
    assert quick.returncode == 0, quick.stderr[-3000:]
    assert (tmp_path / "my-mttag" / "model.safetensors").exists() and (
        tmp_path / "my-mttag" / "tokenizer.json"
    ).exists()
    deployment = (ROOT / "docs" / "deployment.md").read_text()
    pipe = _run_as_written(
        _snippet(deployment, "## Multi-task pipeline") + "\nprint(pipe('a fine film', task='sst2'))", tmp_path, minilm
    )
    assert pipe.returncode == 0, pipe.stderr[-3000:]
    assert "'task': 'sst2'" in pipe.stdout.splitlines()[-1]


@pytest.mark.slow
def test_training_snippet_runs_as_written_in_a_fresh_interpreter(minilm, tmp_path):
    """From a folder holding the repository's demo data at the same relative path (the docs say: from the repository
    root); trains the snippet's 20 steps of MiniLM and evaluates."""
    import shutil

    training = (ROOT / "docs" / "training.md").read_text()
    code = _snippet(training, "## Training")
    data = tmp_path / "examples" / "data" / "demo_mixture"  # a copy of the repository's data: `out` lands in tmp_path
    shutil.copytree(ROOT / "examples" / "data" / "demo_mixture", data)
    result = _run_as_written(code, tmp_path, minilm)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "'eval_average'" in result.stdout and "'eval_trec_accuracy'" in result.stdout


# ------------------------------------------------------------------------------------------- task-config format
def test_the_task_config_schema_lists_the_loaders_fields_and_accepts_every_shipped_file(tmp_path):
    import dataclasses

    jsonschema = pytest.importorskip("jsonschema")
    from hf_taskmoe import TaskSpec
    from hf_taskmoe.tasks import PROBLEM_TYPES
    from hf_taskmoe.training import load_tasks
    from hf_taskmoe.training.data import SPLITS, TASK_PRESETS

    schema = json.loads((ROOT / "examples/data/task_config.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    task = schema["$defs"]["task"]
    assert set(task["properties"]) == {f.name for f in dataclasses.fields(TaskSpec)} | {f"{s}_file" for s in SPLITS}
    assert sorted(task["properties"]["problem_type"]["enum"]) == sorted(PROBLEM_TYPES)
    assert schema["$defs"]["preset"]["properties"]["preset"]["enum"] == sorted(TASK_PRESETS)
    page = (ROOT / "docs" / "task-config.md").read_text()
    for field in task["properties"]:  # every field documented in the task-config format's table
        assert f"`{field}`" in page, field
    shipped = [p for p in (ROOT / "examples/data").rglob("*.json") if "tasks" in json.loads(p.read_text())]
    assert len(shipped) >= 4
    for path in shipped:
        assert not list(validator.iter_errors(json.loads(path.read_text()))), path
    # a misspelt field: the schema and the loader both refuse it by name
    bad = {"tasks": [{"name": "t", "label_names": ["a", "b"], "labelfield": "y"}]}
    assert any("labelfield" in e.message for e in validator.iter_errors(bad))
    with pytest.raises(ValueError, match="labelfield"):
        (tmp_path / "tasks.json").write_text(json.dumps(bad))
        load_tasks([str(tmp_path / "tasks.json")], splits=[])


# ------------------------------------------------------------------------------- issue 44: refusals, resume, card
def _checkpoint_folder(tmp_path, name, config):
    folder = tmp_path / name
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


BAD_INPUTS = {
    "no such model folder": (lambda t, d: ["--model_name_or_path", str(t / "nope")], r"no such folder"),
    "a file as the model": (lambda t, d: ["--model_name_or_path", str(d / "vocab.txt")], r"is a file"),
    "a folder without config.json": (
        lambda t, d: ["--model_name_or_path", str(_checkpoint_folder(t, "empty", None))], r"holds no config.json"),
    "an unknown model_type with code of its own": (
        lambda t, d: ["--model_name_or_path", str(_checkpoint_folder(
            t, "remote", {"model_type": "zzz", "auto_map": {"AutoConfig": "m.C", "AutoModel": "m.M"}}))],
        r"names model_type 'zzz', which neither transformers .* nor hf_taskmoe knows and asks to run code"),
    "a config without weights": (
        lambda t, d: ["--model_name_or_path", str(_checkpoint_folder(
            t, "noweights", json.loads((d / "config.json").read_text())))], r"cannot load the checkpoint's weights"),
    "no such tokenizer": (lambda t, d: ["--tokenizer_name", str(t / "nope")], r"--tokenizer_name .*: no such folder"),
    "an unknown family": (lambda t, d: ["--model_family", "nope"],
                          r"families built from a dense checkpoint \[.*'taskmoe'.*\] or another name of one "
                          r"\[.*'bert_taskmoe'.*'mt-tag'.*\], got 'nope'"),
    "max_seq_length 0": (lambda t, d: ["--max_seq_length", "0"], r"`max_seq_length` must be an integer >= 1, got 0"),
    "max_seq_length beyond the positions": (lambda t, d: ["--max_seq_length", "4096"], r"exceeds the 512 positions"),
    "max_train_samples 0": (lambda t, d: ["--max_train_samples", "0"], r"`max_train_samples` must be an integer"),
    "pad_to_multiple_of -1": (lambda t, d: ["--pad_to_multiple_of", "-1"], r"`pad_to_multiple_of` must be"),
    "task_specific_steps -1": (lambda t, d: ["--task_specific_steps", "-1"], r"`task_specific_steps` must be"),
    "a negative learning rate": (lambda t, d: ["--learning_rate", "-1"], r"`learning_rate` must be a finite number"),
    "zero epochs": (lambda t, d: ["--max_steps", "-1", "--num_train_epochs", "0"], r"`num_train_epochs` must be > 0"),
    "an ambiguous option": (lambda t, d: ["--sampling", "x"], r"ambiguous option: --sampling"),
    "init_from on a dense checkpoint": (lambda t, d: ["--init_from", "trec"], r"--init_from trec: applies when"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_every_bad_argument_is_one_paragraph_and_exit_2(tmp_path, tiny_dense, capsys, case):
    """Issue 44 item 2: each wrong input is refused in one paragraph with exit status 2, never an "internal error"
    (a bug of ours) nor argparse's usage screen; nothing is written to the output folder."""
    extra, message = BAD_INPUTS[case]
    code = run_multitask.cli(_argv(tmp_path / "out", tiny_dense, "--do_eval", "false", *extra(tmp_path, tiny_dense)))
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if "Loading weights" not in line]  # progress bars
    assert code == 2, err
    assert len(lines) == 2 and lines[0].startswith("error: ") and "--debug" in lines[1], err
    assert re.search(message, lines[0]), lines[0]
    assert "internal error" not in err and "Traceback" not in err and "mmoe" not in lines[0]
    assert not (tmp_path / "out" / "config.json").exists()


def test_resuming_past_a_cut_short_checkpoint_says_which_and_why_in_one_line(tmp_path, tiny_dense, capsys):
    """Issue 44 item 4: `--resume_from_checkpoint latest` falls back to an older checkpoint and says on stderr, in one
    line and whatever --log_level, which it skipped and why."""
    out = tmp_path / "run"
    run_multitask.main(_argv(out, tiny_dense, "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2",
                             "--do_eval", "false"))
    state = out / "checkpoint-4" / "trainer_state.json"
    state.write_text(state.read_text()[:40])  # kill -9 while it was written
    capsys.readouterr()
    code = run_multitask.cli(_argv(out, tiny_dense, "--max_steps", "4", "--resume_from_checkpoint", "latest",
                                   "--do_eval", "false", "--log_level", "error"))
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "checkpoint-4" in line]
    assert code == 0 and len(said) == 1, err
    assert said[0].startswith("Skipped the incomplete checkpoint checkpoint-4 (trainer_state.json (unreadable")
    assert said[0].endswith("resuming from checkpoint-2 instead.")


def test_an_output_folder_named_with_html_gives_an_escaped_card_title(tmp_path, tiny_dense):
    """Issue 44 item 5: the card's title, in the text and in the metadata's model name, escapes the folder's name."""
    out = tmp_path / "<img src=x onerror=alert(1)>"
    run_multitask.main(_argv(out, tiny_dense, "--do_train", "false", "--max_eval_samples", "4"))
    card = ModelCard.load(out / "README.md")
    assert card.data.model_name == "&lt;img src=x onerror=alert(1)&gt;"
    assert "\n# &lt;img src=x onerror=alert(1)&gt;\n" in card.content
    code = card.content.split("```python\n", 1)[1].split("```", 1)[0]  # a Python string literal there
    assert "<img" not in card.content.replace(code, "")


# ------------------------------------------------------------------------------------------- issue 59 item 5
def test_a_family_that_cannot_take_the_tasks_is_refused_before_the_checkpoint_loads(
    tmp_path, tiny_dense, monkeypatch, capsys
):
    """`--model_family task-routing` on the demo's classification tasks: one paragraph naming the tasks, their problem
    types and the methods that take them, before the BERT is warm-started into a BART or loaded (no load report)."""
    from hf_taskmoe.models.registry import FAMILIES

    def never(*args, **kwargs):
        raise AssertionError("the checkpoint was prepared or loaded before the refusal")

    from hf_taskmoe.models import family_for

    family, bart = FAMILIES["task_routing"], family_for("task-routing", "bert")  # a BERT builds a BartTaskRouted
    variants = tuple(dataclasses.replace(m, prepare_dense=never) for m in family.variants)
    monkeypatch.setitem(FAMILIES, "task_routing", dataclasses.replace(family, variants=variants))
    monkeypatch.setattr(bart.model_class, "from_dense", never)
    code = run_multitask.cli(_argv(tmp_path / "r", tiny_dense, "--model_family", "task-routing"))
    captured = capsys.readouterr()
    assert code == 2 and "Traceback" not in captured.err
    assert re.search(r"--model_family task-routing: task_routing \(BartTaskRouted\) cannot train task '\w+' "
                     r"\(single_label_classification\)", captured.err)
    assert "it supports the problem types ['seq2seq']" in captured.err
    assert "Methods that take those tasks: ca-mtl, mt-tag, pals." in captured.err
    assert len(captured.err.strip().splitlines()) == 2  # the paragraph and the --debug pointer
    assert "MISSING" not in captured.out + captured.err and not list(tmp_path.rglob("*.safetensors"))
