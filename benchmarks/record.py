"""The one writer of benchmark results: the JSON file, and a ``run`` record of how, from what and where it was made.

    from benchmarks.record import write_result
    write_result(args.out, {"benchmark": "twin_speed", ...}, argv)

The result goes to ``artifacts/benchmarks/<name>.json`` (or the path given), written atomically and made
JSON-safe (NaN/inf become null). Its ``run`` record holds:

* ``command``: the command as run, ``python -m benchmarks.<group>.<name> ARGS`` (a ``command`` key of the
  result itself is dropped: this one replaces it);
* ``commit``: ``git rev-parse --short HEAD``, with ``-dirty`` when tracked files differ from it; null
  without git;
* ``machine``: facts that name no host: CPU model, cores, memory, Python, platform;
* ``date``: UTC, ISO 8601.

Benchmarks are run from the repository root as modules (``python -m benchmarks.speed.twin_speed``), so the
project's packages and ``benchmarks`` itself import as they are, with no path set by hand.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from serving_harness.machine import cpu_model, memory_gib
from twin.atomic import json_safe, write_json_atomic

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "artifacts" / "benchmarks"


def result_path(name: str) -> Path:
    """Where the result called ``name`` goes: ``artifacts/benchmarks/<name>.json``."""
    return RESULTS / f"{name}.json"


def write_result(name_or_path: str | os.PathLike, data: dict[str, Any], argv: list[str] | None = None) -> Path:
    """Write ``data`` with a ``run`` record (see the module) to ``name_or_path``: a bare name (no directory,
    no ``.json``) goes to :func:`result_path`, anything else is a path. ``argv``: the arguments the benchmark
    parsed (default ``sys.argv[1:]``). Returns the path written."""
    path = Path(name_or_path)
    if isinstance(name_or_path, str) and path.name == name_or_path and path.suffix != ".json":
        path = result_path(name_or_path)
    body = {k: v for k, v in data.items() if k != "command"}
    head = {"benchmark": body.pop("benchmark")} if "benchmark" in body else {}
    write_json_atomic(path, json_safe({**head, "run": run_record(argv), **body}))
    return path


def run_record(argv: list[str] | None = None) -> dict[str, Any]:
    """How, from what, where and when this process runs: the ``run`` record of :func:`write_result`."""
    return {"command": command(argv), "commit": commit(), "machine": machine(),
            "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}


def command(argv: list[str] | None = None) -> str:
    """The command line of this process as a benchmark is run: ``python -m <module> ARGS``."""
    args = sys.argv[1:] if argv is None else [str(a) for a in argv]
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return shlex.join(["python", "-m", spec.name, *args])
    return shlex.join(["python", sys.argv[0] if sys.argv and sys.argv[0] else "-", *args])


def commit() -> str | None:
    """The checked-out commit, short, with ``-dirty`` when tracked files have changes; None without git."""
    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", "--no-optional-locks", *args], cwd=ROOT, capture_output=True, text=True,
                                  stdin=subprocess.DEVNULL, timeout=30, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout if proc.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    if not head or not head.strip():
        return None
    changes = git("status", "--porcelain", "--untracked-files=no")
    return head.strip() + ("-dirty" if changes is None or changes.strip() else "")


def machine() -> dict[str, Any]:
    """The machine, by facts that name no host: CPU model, logical cores (and those this process may use),
    total memory in GiB, Python version, platform."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "usable_cores": usable, "memory_gib": memory_gib(),
            "python": platform.python_version(), "platform": platform.platform()}
