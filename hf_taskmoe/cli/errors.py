"""How a training command ends: a refusal of the user's input is one paragraph and exit status 2, an internal error
its traceback and status 1 (`run_command`)."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from ..training.data import DataError


class UsageError(ValueError):
    """A problem with the arguments, the data or the output folder: reported in one paragraph, exit status 2."""


class PushFailed(RuntimeError):
    """The Hub upload failed after the run was saved locally: exit status 1 (the message says what is where)."""


#: where code raising a ValueError makes it a check of ours on the user's input (any other raiser: an internal error)
OWN_CODE = str(Path(__file__).resolve().parent.parent)


def is_user_error(err: BaseException, scripts: tuple[str, ...] = ()) -> bool:
    """Whether `err` is a refusal of the user's input: a `UsageError`/`DataError`, a missing file, or a `ValueError`
    raised by hf_taskmoe's own checks or those of `scripts` (paths of the command's own files). A `ValueError` raised
    inside transformers, torch or another library (an API change, a bug) is not: it is an internal error."""
    if isinstance(err, (UsageError, DataError, FileNotFoundError)):
        return True
    if not isinstance(err, ValueError):
        return False
    frames = traceback.extract_tb(err.__traceback__)
    own = (OWN_CODE, *(str(Path(s).resolve()) for s in scripts))
    return bool(frames) and str(Path(frames[-1].filename).resolve()).startswith(own)


#: errno values of an OSError that are about the user's files or disk (unreadable, read-only, a file where a folder
#: should be, full), not a bug
FILE_PROBLEMS = {"EACCES", "EPERM", "EROFS", "EISDIR", "ENOTDIR", "ENOENT", "ENOSPC", "EDQUOT", "ENAMETOOLONG", "ELOOP"}


def file_problem(err: BaseException) -> bool:
    """Whether `err` is an OSError naming a file of the run that cannot be read or written (permissions, a read-only
    or full disk, a file where a folder should be)."""
    import errno

    return (isinstance(err, OSError) and err.filename is not None
            and errno.errorcode.get(err.errno or -1) in FILE_PROBLEMS)


def run_command(main, argv: list[str], script: str) -> int:
    """Run `main(argv)` as a command line does and return its exit status: 0 done; 2 a problem with the arguments,
    data or output folder (one paragraph on stderr, no traceback); 1 the Hub upload failed after the run was saved
    (`PushFailed`: the upload has said what is where), or an internal error (its traceback and an "internal error"
    line). A bare `--debug` in `argv` (not `--debug <option>`, TrainingArguments' own) shows the traceback of any
    error instead. `script`: the command's file, whose own `ValueError`s are refusals too."""
    argv = list(argv)
    debug = [i for i, a in enumerate(argv) if a == "--debug" and (i + 1 == len(argv) or argv[i + 1].startswith("--"))]
    for i in reversed(debug):
        del argv[i]
    try:
        main(argv)
    except PushFailed:
        if debug:
            raise
        return 1
    except Exception as err:  # noqa: BLE001 -- sorted into the user's mistakes and our bugs below
        if debug:
            raise
        if is_user_error(err, (script,)):
            print(f"error: {err}\n(run with --debug for the traceback)", file=sys.stderr)
            return 2
        if file_problem(err):  # a file or folder of the user's that cannot be read or written: not a bug of ours
            print(
                f"error: cannot use {err.filename}: {err.strerror}. Check the path, its permissions and the free space "
                "on its disk, then run again.\n(run with --debug for the traceback)",
                file=sys.stderr,
            )
            return 2
        traceback.print_exc()
        print(f"\ninternal error: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}\n"
              "This is a bug in hf_taskmoe or a library it calls, not a problem with your arguments or data. Run again "
              "with --debug for the full traceback, and report it with that output.", file=sys.stderr)
        return 1
    return 0
