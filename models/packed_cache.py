"""Surrogate forests in their evaluation layout, kept uncompressed in the user's cache.

Loading an artifact inflates its arrays (35 MB for the default profile), checks and hashes them
and repacks every forest (:class:`models.trees.PackedForest`): about 0.3 s, a third of a small
plan. After the first load the packed forests are written under the artifact's ``arrays_sha256``
and :data:`models.trees.PACKED_LAYOUT_VERSION`, and later loads map those files (copy-on-write)
instead. An entry holds exactly the arrays that matched that hash when it was written, so a
changed artifact gets a new entry; a damaged entry is dropped and rebuilt, and a cache that cannot
be written is skipped.

Location: ``$LORA_PLANNER_CACHE``, else ``$XDG_CACHE_HOME/lora-planner``, else
``~/.cache/lora-planner``; ``LORA_PLANNER_CACHE=off`` turns the cache off.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from models.trees import PACKED_LAYOUT_VERSION, PackedForest
from twin.errors import BadInputError

CACHE_ENV = "LORA_PLANNER_CACHE"


def cache_root() -> Path | None:
    """The cache directory, or None when ``LORA_PLANNER_CACHE=off``."""
    env = os.environ.get(CACHE_ENV, "")
    if env.lower() == "off":
        return None
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "lora-planner"


def _entry(arrays_sha256: str) -> Path | None:
    root = cache_root()
    return None if root is None else root / "packed-forests" / f"{arrays_sha256}-v{PACKED_LAYOUT_VERSION}"


def load_packed(arrays_sha256: str, names: tuple[str, ...]) -> dict[str, PackedForest] | None:
    """The cached forests ``names`` of the artifact with this hash; None if absent or damaged."""
    d = _entry(arrays_sha256)
    if d is None or not d.is_dir():
        return None
    try:
        return {name: PackedForest.from_arrays({k: np.load(d / f"{name}.{k}.npy", mmap_mode="c")
                                                for k in PackedForest.ARRAY_KEYS})
                for name in names}
    except (OSError, ValueError, BadInputError):
        shutil.rmtree(d, ignore_errors=True)
        return None


def store_packed(arrays_sha256: str, forests: dict[str, PackedForest]) -> None:
    """Write an entry (best effort: a full or read-only disk only costs the next load its time)."""
    d = _entry(arrays_sha256)
    if d is None or d.is_dir():
        return
    tmp = None
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}.", dir=d.parent))
        for name, forest in forests.items():
            for k, arr in forest.arrays().items():
                np.save(tmp / f"{name}.{k}.npy", arr)
        os.rename(tmp, d)  # atomic; fails harmlessly if another process wrote the entry first
    except OSError:
        pass
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
