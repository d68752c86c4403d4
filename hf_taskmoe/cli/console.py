"""`hf-taskmoe`, the console command declared in pyproject.toml (`[project.scripts]`). Each subcommand is a thin
wrapper over the application: `hf-taskmoe train ...` runs what `python examples/run_multitask.py ...` runs, with
the same arguments and exit statuses. A subcommand's module is imported only when it runs, so `hf-taskmoe --help`
answers without loading torch."""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version

PROG = "hf-taskmoe"



def train(argv: list[str], prog: str) -> int:
    from .train import cli  # torch and transformers load here, not for `--help`

    return cli(argv, prog=prog)


#: subcommand -> (one line for the help, the function that runs it with its arguments and returns the exit status)
COMMANDS = {
    "train": ("train one model on several tasks and evaluate each (examples/run_multitask.py)", train),
}


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [
        f"usage: {PROG} <command> [options]",
        "",
        "Multi-task learning for Hugging Face Transformers (MT-TaG, PALs, CA-MTL, task-level routing, MMoE).",
        "",
        "commands:",
        *(f"  {name:<{width}}  {about}" for name, (about, _) in COMMANDS.items()),
        "",
        f"`{PROG} <command> --help` lists a command's options.",
        "Exit status: 0 done; 2 your input was refused; 1 the push failed or an internal error.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run `hf-taskmoe <command> ...` and return its exit status (`--help`: this command's help; `--version`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        try:
            print(f"{PROG} {version('hf-taskmoe')}")
        except PackageNotFoundError:  # run from a checkout that was not installed
            from .. import __version__

            print(f"{PROG} {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: `{command}` is not a command of {PROG}; the commands are {', '.join(sorted(COMMANDS))} "
              f"(`{PROG} --help` describes them).", file=sys.stderr)
        return 2
    return COMMANDS[command][1](rest, f"{PROG} {command}")
