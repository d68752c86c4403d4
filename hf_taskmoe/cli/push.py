"""Secrets and the Hub push of a training run: which argument values are secrets (never written to a file, never
pushed), which files of a run folder are uploaded, and an upload that, when it fails, says where everything is and
the command that finishes it."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

from .errors import UsageError

# Argument and environment names whose values are secrets: never written to a file of the run, never pushed
SECRET_NAME = re.compile(r"(^|_)(token|password|passwd|secret|key|api_key|apikey|credentials?)$", re.IGNORECASE)
# The files --push_to_hub uploads, top level of the output folder only (checkpoints, training_args.bin,
# trainer_state.json and run_summary.json, which records the command line and the machine, stay local)
PUSH_FILES = (
    "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json", "config.json",
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
    "vocab.json", "merges.txt", "added_tokens.json", "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja",
    "README.md", "all_results.json", "train_results.json", "eval_results.json", "routing.json", "routing_train.json",
    "generations.json", "finetune_results.json", "*.png",
)


def redacted_argv(argv: list[str]) -> list[str]:
    """`argv` with the value of every option named like a secret (`--hub_token`, `--x_password`, ...) replaced by
    `<redacted>`: what `run_summary.json` records."""
    out, hide_next = [], False
    for arg in argv:
        if hide_next and not arg.startswith("--"):
            out.append("<redacted>")
            hide_next = False
            continue
        hide_next = False
        if arg.startswith("--"):
            name, eq, _ = arg[2:].partition("=")
            if SECRET_NAME.search(name):
                if eq:
                    out.append(f"--{name}=<redacted>")
                    continue
                hide_next = True
        out.append(arg)
    return out


def take_secrets(*argument_objects) -> dict[str, str]:
    """Remove every secret-named field's value (`hub_token`, ...) from the parsed arguments and return them: the
    Trainer pickles its arguments into `training_args.bin` (also in every checkpoint), so a token left there would
    be written to disk and could be pushed."""
    secrets = {}
    for obj in argument_objects:
        for f in dataclasses.fields(obj):
            if SECRET_NAME.search(f.name) and getattr(obj, f.name, None) not in (None, ""):
                secrets[f.name] = getattr(obj, f.name)
                setattr(obj, f.name, None)
    return secrets


def check_push(training_args, token: str | None = None) -> None:
    """What can be checked before training: a token (`token`: the one given, taken out of the arguments), and a
    well-formed repo id."""
    if not training_args.push_to_hub:
        return
    from huggingface_hub import get_token
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo_id = training_args.hub_model_id or Path(training_args.output_dir).name
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise UsageError(
            f"--push_to_hub: the repo id {repo_id!r} is not valid ({err}); set --hub_model_id user/name."
        ) from None
    if (token or get_token()) is None:
        raise UsageError(
            "--push_to_hub needs a Hugging Face token: run `hf auth login` or pass --hub_token, then start again."
        )


def files_to_push(folder: str) -> list[str]:
    """The files of `folder` that --push_to_hub uploads: the top-level files matching `PUSH_FILES` (model weights,
    config, tokenizer, card, metrics, plots), sorted; never a checkpoint, `training_args.bin`, `trainer_state.json`
    or `run_summary.json`."""
    import fnmatch

    return sorted(p.name for p in Path(folder).iterdir()
                  if p.is_file() and any(fnmatch.fnmatchcase(p.name, pattern) for pattern in PUSH_FILES))


def upload_command(folder: str, repo_id: str, files: list[str]) -> str:
    """The `hf upload` command that uploads exactly `files` of `folder` (what the failed push tried)."""
    import shlex

    include = " ".join(f"--include {shlex.quote(name)}" for name in files)
    return f"hf upload {shlex.quote(repo_id)} {shlex.quote(str(folder))} . {include}"


def push(folder: str, repo_id: str, token: str | None, private: bool | None = None) -> bool:
    """Upload the allow-listed files of the saved run folder (`files_to_push`); on failure, say in one paragraph
    what failed, where everything is and the command that uploads the same files later. Returns whether the upload
    succeeded."""
    from huggingface_hub import create_repo, upload_folder

    files = files_to_push(folder)
    try:
        create_repo(repo_id, token=token, private=private, exist_ok=True)
        upload_folder(repo_id=repo_id, folder_path=folder, token=token, allow_patterns=files,
                      commit_message="hf_taskmoe run_multitask.py")
    except Exception as err:  # noqa: BLE001 -- any failure of the upload leaves the local run intact
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        if token:
            reason = reason.replace(token, "<redacted>")
        print(
            f"\nThe upload to the Hub failed ({type(err).__name__}: {reason}). Nothing is lost: the model, tokenizer, "
            f"metrics and model card are saved in {folder}. Upload them later with\n"
            f"  {upload_command(folder, repo_id, files)}\n",
            file=sys.stderr,
        )
        return False
    print(f"Uploaded {len(files)} files of {folder} to https://huggingface.co/{repo_id}: {', '.join(files)}")
    return True

