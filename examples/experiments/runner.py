#!/usr/bin/env python
"""The experiment runner: one declarative file -> cells -> one JSONL results file, resumable.

An experiment file (JSON) names a task-config, the seeds, the options every cell shares and the methods:

```json
{"name": "main", "tasks": "../../data/suite/main.json", "seeds": [1, 2, 3],
 "common": {"max_seq_length": 64, "num_train_epochs": 3, "learning_rate": 1e-4},
 "methods": [
   {"name": "single_task", "single_task": true, "args": {"num_experts": 1}},
   {"name": "mt_tag", "args": {"num_experts": 4, "gating": "task"}, "keep_model": true},
   {"name": "mt_tag_related", "from": "main/mt_tag", "tasks": "../../data/suite/movie.json",
    "args": {"init_from": "tweet_sentiment"}, "variants": {"1pct": {"max_train_samples": 20}}}
 ]}
```

A cell is (method, variant, task for single-task methods, seed). Every cell runs `examples/run_multitask.py`
in its own process -- the code path users run, not a second training loop -- with the common options, the
method's and the variant's, `--seed`, and its own `--output_dir` (`runs/experiments/<experiment>/<cell>`). A
method with `"from": "<experiment>/<method>"` continues that method's saved model of the same seed (it must
have `"keep_model": true`). A method with `"same_as": "<experiment>/<method>"` is a cell that experiment
already ran with the same command line (a grid's point that is the main comparison's method): its finished
records are copied, marked `reused_from`, instead of training again; a differing command line is refused.
Paths in the file are relative to it.

Each finished cell is appended to the results file (`results/<experiment>.jsonl`, one JSON object per line,
written with one `write` on a file opened for appending, then fsync'ed): experiment, method, variant, task, seed,
status, every metric, the per-task scores, the dev curve, steps, examples seen per task, wall time, peak memory,
library versions, git revision and the command line. A restart skips the cells whose last record is `ok` and ran the
command line the file gives them now (change a budget and its cells run again); a cell
that fails records its error (the log's tail) and the others go on; failed cells run again on the next start.
A cell saves a checkpoint where it evaluates (the newest kept; `cell.json` in its folder names the command line
they belong to): a cell cut off mid-run continues from its newest complete checkpoint on the next start, to the
scores an uninterrupted run gives (its record says `resumed_from`, and its `wall_time_s` counts the last part
only); `--no_checkpoints` saves none and starts interrupted cells afresh. Checkpoints go once the cell finishes.
Several runners may work on one experiment at once (one per core, or a restart while the first still runs): each
cell is claimed with an exclusive `flock` on a file beside its output folder (`<cell>.lock`, holding host and PID;
held by the runner and the cell's process, dropped by the kernel when both have exited or died), so no cell is
trained twice and no runner deletes another's output folder.

    python examples/experiments/runner.py examples/experiments/configs/main.json [--threads 1] [--only mt_tag]
    python examples/experiments/report.py examples/experiments/results/main.jsonl     # tables and plots

(`--list` prints the cells and whether they are done, running in a runner, resumable from an interrupted run's
checkpoint (named), to do, or stale: finished with another command line than the experiment file now gives them,
so to do again.)
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "run_multitask.py"
RESULTS = Path(__file__).resolve().parent / "results"
RUNS = ROOT / "runs" / "experiments"


@dataclass
class Cell:
    experiment: str
    method: str
    seed: int
    argv: list[str]
    variant: str | None = None
    task: str | None = None
    keep_model: bool = False
    depends_on: str | None = None  # output folder of the cell whose model this one continues
    runs: Path = RUNS
    same_as: str | None = None  # "<experiment>/<method>" whose record of this seed this cell reuses

    @property
    def key(self) -> str:
        return "/".join(p for p in (self.method, self.variant, self.task, f"seed{self.seed}") if p)

    @property
    def output_dir(self) -> Path:
        return self.runs / self.experiment / self.key


def _options(values: dict) -> list[str]:
    """`{"learning_rate": 1e-4, "log_routing": true, "tasks": [a, b]}` -> command-line options."""
    argv = []
    for name, value in values.items():
        if value is None:
            continue
        if value is True:
            argv.append(f"--{name}")
        elif value is False:
            argv += [f"--{name}", "false"]
        elif isinstance(value, list):
            argv += [f"--{name}", *map(str, value)]
        else:
            argv += [f"--{name}", str(value)]
    return argv


def _task_names(task_config: Path) -> list[str]:
    return [t["name"] for t in json.loads(task_config.read_text())["tasks"]]


def read_spec(path: Path) -> dict:
    """An experiment file; `"extends": "other.json"` takes that file's `common` options (overridden by this
    file's), `tasks`, `seeds` and `small_tasks` unless this file sets them (so that experiments share a budget)."""
    spec = json.loads(path.read_text())
    if "extends" in spec:
        base_path = (path.parent / spec["extends"]).resolve()
        base = read_spec(base_path)
        for key in ("tasks", "seeds", "small_tasks", "report_tasks"):
            if key not in spec and key in base:
                spec[key] = base[key] if key != "tasks" else str((base_path.parent / base[key]).resolve())
        spec["common"] = {**base.get("common", {}), **spec.get("common", {})}
    return spec


