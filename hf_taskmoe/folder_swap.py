"""Replacing a folder so that a process killed at any moment leaves the old content or the new one at its path.

`save_pretrained` of every family (`MultiTaskPreTrainedModel.save_pretrained`) writes the model into a temporary
folder beside the target (`.<name>.saving-<pid>-<random>`, same parent, so the same file system), links the target's
other files into it (a tokenizer, a model card, checkpoints: everything but the old weights), and swaps it in:

- the target does not exist: one `rename` (atomic);
- it does (Linux): one `renameat2(RENAME_EXCHANGE)`, which swaps the two folders in one step, so the path always
  holds a complete model; the temporary folder then holds the old one and is removed;
- where the file system cannot exchange (not Linux, NFS): the target is renamed to `.<name>.save-backup`, then the
  new folder to the target, then the backup is removed. A kill between the two renames leaves no folder at the path
  and the old model in the backup: `from_pretrained` of the families loads the backup then (`loadable_path`), and
  the next save of that path moves it back first (`recover`);
- where the target cannot be renamed at all (another user's folder under a sticky-bit parent, a folder held open):
  its files are replaced one by one, each atomically (`install_staged`): no file is ever half-written, but a
  kill in the middle may leave the new config beside the old weights.

Leftovers of a killed save (a temporary folder, a backup beside a complete target) are removed by the next save of
the same path. The promise is about a killed process: the files are not fsynced, so a power failure may still lose
the last save (as it may for any file written without fsync).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

#: the weight files a save writes and replaces whole (`model.safetensors`, `model-00001-of-00002.safetensors`, their
#: index, a variant's, the `.bin` ones): an old one of a kind the new save wrote but under another name (another
#: sharding) is dropped, never kept beside the new ones. Every other file of the folder survives a save into it.
WEIGHTS_FILE = re.compile(r"(model|pytorch_model)(\.\w+)?(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index(\.\w+)?\.json)?")

_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _temporary_prefix(target: Path) -> str:
    return f".{target.name}.saving-"


def backup_path(target: Path) -> Path:
    """Where the old content waits between the two renames of a swap without `RENAME_EXCHANGE`."""
    return target.parent / f".{target.name}.save-backup"


def exchange(a: Path, b: Path) -> bool:
    """Swap the folders `a` and `b` in one step (Linux `renameat2(RENAME_EXCHANGE)`); False where the system or the
    file system cannot (then nothing moved); other errors raise `OSError`."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # not glibc >= 2.28 (macOS, Windows, musl)
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):  # a file system without it
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def recover(target: Path) -> None:
    """Put back what a save killed between its two renames left (`backup_path`): the old folder, when the path holds
    nothing; a backup beside a complete target is the old content, removed."""
    backup = backup_path(target)
    if not backup.is_dir():
        return
    if not os.path.lexists(target):
        os.rename(backup, target)
    else:
        shutil.rmtree(backup, ignore_errors=True)


def loadable_path(path):
    """`path`, or, when nothing is there and a save killed between its two renames left the old folder in its backup
    (`backup_path`), that backup (the model that was at `path`). A path that is no local folder name is returned as
    given (a Hub repo id)."""
    if not isinstance(path, (str, os.PathLike)) or os.path.lexists(path):
        return path
    backup = backup_path(Path(path))
    if backup.is_dir():
        logger.warning(f"{path} is missing; a save into it was interrupted: loading the earlier model from {backup}.")
        return str(backup)
    return path


