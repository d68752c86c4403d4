"""The output folder of a training run: refuse a file, a read-only folder or a folder another run holds or used;
claim it for the run (`RunLock`); find the checkpoint to resume from; stage a run that replaces an earlier one and
swap it in once saved."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..training.checkpoints import scan_checkpoints, skipped_checkpoint_line, unreadable_checkpoint_files
from .errors import UsageError
from .push import redacted_argv


def earlier_run(out: Path) -> list[str]:
    """The files and checkpoints of an earlier run in `out` (empty: none)."""
    if not out.is_dir():
        return []
    found = sorted(p.name for p in out.iterdir() if p.name.startswith(f"{PREFIX_CHECKPOINT_DIR}-"))
    return found + [
        name
        for name in ("config.json", "model.safetensors", "model.safetensors.index.json", "trainer_state.json")
        if (out / name).exists()
    ]


def check_writable_folder(out: Path) -> None:
    """`--output_dir` must be a folder (or not exist yet) that this process can write in, and so must the folder it
    is in (the run's lock and, with --overwrite_output_dir, its staging folder go beside it)."""
    if out.exists() and not out.is_dir():
        raise UsageError(
            f"--output_dir {out} is a file, not a folder: the run writes its model, checkpoints and card into a "
            "folder. Pass a folder's path (a new one is created), or move the file away."
        )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--output_dir {out}: cannot create the folder {out.parent} ({err.strerror or err}). Pass an "
                         "--output_dir under a folder you can write in.") from None
    import tempfile

    for folder in (out.parent, out) if out.is_dir() else (out.parent,):
        try:
            probe, name = tempfile.mkstemp(prefix=".write-test-", dir=folder)
            os.close(probe)
            os.unlink(name)
        except OSError as err:
            raise UsageError(
                f"--output_dir {out}: the folder {folder} is not writable ({err.strerror or err}). Pass an "
                "--output_dir you can write in, or make it writable."
            ) from None


class RunLock:
    """The claim of one run on its output folder: `.<name>.lock` beside it, holding the run's pid, host and start time
    (created with O_EXCL, so two runs cannot both hold it). A second run into the folder is refused naming the first;
    a lock whose run is gone (its pid dead on this host: kill -9, a crash) is taken over with a notice. Released at
    the end of the run, whatever its outcome."""

    def __init__(self, out: Path):
        self.out = out
        real = out.resolve()  # `--output_dir .` or a symlink: the lock goes beside the folder itself
        self.path = real.parent / f".{real.name}.lock"
        self.held = False

    def describe(self, holder: dict | None) -> str:
        if not holder:
            return f"a run whose lock file {self.path} is empty or unreadable"
        return (f"the run with pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')} "
                f"(lock file {self.path})")

    def _holder(self) -> dict | None:
        try:
            holder = json.loads(self.path.read_text())
            return holder if isinstance(holder, dict) else None
        except (OSError, ValueError):
            return None

    def _is_stale(self, holder: dict | None) -> bool:
        import socket

        if not holder:  # written this instant by another run, or cut short by a crash long ago
            try:
                return time.time() - self.path.stat().st_mtime > 10
            except OSError:
                return True
        if holder.get("host") != socket.gethostname():
            return False  # cannot tell whether a process on another machine is alive
        pid = holder.get("pid")
        if not isinstance(pid, int) or pid == os.getpid():  # our own pid but not our lock: an earlier holder's, reused
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def acquire(self, argv: list[str]) -> None:
        import socket

        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                  "output_dir": str(self.out.resolve()), "argv": redacted_argv(argv)}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if not self._is_stale(holder):
                    raise UsageError(
                        f"--output_dir {self.out} is in use by {self.describe(holder)}. Two runs in one folder would "
                        "mix "
                        "their models, checkpoints and cards. Wait for that run to finish, or pass another "
                        "--output_dir; if "
                        f"that run is no longer running (its machine is down), delete {self.path}."
                    ) from None
                print(
                    f"Taking over the stale lock of {self.describe(holder)}: that run is no longer running.",
                    file=sys.stderr,
                )
                self.path.unlink(missing_ok=True)
                continue
            except OSError as err:
                raise UsageError(
                    f"--output_dir {self.out}: cannot create its lock file {self.path} ({err.strerror or err}). "
                    "Pass an --output_dir under a folder you can write in."
                ) from None
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            return
        raise UsageError(
            f"--output_dir {self.out}: another run claimed it at the same moment ({self.describe(self._holder())})."
        )

    def release(self) -> None:
        if self.held and (self._holder() or {}).get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
        self.held = False


def staging_dir(out: Path) -> Path:
    """Where a run that replaces an earlier one (--overwrite_output_dir) writes until it is complete: beside `out`."""
    real = out.resolve()
    return real.parent / f".{real.name}.overwrite-staging"