def load_experiment(path: str | os.PathLike, runs: Path = RUNS) -> tuple[dict, list[Cell]]:
    """The experiment's definition and its cells, in the order they run (seeds outermost, so that a partial
    run holds whole seeds of every method)."""
    path = Path(path).resolve()
    spec = read_spec(path)
    for key in ("name", "tasks", "seeds", "methods"):
        if key not in spec:
            raise ValueError(f"{path}: an experiment needs `{key}`.")
    names = [m["name"] for m in spec["methods"]]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: method names must be unique, got {names}.")
    cells = []
    for seed in spec["seeds"]:
        for method in spec["methods"]:
            tasks = (path.parent / method.get("tasks", spec["tasks"])).resolve()
            options = {**spec.get("common", {}), **method.get("args", {}), "tasks": [str(tasks)], "seed": seed}
            depends_on = None
            if "from" in method:
                experiment, _, source = method["from"].partition("/")
                depends_on = str(runs / experiment / f"{source}/seed{seed}")
                options["model_name_or_path"] = depends_on
            variants = method.get("variants") or {None: {}}
            for variant, values in variants.items():
                per_task = _task_names(tasks) if method.get("single_task") else [None]
                for task in per_task:
                    cell_options = {**options, **values}
                    if task is not None:
                        cell_options["task_names"] = [task]
                    cells.append(Cell(spec["name"], method["name"], seed, _options(cell_options), variant, task,
                                      method.get("keep_model", False), depends_on, runs, method.get("same_as")))
    return spec, cells


# ----------------------------------------------------------------------------------------------- results
def _portable(argv: list[str]) -> list[str]:
    """A command line with the machine's locations removed, to compare runs made in two checkouts or with two
    `--runs` folders: task files from `examples/` on, and a model an earlier cell saved (`--model_name_or_path
    <runs>/<experiment>/<method>/seed<k>`) by its last three parts."""
    anchor = os.sep + "examples" + os.sep
    out = [arg[arg.rindex(anchor) + 1:] if anchor in arg else arg for arg in argv]
    for i, arg in enumerate(out[:-1]):
        if arg == "--model_name_or_path" and os.path.isabs(out[i + 1]):
            out[i + 1] = "/".join(Path(out[i + 1]).parts[-3:])
    return out


def options(argv: list[str]) -> dict[str, tuple[str, ...]]:
    """A command line as `{option: values}` (portable paths), so that two
    command lines compare whatever the order of their options."""
    parsed: dict[str, list[str]] = {}
    current = None
    for arg in _portable(argv):
        if arg.startswith("--"):
            current = arg
            parsed[current] = []
        elif current is not None:
            parsed[current].append(arg)
    return {k: tuple(v) for k, v in parsed.items()}


