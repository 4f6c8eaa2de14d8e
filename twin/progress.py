"""Progress of long work on stderr, formatted by tqdm.

On a terminal it is a bar redrawn in place. Where stderr is a log (a nightly job, CI) a redrawn bar
would fill it with carriage returns, so there it is a plain line every ``every_s`` seconds, and one at
the end of work that printed any: a log shows how far long work got and how fast, and nothing of short
work. :func:`say` prints a message without breaking a bar on screen.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm


class Progress:
    """``Progress(total, label, done=already_done)``; ``advance(n)`` as work finishes, ``close()`` at the end."""

    def __init__(self, total: int, label: str = "", done: int = 0, unit: str = "it", every_s: float = 30.0,
                 enabled: bool = True, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled, self.every_s = enabled, every_s
        self.label, self.unit = label, unit
        self.total, self.done, self._start = total, done, done
        self._t0 = self._last = time.monotonic()
        self._printed_at: int | None = None  # ``done`` when the last line was printed
        self._bar = tqdm(total=total, initial=done, desc=label, unit=unit, file=self.stream, leave=False,
                         dynamic_ncols=True, disable=not (enabled and self.tty))

    def line(self) -> str:
        """The progress as one line: count, share, elapsed, rate and time left."""
        elapsed = time.monotonic() - self._t0
        rate = (self.done - self._start) / elapsed if elapsed > 0 else None
        return tqdm.format_meter(self.done, self.total, elapsed, prefix=self.label, unit=self.unit, rate=rate,
                                 initial=self._start, ncols=0)

    def advance(self, n: int = 1, note: str | None = None) -> None:
        self.done += n
        if note is not None:
            self._bar.set_postfix_str(note, refresh=False)
        self._bar.update(n)
        now = time.monotonic()
        if self.enabled and not self.tty and now - self._last >= self.every_s:
            self._last = now
            self._print()

    def set(self, done: int, note: str | None = None) -> None:
        """Progress to ``done`` in all (``note``: what is being done, beside the bar)."""
        self.advance(done - self.done, note)

    def close(self) -> None:
        self._bar.close()
        if self.enabled and not self.tty and self._printed_at not in (None, self.done):
            self._print()

    def _print(self) -> None:
        self._printed_at = self.done
        self.stream.write(self.line() + "\n")
        self.stream.flush()


def counter(label: str, unit: str = "it", enabled: bool = True, stream: TextIO | None = None,
            every_s: float = 30.0) -> Callable[..., None]:
    """A ``(done, of[, note])`` callback drawing one :class:`Progress` per run of work: started by the first
    call, closed when ``done`` reaches ``of``. What the first call reports done was done before the bar
    started (answers the twin had kept, a first chunk): it counts in the share, not in the rate."""
    state: dict[str, Progress] = {}

    def report(done: int, of: int, note: str | None = None) -> None:
        bar = state.get("bar")
        if bar is None or bar.total != of:
            bar = state["bar"] = Progress(of, label, done=done, unit=unit, every_s=every_s, enabled=enabled,
                                          stream=stream)
        bar.set(done, note)
        if done >= of:
            bar.close()
            del state["bar"]

    return report


def say(message: str, stream: TextIO | None = None) -> None:
    """One line on stderr, above any bar drawn there."""
    tqdm.write(message, file=stream or sys.stderr)
