"""Measuring within a time budget: a GPU lease's deadline, and the engines started against it.

A lease is short (minutes) and an engine start on a GPU takes one to three of them, so the harness
never starts what it cannot finish: before each engine start and each experiment it compares what the
step is expected to take with the time left, and stops (``OutOfTimeError``, exit 5) instead. Every
finished experiment is already saved in the work dir, so the same command in the next lease resumes.
Engine starts are recorded in ``<work dir>/starts.json`` (name, seconds to healthy, outcome), which
also gives the estimate of the next start.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from twin.atomic import write_json_atomic
from twin.errors import OutOfTimeError

#: Seconds an engine start is expected to take before this work dir has timed one.
FIRST_START_S = {"cpu": 45.0, "cuda": 150.0}


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60:d}:{seconds % 60:02d}"


@dataclass
class Lease:
    """The time budget of one command: ``deadline`` (epoch seconds; None: no budget) and the engine starts
    of ``work_dir``."""

    work_dir: Path
    device: str = "cpu"
    deadline: float | None = None
    say: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True))

    @property
    def starts_path(self) -> Path:
        return self.work_dir / "starts.json"

    def starts(self) -> list[dict]:
        """Every engine start recorded in this work dir, across commands and leases."""
        return json.loads(self.starts_path.read_text(encoding="utf-8")) if self.starts_path.is_file() else []

    def record_start(self, name: str, startup_s: float, status: str) -> None:
        write_json_atomic(self.starts_path, [*self.starts(), {"engine": name, "startup_s": round(startup_s, 1),
                                                             "status": status, "at": time.strftime("%Y-%m-%dT%H:%M:%S")}])

    def start_estimate_s(self) -> float:
        """The slowest start timed here so far (the first of a fresh machine compiles), else the device default."""
        timed = [s["startup_s"] for s in self.starts() if s["status"] == "ok"]
        return max(timed) if timed else FIRST_START_S.get(self.device, FIRST_START_S["cuda"])

    def left_s(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.time()

    def need(self, seconds: float, what: str) -> None:
        """Go on only if ``seconds`` (what ``what`` is expected to take) fit in the time left; say so either way."""
        if self.deadline is None:
            return
        left = self.left_s()
        if seconds > left:
            raise OutOfTimeError(f"stopped before {what} (about {_clock(seconds)} needed, {_clock(left)} left before "
                                 f"the deadline); what finished is saved in {self.work_dir}: rerun the same "
                                 "command to resume")
        self.say(f"[{_clock(left)} left] {what} (about {_clock(seconds)})")