def replace_output_dir(staging: Path, out: Path) -> None:
    """Swap the complete new run in `staging` for the earlier run in `out`, as a model's save does
    (`hf_taskmoe.folder_swap.swap_in`: one exchange of the two folders where the system has it, `out` always holding
    one complete run, else two renames through the backup that `from_pretrained` and the next save recover); where
    `out` cannot be renamed (a mount point, a folder another process holds open), the new files are copied onto its
    device first, then the old ones removed (`hf_taskmoe.folder_swap.install_staged`)."""
    from hf_taskmoe.folder_swap import install_staged, swap_in

    try:
        swap_in(staging, out)
    except OSError:  # EBUSY, EXDEV: `out` cannot be renamed
        install_staged(staging, out, stale=[p.name for p in out.iterdir()])
        shutil.rmtree(staging, ignore_errors=True)


def check_output_dir(training_args, overwrite_output_dir: bool = False) -> str | None:
    """Refuse to mix two runs in one folder (or write into a file or a read-only folder); return the checkpoint to
    resume from (or None). An earlier run is not touched here: with --overwrite_output_dir the new run is staged
    beside it and swapped in once saved (`stage_over_earlier_run`)."""
    out = Path(training_args.output_dir)
    check_writable_folder(out)
    resume = training_args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("latest", "true"):
        last, skipped = scan_checkpoints(str(out))
        if last is None:
            raise UsageError(
                f"--resume_from_checkpoint {resume}: there is no complete checkpoint in {out} to resume from"
                + (f" ({skipped_checkpoint_line(skipped, None)})" if skipped else ".")
            )
        if skipped and training_args.process_index == 0:  # on stderr whatever --log_level says: the run goes on
            print(skipped_checkpoint_line(skipped, last), file=sys.stderr)
        return last
    if resume:
        if not Path(resume).is_dir():
            raise UsageError(f"--resume_from_checkpoint {resume}: no such checkpoint folder.")
        broken = unreadable_checkpoint_files(str(resume))
        if broken:
            raise UsageError(
                f"--resume_from_checkpoint {resume}: the checkpoint cannot be resumed: {'; '.join(broken)}. "
                "Pass an earlier checkpoint, or --resume_from_checkpoint latest (the newest complete one)."
            )
        return str(resume)
    if not training_args.do_train:
        return None
    found = earlier_run(out)
    if found and not overwrite_output_dir:
        raise UsageError(
            f"{out} holds another run ({', '.join(found[:6])}{' ...' if len(found) > 6 else ''}). Training into it "
            "would mix "
            "the two. Pass --resume_from_checkpoint latest to continue it, --overwrite_output_dir to replace it, or "
            "another --output_dir."
        )
    return None


def check_distributed(training_args) -> None:
    """torchrun on a machine without a GPU needs --use_cpu: otherwise every rank trains its own unwrapped copy on all
    the data, and nothing says so."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not training_args.use_cpu and not torch.cuda.is_available():
        raise UsageError(
            f"Started by torchrun with {world} processes on a machine without a GPU, but without --use_cpu: each "
            "process "
            "would train its own copy on all the data. Add --use_cpu (the processes then train one model with DDP over "
            "gloo)."
        )


def claim_output_dir(training_args, argv: list[str], overwrite_output_dir: bool, cleanup) -> tuple[Path, str | None,
                                                                                                     Path | None]:
    """Everything about `training_args.output_dir` before any compute: refuse CPU-only torchrun without --use_cpu,
    a file, a read-only folder, a folder another run holds (the lock, released through `cleanup`, a
    `contextlib.ExitStack`) or one an earlier run used (unless resumed or replaced). Returns `(folder, checkpoint,
    staging)`: the run's folder, the checkpoint to resume from (or None) and, when the run replaces an earlier one
    (`overwrite_output_dir`), the staging folder it is written to until it is complete (`training_args.output_dir`
    is set to it; `replace_output_dir` swaps it in; removed through `cleanup` if the run fails)."""
    check_distributed(training_args)
    folder = Path(training_args.output_dir)
    if training_args.process_index == 0:  # the folder is claimed for the whole run
        check_writable_folder(folder)
        lock = RunLock(folder)
        lock.acquire(argv)
        cleanup.callback(lock.release)
    checkpoint = check_output_dir(training_args, overwrite_output_dir)
    staging = None
    if overwrite_output_dir and training_args.do_train and not checkpoint and earlier_run(folder):
        # the earlier run stays until this one is saved: written beside it, swapped in at the end
        staging = staging_dir(folder)
        if training_args.process_index == 0:
            shutil.rmtree(staging, ignore_errors=True)  # a crashed run's (we hold the lock)
            cleanup.callback(shutil.rmtree, staging, ignore_errors=True)
        training_args.output_dir = str(staging)
    return folder, checkpoint, staging
