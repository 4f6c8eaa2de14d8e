"""Atomic file output (write to a temporary file beside the target, then rename over it), and how
outputs name the files they came from."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1, allow_nan=False) + "\n")


def recorded_path(path: str | os.PathLike, root: str | os.PathLike) -> str:
    """``path`` as an output records it: relative to ``root`` (the repository) when inside it, so no
    machine's absolute path is written into a shipped file."""
    p, r = Path(path).resolve(), Path(root).resolve()
    return str(p.relative_to(r)) if p.is_relative_to(r) else str(path)
