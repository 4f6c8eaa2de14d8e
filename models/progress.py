"""A small progress printer with rate and ETA (a bar on a TTY, a line every ``every_s`` otherwise)."""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO


def _hms(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """``Progress(total, done=already_done)``; call ``advance(n)`` as work finishes, ``close()`` at the end."""

    def __init__(self, total: int, done: int = 0, label: str = "", stream: TextIO | None = None,
                 every_s: float = 30.0, enabled: bool = True):
        self.total, self.done, self.label = total, done, label
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = 0.2 if self.tty else every_s
        self.enabled = enabled
        self._start_done = done
        self._printed_at = -1
        self._t0 = self._last = time.monotonic()

    @property
    def rate_per_s(self) -> float:
        elapsed = time.monotonic() - self._t0
        return (self.done - self._start_done) / elapsed if elapsed > 0 else 0.0

    def line(self) -> str:
        rate = self.rate_per_s
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        pct = 100.0 * self.done / self.total if self.total else 100.0
        bar = "#" * int(pct / 5) + "." * (20 - int(pct / 5))
        eta_s = _hms(eta) if math.isfinite(eta) else "?"
        return (f"{self.label} [{bar}] {self.done}/{self.total} ({pct:.1f}%) "
                f"{rate * 3600:,.0f}/h elapsed {_hms(time.monotonic() - self._t0)} ETA {eta_s}")

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last >= self.every_s or self.done >= self.total):
            self._last, self._printed_at = now, self.done
            self.stream.write(("\r" if self.tty else "") + self.line() + ("" if self.tty else "\n"))
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._printed_at != self.done:
            self.stream.write(("\r" if self.tty else "") + self.line() + ("\n" if not self.tty else ""))
        if self.enabled and self.tty:
            self.stream.write("\n")
        self.stream.flush()
