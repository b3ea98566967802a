"""Crash-safe file writing: every file appears whole or not at all."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from .errors import LunaConvertError


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# mkstemp/mkdtemp create 0600 files and 0700 folders; what appears should have the usual
# permissions (as open() and mkdir() would have given), not be private to the writer.
_UMASK = _umask()
FILE_MODE, DIR_MODE = 0o666 & ~_UMASK, 0o777 & ~_UMASK


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over ``path``."""
    _atomic_write(path, text, "w")


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """:func:`atomic_write_text` for binary content (e.g. a PNG)."""
    _atomic_write(path, data, "wb")


def _atomic_write(path: str | Path, content, mode: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | Path, data) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def keep_log_entries(log_file: Path, keep) -> None:
    """Rewrite a JSON-lines log with only the entries for which ``keep(entry)`` holds (and without a line torn
    by a kill): what a resumed run does to the lines its crashed attempt wrote after its last checkpoint."""
    if not log_file.is_file():
        return
    kept = []
    for line in log_file.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if keep(entry):
            kept.append(line)
    atomic_write_text(log_file, "".join(f"{line}\n" for line in kept))


@contextlib.contextmanager
def atomic_directory(path: str | Path, overwrite: bool = False,
                     overwrite_hint: str = "pass --overwrite") -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it takes the place of ``path``.

    A new ``path`` appears in one rename. An existing one is swapped by two renames (old aside,
    new in); a crash between them leaves the old folder as ``.<name>.old``, which the next call
    for ``path`` puts back first. Either way, ``path`` is never a half-written folder. ``overwrite_hint``: how
    the caller's user allows replacing a folder (an option on the command line, an argument in Python).
    """
    path = Path(path)
    old = path.with_name(f".{path.name}.old")
    if not path.exists() and old.is_dir():  # a swap was interrupted between its two renames
        os.replace(old, path)
    if path.exists() and not path.is_dir():
        raise LunaConvertError(f"{path} is a file; choose a folder name")
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise LunaConvertError(f"{path} already exists and is not empty; choose another folder or {overwrite_hint}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        os.chmod(tmp, DIR_MODE)
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            try:
                os.replace(tmp, path)
            except BaseException:
                os.replace(old, path)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
