"""Atomic file output (write to a temporary file beside the target, then rename over it), to regular files
only, and how outputs name the files they came from."""

from __future__ import annotations

import io
import json
import math
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from twin.errors import BadInputError, printable


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` in one rename (see :func:`write_atomic`)."""
    write_atomic(path, lambda f: f.write(data))


def write_atomic(path: str | os.PathLike, fill) -> None:
    """Replace ``path`` in one rename with what ``fill(binary file)`` writes. A file replaced keeps its
    permission bits; a new one gets the ones the umask leaves (as ``open`` would give it), not the
    temporary file's private 0600. Through a symlink, the real file is replaced (the link stays); a path that
    is not a regular file is refused (:func:`output_path`)."""
    path = output_path(path, "the output")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def output_path(path: str | os.PathLike, what: str) -> Path:
    """The file writing ``path`` replaces: the real file a symlink names (as ``open`` writes through a link),
    which must be a regular file or a new name. A device, FIFO or directory is refused: renaming a file over
    /dev/null would replace it for the whole machine. ``what`` names the path in messages ("--out")."""
    shown = printable(str(path))
    try:
        real = Path(path).resolve()
    except (RuntimeError, OSError) as exc:  # a symlink loop
        raise BadInputError(f"{what} {shown}: cannot follow the path ({exc})") from None
    try:
        mode = real.stat().st_mode
    except OSError:  # no such file yet (or under a file: check_writable says so)
        return real
    if stat.S_ISDIR(mode):
        raise BadInputError(f"{what} {shown} is a directory; give a file name")
    if not stat.S_ISREG(mode):
        raise BadInputError(f"{what} {shown} is {file_kind(mode)}; write to a regular file or a new path")
    return real


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, for messages."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def check_writable(path: str | os.PathLike, what: str) -> Path:
    """Refuse, before any work, an output path that cannot be written: not a regular file or a new name
    (:func:`output_path`), under a missing directory or a file, or in a directory that takes no new file.
    Returns the file a write will replace."""
    real, shown = output_path(path, what), printable(str(path))
    parent = real.parent
    if not parent.is_dir():
        why = "is a file" if parent.exists() else "does not exist"
        raise BadInputError(f"{what} {shown}: the directory {printable(str(parent))} {why}; create it or choose "
                            "another path")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{real.name}.", suffix=".probe", dir=parent)
    except OSError as exc:
        raise BadInputError(f"{what} {shown}: cannot write in {printable(str(parent))} ({exc.strerror})") from None
    os.close(fd)
    os.unlink(tmp)
    return real


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def json_safe(obj: Any) -> Any:
    """A JSON-ready copy: NaN/inf become null, numpy scalars plain numbers, tuples lists."""
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


#: A top-level list or mapping with more entries than this is written one entry per line (``write_json_atomic``).
ONE_PER_LINE_FROM = 64


def write_json_atomic(path: str | os.PathLike, obj: Any, one_per_line: bool = False) -> None:
    """Indented JSON, streamed to the file (a plan of 100,000 adapters is never one string in memory).
    ``one_per_line``: the entries of ``obj``'s long lists and mappings one per line, each compact: Python's
    JSON encoder indents in Python but writes compact JSON in C, so a plan of 10,000 adapters is written in
    half the time or less, one GPU, adapter or route per line for ``grep`` and ``diff``."""
    def fill(f) -> None:
        text = io.TextIOWrapper(f, encoding="utf-8", write_through=False)
        if one_per_line and isinstance(obj, dict):
            _write_one_per_line(text, obj)
        else:
            json.dump(obj, text, indent=1, allow_nan=False)
        text.write("\n")
        text.flush()
        text.detach()

    write_atomic(path, fill)


#: Compact JSON of one value, refusing NaN and infinities (one encoder for the many entries of a plan).
_COMPACT = json.JSONEncoder(allow_nan=False)


def _write_one_per_line(text: io.TextIOWrapper, obj: dict) -> None:
    dumps = _COMPACT.encode
    text.write("{")
    for n, (key, value) in enumerate(obj.items()):
        text.write(f"{',' if n else ''}\n {dumps(key)}: ")
        if isinstance(value, (list, dict)) and len(value) > ONE_PER_LINE_FROM:
            lines = (dumps(v) for v in value) if isinstance(value, list) else (
                f"{dumps(k)}: {dumps(v)}" for k, v in value.items())
            brackets = "[]" if isinstance(value, list) else "{}"
            text.write(brackets[0])
            text.writelines(f"{',' if m else ''}\n  {line}" for m, line in enumerate(lines))
            text.write(f"\n {brackets[1]}")
        else:
            text.write(json.dumps(value, indent=1, allow_nan=False).replace("\n", "\n "))
    text.write("\n}")


def recorded_path(path: str | os.PathLike, root: str | os.PathLike) -> str:
    """``path`` as an output records it: relative to ``root`` (the repository) when inside it, so no
    machine's absolute path is written into a shipped file."""
    p, r = Path(path).resolve(), Path(root).resolve()
    return str(p.relative_to(r)) if p.is_relative_to(r) else str(path)