def _remove_leftovers(target: Path) -> None:
    """Temporary folders of saves of `target` whose process is gone (killed mid-save)."""
    prefix = _temporary_prefix(target)
    for item in target.parent.glob(f"{prefix}*"):
        found = re.match(r"(\d+)-", item.name[len(prefix):])
        if found is None or not _alive(int(found.group(1))):
            shutil.rmtree(item, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _link_tree(source: Path, destination: Path) -> None:
    """`source` at `destination` by hard links (no data copied), copying where a link cannot be made."""
    if source.is_symlink():
        os.symlink(os.readlink(source), destination)
    elif source.is_dir():
        destination.mkdir()
        for item in source.iterdir():
            _link_tree(item, destination / item.name)
    else:
        try:
            os.link(source, destination)
        except OSError:
            shutil.copy2(source, destination)


def _weights_kind(name: str) -> tuple | None:
    """`(stem, variant)` of a weight file's name (`("model", None)` for `model-00001-of-00002.safetensors`)."""
    found = WEIGHTS_FILE.fullmatch(name)
    return (found.group(1), found.group(2) or found.group(6)) if found else None  # the index names its variant last


def carry_over(old: Path, new: Path) -> list[str]:
    """Every item of the old folder that the new one lacks linked into the new one (a tokenizer, a model card,
    checkpoints written there before the save survive it), except the old model's weight files of a kind the new
    save wrote (`model*.safetensors` and its index, of one variant): another sharding of the old weights, which would
    otherwise sit beside the new ones."""
    written = {_weights_kind(item.name) for item in new.iterdir()} - {None}
    carried = []
    for item in old.iterdir():
        if (new / item.name).exists() or (new / item.name).is_symlink():
            continue  # written by the new save: the new one
        if not item.is_dir() and _weights_kind(item.name) in written:
            continue  # weights of the old model the new save replaced (in another sharding)
        _link_tree(item, new / item.name)
        carried.append(item.name)
    return carried


def swap_in(new: Path, target: Path) -> None:
    """Put the complete folder `new` (beside `target`) at `target`; what was there is removed (module docstring)."""
    if not os.path.lexists(target):
        os.rename(new, target)
        return
    if exchange(new, target):
        shutil.rmtree(new, ignore_errors=True)  # the old content now
        return
    backup = backup_path(target)
    shutil.rmtree(backup, ignore_errors=True)
    os.rename(target, backup)
    try:
        os.rename(new, target)
    except OSError:
        os.rename(backup, target)  # the old folder back in place
        raise
    shutil.rmtree(backup, ignore_errors=True)


def swappable(target: Path) -> bool:
    """Whether `target` can be replaced by renames: not a mount point, not the working folder or one above it (a
    process's working folder would stay the old, removed one), a parent folder we can write in."""
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        return False
    if target.exists() and os.path.ismount(target):
        return False
    try:
        cwd = Path.cwd().resolve()
    except OSError:  # a working folder removed under us: nothing to protect
        cwd = None
    if cwd is not None and (target == cwd or target in cwd.parents):
        return False
    return os.access(target.parent, os.W_OK | os.X_OK)


def install_staged(staging: Path, folder: Path, stale=()) -> None:
    """Move every item of `staging` into `folder`, replacing same-named ones, and remove the items of `folder` named
    in `stale`; the previous content stays whole until the new one is complete on `folder`'s own device.

    Each item is first moved (or, across devices -- `folder` a mount point, a Docker volume -- copied) into `folder`
    under a hidden temporary name; only when all are there are the stale items removed and the new ones renamed
    into place (renames within one folder: atomic per file). A failure before that (a full disk) removes the
    temporaries and leaves `folder` as it was."""
    folder.mkdir(parents=True, exist_ok=True)
    incoming: list[tuple[Path, Path]] = []
    try:
        for item in sorted(staging.iterdir()):
            temporary = folder / f".{item.name}.incoming-{os.getpid()}"
            try:
                os.replace(item, temporary)
            except OSError as err:
                if err.errno not in (errno.EXDEV, errno.EBUSY, errno.EPERM, errno.EACCES, errno.ENOTSUP):
                    raise
                if item.is_dir():  # another device: copy, the original stays in staging until all is done
                    shutil.copytree(item, temporary)
                else:
                    shutil.copy2(item, temporary)
            incoming.append((temporary, folder / item.name))
    except BaseException:
        for temporary, _ in incoming:
            shutil.rmtree(temporary, ignore_errors=True) if temporary.is_dir() else temporary.unlink(missing_ok=True)
        raise
    new_names = {target.name for _, target in incoming}
    for name in stale:
        path = folder / name
        if name in new_names or not (path.exists() or path.is_symlink()):
            continue
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    for temporary, target in incoming:
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(temporary, target)


def write_then_swap(target, write: Callable[[Path], None]) -> bool:
    """Run `write(folder)` on a new temporary folder beside `target`, then carry the old folder's other files over and
    swap it in. False (nothing done) where `target` cannot be swapped (`swappable`): the caller writes in place."""
    target = Path(os.path.abspath(target))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False  # the caller's own write names the problem
    if not swappable(target):
        return False
    recover(target)
    _remove_leftovers(target)
    # created as `makedirs` would create the folder (the umask's mode), then given the old folder's mode
    temporary = target.parent / f"{_temporary_prefix(target)}{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(temporary)
    carried = []
    try:
        write(temporary)
        if target.is_dir():
            carried = carry_over(target, temporary)
            shutil.copymode(target, temporary)
        try:
            swap_in(temporary, target)
        except OSError as err:
            if err.errno not in (errno.EPERM, errno.EACCES, errno.EBUSY, errno.EXDEV):
                raise
            # the folder cannot be renamed (another user's folder under a sticky-bit parent, a folder held open):
            # its files are replaced one by one, each atomically, the old weights last (`install_staged`)
            for name in carried:  # already there (a rename onto another link of the same file does nothing)
                item = temporary / name
                shutil.rmtree(item) if item.is_dir() and not item.is_symlink() else item.unlink()
            written = {_weights_kind(item.name) for item in temporary.iterdir()} - {None}
            stale = [item.name for item in target.iterdir() if _weights_kind(item.name) in written]
            install_staged(temporary, target, stale=stale)
            shutil.rmtree(temporary, ignore_errors=True)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return True
