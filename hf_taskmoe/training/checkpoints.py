"""A run's checkpoint folders (`checkpoint-<step>` under the output folder): which are complete, which to resume
from, and the task sampler's state written into each. `MultiTaskTrainer` resumes with these; the command line's run
folder checks (`hf_taskmoe.cli.run_folder`) read them too."""

from __future__ import annotations

import json
import logging
import os
import re

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

logger = logging.getLogger(__name__)

SAMPLER_STATE_NAME = "task_sampler.json"
TRAINER_STATE_NAME = "trainer_state.json"


class TaskSamplerCheckpointCallback(TrainerCallback):
    """Writes the task sampler's configuration and state into every checkpoint folder (`trainer`: the
    `MultiTaskTrainer` whose `task_sampler` it saves)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        sampler = self.trainer.task_sampler
        if sampler is None or not state.is_world_process_zero:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if os.path.isdir(folder):
            payload = {"config": sampler.config(), "strategy_state": getattr(sampler.strategy, "state_dict", dict)()}
            path = os.path.join(folder, SAMPLER_STATE_NAME)
            with open(path + ".tmp", "w") as f:  # written whole, then renamed: a kill leaves no half file
                json.dump(payload, f, indent=2)
            os.replace(path + ".tmp", path)


def _whole_folder(checkpoint: str, name: str) -> bool:
    """A sharded save's folder, whole: torch's distributed checkpoint writes its `.metadata` last."""
    path = os.path.join(checkpoint, name)
    if not os.path.isdir(path):
        return False
    return os.path.exists(os.path.join(path, ".metadata")) if name.startswith(("pytorch_model_fsdp_", "optimizer_")) \
        else bool(os.listdir(path))


def missing_checkpoint_files(checkpoint: str) -> list[str]:
    """What a checkpoint needs to continue a run exactly and does not hold (empty: complete)."""
    files = set(os.listdir(checkpoint))
    # sharded runs save folders: FSDP's `pytorch_model_fsdp_0/` and `optimizer_0/` (torch distributed checkpoint, one
    # file per rank), DeepSpeed's `global_step<k>/` (each rank's model and optimizer partitions) named by `latest`
    sharded = {
        "model": any(f.startswith("pytorch_model_fsdp_") and _whole_folder(checkpoint, f) for f in files),
        "optimizer": any(f.startswith("optimizer_") and _whole_folder(checkpoint, f) for f in files),
    }
    deepspeed = "latest" in files and any(f.startswith("global_step") and _whole_folder(checkpoint, f) for f in files)
    wanted = {
        "model weights": deepspeed or sharded["model"] or any(
            f.startswith(("model", "adapter_model", "pytorch_model")) and f.endswith((".safetensors", ".bin", ".json"))
            for f in files
        ),
        TRAINER_STATE_NAME: TRAINER_STATE_NAME in files,
        "optimizer.pt": "optimizer.pt" in files or deepspeed or sharded["optimizer"],
        "scheduler.pt": "scheduler.pt" in files or deepspeed,  # DeepSpeed's own scheduler is in its partitions
        "rng_state.pth": any(f.startswith("rng_state") for f in files),
    }
    return [name for name, present in wanted.items() if not present]


def unreadable_checkpoint_files(checkpoint: str) -> list[str]:
    """The JSON files of a checkpoint that are there but cut short or corrupt (kill -9 while they were written):
    `trainer_state.json`, `task_sampler.json`, each named with what is wrong (empty: all readable)."""
    broken = []
    for name in (TRAINER_STATE_NAME, SAMPLER_STATE_NAME):
        path = os.path.join(checkpoint, name)
        if not os.path.exists(path):
            continue
        try:
            with open(path) as f:
                content = json.load(f)
            if not isinstance(content, dict):
                raise ValueError(f"a JSON {type(content).__name__}, not an object")
        except (OSError, UnicodeDecodeError, ValueError) as err:
            broken.append(
                f"{name} (unreadable, cut short while it was written? "
                f"{str(err).splitlines()[0] if str(err) else type(err).__name__})"
            )
    return broken


def skipped_checkpoint_line(skipped: list[tuple[str, str]], taken: str | None) -> str:
    """The one line that says which newer checkpoints resuming skipped and why, and which it takes instead."""
    said = "; ".join(f"{os.path.basename(path)} ({why})" for path, why in skipped)
    then = f"resuming from {os.path.basename(taken)} instead" if taken else "no complete checkpoint is left"
    return f"Skipped the incomplete checkpoint{'s' if len(skipped) > 1 else ''} {said}: {then}."


def scan_checkpoints(output_dir: str) -> tuple[str | None, list[tuple[str, str]]]:
    """`(the newest checkpoint-<step> of output_dir that holds everything a resume needs, [(each newer incomplete
    checkpoint -- a run killed while saving --, what it lacks or what is unreadable)])`."""
    if not os.path.isdir(output_dir):
        return None, []
    pattern = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
    found = sorted(
        ((int(m.group(1)), name) for name in os.listdir(output_dir) if (m := pattern.match(name))), reverse=True
    )
    skipped = []
    for _, name in found:
        path = os.path.join(output_dir, name)
        missing = missing_checkpoint_files(path)
        broken = unreadable_checkpoint_files(path)
        if not missing and not broken:
            return path, skipped
        skipped.append((path, "; ".join(([f"{', '.join(missing)} missing"] if missing else []) + broken)))
    return None, skipped


def latest_complete_checkpoint(output_dir: str) -> str | None:
    """The newest `checkpoint-<step>` of `output_dir` that holds everything a resume needs; newer incomplete ones
    (a run killed while saving) are skipped with a warning naming each and why (`scan_checkpoints`)."""
    latest, skipped = scan_checkpoints(output_dir)
    if skipped:
        logger.warning(skipped_checkpoint_line(skipped, latest))
    return latest