def _same_value(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    if a == b:
        return True
    try:  # 1e-4 and 0.0001 are one learning rate
        return len(a) == len(b) and all(float(x) == float(y) for x, y in zip(a, b))
    except ValueError:
        return False


def same_command(record_argv: list[str], cell_argv: list[str], extra_allowed: bool = False) -> bool:
    """Whether a record ran the cell's command line (options in any order, numbers by value); with
    `extra_allowed`, the record may add options (a runner's `--set bf16=true`)."""
    ran, wanted = options(record_argv), options(cell_argv)
    if not extra_allowed and set(ran) != set(wanted):
        return False
    return all(k in ran and _same_value(ran[k], v) for k, v in wanted.items())


def finished(record: dict | None, cell: Cell) -> bool:
    """Whether `record` is this cell done: status ok and run with the command line the experiment file gives it
    now. A cell whose options changed since (a longer budget, another learning rate) is to do again: its new
    record supersedes the old one, so results of two budgets are never averaged together."""
    return record is not None and record["status"] == "ok" and same_command(record.get("argv") or [], cell.argv)


def reuse_record(cell: Cell, results_dir: Path) -> dict:
    """The record a `same_as` cell copies from the other experiment's results, or an error if there is none
    finished for this seed or it ran another command line."""
    experiment, _, method = cell.same_as.partition("/")
    source_key = "/".join(p for p in (method, cell.variant, cell.task, f"seed{cell.seed}") if p)
    source = read_results(results_dir / f"{experiment}.jsonl").get(source_key)
    if source is None or source["status"] != "ok":
        raise ValueError(f"{cell.experiment}/{cell.key} reuses {experiment}/{source_key}, which has not finished "
                         f"in {results_dir / (experiment + '.jsonl')}: run that experiment first.")
    if not same_command(source["argv"], cell.argv):
        raise ValueError(f"{cell.experiment}/{cell.key} reuses {experiment}/{source_key}, but its command line "
                         f"differs:\n  {_portable(source['argv'])}\n  {_portable(cell.argv)}")
    return {**source, "experiment": cell.experiment, "method": cell.method, "cell": cell.key,
            "reused_from": f"{experiment}/{source_key}"}


def read_results(path: Path) -> dict[str, dict]:
    """The last record of each cell (by key) in a results file."""
    latest = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                latest[record["cell"]] = record
    return latest


def append_record(path: Path, record: dict) -> None:
    """One line, one `write` on an O_APPEND descriptor, fsync'ed: a crash leaves the file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(record, default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


_LOCKS: dict[str, int] = {}  # cell key -> descriptor of its lock file, while this runner holds it


def _lock_path(cell: Cell) -> Path:
    return cell.output_dir.parent / f"{cell.output_dir.name}.lock"


def _try_lock(path: Path) -> int | None:
    """A descriptor of `path` holding an exclusive `flock`, or None when another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def lock_holder(cell: Cell) -> str | None:
    """Who holds the cell (`host PID` of its runner), or None when no live runner does."""
    path = _lock_path(cell)
    if not path.exists():
        return None
    fd = _try_lock(path)
    if fd is not None:
        os.close(fd)  # nobody held it
        return None
    return path.read_text(errors="replace").strip() or "another runner"


def claim(cell: Cell) -> str | None:
    """Take the cell for this runner: an exclusive `flock` on a lock file beside its output folder (which also
    records this host and PID). Returns None when taken, else who holds it. The kernel drops the lock when the
    runner and the cell's process have exited or died, so a killed runner leaves nothing to clean up; the files
    stay (deleting one would let two runners lock different files). Two runners started on the same experiment (a
    second core, or a restart while the first still runs) thus never train one cell twice nor delete each other's
    output folder."""
    path = _lock_path(cell)
    fd = _try_lock(path)
    if fd is None:  # held: the file names its holder
        return path.read_text(errors="replace").strip() or "another runner"
    os.ftruncate(fd, 0)
    os.write(fd, f"{socket.gethostname()} {os.getpid()}".encode())
    _LOCKS[cell.key] = fd
    return None


def release(cell: Cell) -> None:
    fd = _LOCKS.pop(cell.key, None)
    if fd is not None:
        os.ftruncate(fd, 0)
        os.close(fd)  # closing the descriptor drops the flock


def attempt(cell: Cell, threads: int, results: Path, checkpoints: bool = True) -> dict | str:
    """Run a cell unless another runner holds it or has finished it since this runner started: its record, or
    why it was left."""
    holder = claim(cell)
    if holder is not None:
        return f"running in another runner ({holder})"
    record = read_results(results).get(cell.key)  # after the claim: a runner that just finished has released it
    if finished(record, cell):
        release(cell)
        return "finished by another runner"
    try:
        return run_cell(cell, threads, checkpoints=checkpoints)
    except BaseException:
        release(cell)
        raise


def _scores(metrics: dict, tasks: list[str]) -> dict[str, float]:
    """Each task's score: the mean of its metrics (`eval_<task>_<metric>`), as the library aggregates them."""
    out = {}
    for task in tasks:
        values = [
            v
            for k, v in metrics.items()
            if k.startswith(f"eval_{task}_") and not k.endswith(("loss", "runtime", "per_second"))
        ]
        if values:
            out[task] = sum(values) / len(values)
    return out


def summarise(cell: Cell, summary: dict, tasks: list[str]) -> dict:
    curve = []
    for entry in summary.get("log_history", []):
        if any(k.startswith("eval_") for k in entry) and "step" in entry:
            scores = _scores(entry, tasks)
            if scores:
                curve.append({"step": entry["step"], "epoch": entry.get("epoch"), "scores": scores,
                              "average": entry.get("eval_average")})
    metrics = summary["metrics"]
    return {
        "scores": _scores(metrics, tasks),
        "metrics": metrics,
        "average": metrics.get("eval_average"),
        "small_tasks_average": metrics.get("eval_small_tasks_average"),
        "curve": curve,
        **{k: summary.get(k) for k in ("steps", "examples_seen", "wall_time_s", "peak_rss_mb", "peak_gpu_mb", "device",
                                        "precision", "threads", "versions", "git_revision", "samples", "routing")},
    }


CELL_FILE = "cell.json"  # in a cell's output folder: the command line its checkpoints belong to


def checkpoint_options(argv: list[str]) -> list[str]:
    """The cell's command line with checkpoints saved where it evaluates (every epoch, or every `--eval_steps`),
    the newest one kept: what an interrupted cell resumes from. A cell that saves checkpoints of its own keeps
    them. Saving changes no number (tests/test_faults.py: a run killed and resumed ends with the weights of one
    never stopped)."""
    given = options(argv)
    if given.get("--save_strategy", ("no",)) != ("no",):
        return list(argv)
    kept, skip = [], False
    for arg in argv:  # drop `--save_strategy no`
        if skip:
            skip = False
        elif arg == "--save_strategy":
            skip = True
        else:
            kept.append(arg)
    if given.get("--eval_strategy") == ("steps",) and "--eval_steps" in given:
        return kept + ["--save_strategy", "steps", "--save_steps", given["--eval_steps"][0], "--save_total_limit", "1"]
    return kept + ["--save_strategy", "epoch", "--save_total_limit", "1"]


def resumable_checkpoint(cell: Cell) -> str | None:
    """The newest complete checkpoint that an interrupted run of this same cell (same command line) left in its
    output folder, or None: a folder of another command line, or with no complete checkpoint, starts afresh."""
    out = cell.output_dir
    try:
        ran = json.loads((out / CELL_FILE).read_text())["argv"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not same_command(ran, cell.argv) or not any(out.glob("checkpoint-*")):
        return None
    from hf_taskmoe.training.checkpoints import latest_complete_checkpoint  # torch: only when there is one to check

    return latest_complete_checkpoint(str(out))


def cell_command(cell: Cell, python: str = sys.executable, checkpoints: bool = True) -> tuple[list[str], str | None]:
    """Prepare the cell's output folder and return its command line and the checkpoint it resumes from (None:
    the folder was emptied and the cell starts from scratch)."""
    out = cell.output_dir
    resume = resumable_checkpoint(cell) if checkpoints else None
    if resume is None:
        if out.exists():
            shutil.rmtree(out)  # an interrupted run with nothing to continue from starts again from scratch
        out.mkdir(parents=True)
        (out / CELL_FILE).write_text(json.dumps({"argv": cell.argv}))
    cell_argv = checkpoint_options(cell.argv) if checkpoints else cell.argv
    argv = [python, str(SCRIPT), *cell_argv, "--output_dir", str(out), "--disable_tqdm", "true"]
    if resume is not None:
        argv += ["--resume_from_checkpoint", resume]
    return argv, resume


def run_cell(cell: Cell, threads: int, python: str = sys.executable, extra_env: dict | None = None,
             checkpoints: bool = True) -> dict:
    """Run one cell in its own process; return its record (status ok or error). With `checkpoints`, the cell saves
    one where it evaluates, and a cell interrupted earlier (runner killed, session ended) continues from its
    newest complete checkpoint instead of starting again; the record then says `resumed_from`."""
    record = {"experiment": cell.experiment, "cell": cell.key, "method": cell.method, "variant": cell.variant,
              "task": cell.task, "seed": cell.seed, "argv": cell.argv, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": threads}}
    if cell.depends_on and not (Path(cell.depends_on) / "config.json").exists():
        return {
            **record,
            "status": "error",
            "error": f"the model this cell continues is missing: {cell.depends_on} (run that experiment first)",
        }
    argv, resume = cell_command(cell, python, checkpoints)
    out = cell.output_dir
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        **(extra_env or {}),
    }
    if resume is not None:
        record["resumed_from"] = Path(resume).name
    started = time.time()
    with open(out / "log.txt", "a" if resume else "w") as log:
        if resume:
            log.write(f"\n=== {record['started_at']}: resumed from {Path(resume).name} ===\n")
            log.flush()
        # the cell's process shares the lock: a runner killed alone leaves its cell claimed until the cell ends
        lock = (_LOCKS[cell.key],) if cell.key in _LOCKS else ()
        code = subprocess.call(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, pass_fds=lock)
    record["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    record["process_wall_time_s"] = round(time.time() - started, 1)
    summary_path = out / "run_summary.json"
    if code != 0 or not summary_path.exists():
        tail = (out / "log.txt").read_text(errors="replace").splitlines()[-30:]
        return {**record, "status": "error", "exit_code": code, "error": "\n".join(tail)}
    summary = json.loads(summary_path.read_text())
    tasks = list(summary.get("examples_seen") or {}) or [cell.task]
    for folder in out.glob("checkpoint-*"):  # finished: nothing left to resume
        shutil.rmtree(folder)
    if not cell.keep_model:  # keep the run's metrics, logs and card; drop the weights nobody continues
        for weights in out.glob("*.safetensors"):
            weights.unlink()
    return {**record, "status": "ok", **summarise(cell, summary, tasks)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", help="An experiment file (JSON).")
    parser.add_argument("--results", help="Results file (default: examples/experiments/results/<name>.jsonl).")
    parser.add_argument("--threads", type=int, default=1, help="Threads per cell (OMP_NUM_THREADS).")
    parser.add_argument(
        "--runs", default=str(RUNS), help="Folder of the cells' output folders (default: runs/experiments)."
    )
    parser.add_argument("--workers", type=int, default=1, help="Cells run at once (a GPU machine: several; here: 1).")
    parser.add_argument("--only", nargs="+", help="Run only these methods.")
    parser.add_argument("--seeds", nargs="+", type=int, help="Run only these seeds.")
    parser.add_argument(
        "--no_checkpoints",
        action="store_true",
        help="Save no checkpoints: an interrupted cell starts again from scratch (default: each cell saves "
        "one where it evaluates and an interrupted cell continues from it).",
    )
    parser.add_argument("--list", action="store_true", help="List the cells and whether they are done; run nothing.")
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="OPTION=VALUE",
        help="Add run_multitask options to every cell (e.g. bf16=true on a GPU); recorded in each record.",
    )
    args = parser.parse_args(argv)
    from tqdm.auto import tqdm

    spec, cells = load_experiment(args.experiment, Path(args.runs))
    extra = []
    for item in args.set:
        name, _, value = item.partition("=")
        extra += [f"--{name}", value]
    if extra:
        for cell in cells:
            cell.argv += extra
    results = Path(args.results) if args.results else RESULTS / f"{spec['name']}.jsonl"
    records = read_results(results)
    chosen = [c for c in cells if (not args.only or c.method in args.only) and (not args.seeds or c.seed in args.seeds)]
    done = {c.key for c in chosen if finished(records.get(c.key), c)}
    stale = {c.key for c in chosen if c.key not in done and (records.get(c.key) or {}).get("status") == "ok"}
    todo = [c for c in chosen if c.key not in done]
    if args.list:
        for c in chosen:
            holder = None if c.key in done else lock_holder(c)
            resume = None if c.key in done or holder or args.no_checkpoints else resumable_checkpoint(c)
            state = ("done" if c.key in done else "running" if holder else "resumable" if resume
                     else "stale" if c.key in stale else "todo")
            note = holder or (resume and Path(resume).name)
            print(f"{state}  {c.key}" + (f"  ({note})" if note else ""))
        return 0
    if stale:
        print(f"{len(stale)} finished cell(s) ran another command line than the experiment file now gives them "
              f"(its options changed): they run again and their new records supersede the old: {sorted(stale)}")
    reused = [c for c in todo if c.same_as]
    for cell in reused:
        append_record(results, reuse_record(cell, results.parent))
    todo = [c for c in todo if not c.same_as]
    print(f"{spec['name']}: {len(chosen) - len(todo)} of {len(chosen)} cells done ({len(reused)} reused just now); "
          f"results in {results}")
    failed, left = 0, 0
    with tqdm(total=len(chosen), initial=len(chosen) - len(todo), desc=spec["name"], unit="cell") as bar:
        with ThreadPoolExecutor(max_workers=max(1, args.workers)) as pool:  # each cell is its own process
            futures = {
                pool.submit(attempt, cell, args.threads, results, not args.no_checkpoints): cell for cell in todo
            }
            for future in as_completed(futures):
                cell, record = futures[future], future.result()
                if isinstance(record, str):  # another runner has it
                    left += record.startswith("running")
                    tqdm.write(f"cell {cell.key}: {record}")
                else:
                    append_record(results, record)
                    release(cell)
                    if record["status"] != "ok":
                        failed += 1
                        tqdm.write(f"cell {cell.key} failed:\n{record['error']}")
                bar.set_postfix_str(cell.key)
                bar.update(1)
    running = f", {left} running in another runner" if left else ""
    print(f"{spec['name']}: {len(chosen) - failed - left} of {len(chosen)} cells done, {failed} failed{running}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
