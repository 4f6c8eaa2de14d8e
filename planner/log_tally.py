"""What the log readers keep of the requests they read: per model, its requests per hourly window and the sums
its mean lengths and their spread come from, and the first and last request's times. No request is kept, so
memory grows with models x hours, not with the log: the window grid grows as times arrive, in any order.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from planner.forecast import HOUR

#: At most this many (model, hour) counts are held (512 MB): 200,000 adapters over two weeks, or 2,000 over 3
#: years. A log spanning more is refused: a wrong time, or logs to read in parts.
MAX_CELLS = 1 << 26


class Tally:
    """Requests counted per model id (rows) and hour (columns, from hour ``h0`` since the epoch), and per model
    the count, sum and sum of squares of its known prompt and completion tokens."""

    def __init__(self) -> None:
        self.counts = np.zeros((0, 0), np.int64)
        self.h0 = 0
        self.sums = np.zeros((0, 6))  # prompt n, sum, squares; completion n, sum, squares
        self.first = np.inf  # the earliest and latest request's time, any model's
        self.last = -np.inf
        self.requests = 0

    def add(self, ids: np.ndarray, t: np.ndarray, prompt: np.ndarray, completion: np.ndarray,
            keep: np.ndarray) -> int:
        """Count requests (model ids, epoch seconds, tokens: NaN unknown); ``keep``: per model id, whether its
        requests count. Returns -1, or the index of a request whose time would make the grid larger than
        :data:`MAX_CELLS` (then nothing is counted)."""
        if ids.size == 0:
            return -1
        hours = np.floor(t / HOUR).astype(np.int64)
        lo, hi = int(hours.min()), int(hours.max())
        if self.counts.shape[1]:
            lo, hi = min(lo, self.h0), max(hi, self.h0 + self.counts.shape[1] - 1)
        if keep.size * (hi - lo + 1) > MAX_CELLS:
            return int(np.argmax(np.abs(hours - np.median(hours))))
        self._fit(keep.size, lo, hi)
        self.requests += _count(self.counts, self.sums, self.h0, ids, hours, prompt, completion, keep)
        self.first = min(self.first, float(t.min()))
        self.last = max(self.last, float(t.max()))
        return -1

    def _fit(self, rows: int, lo: int, hi: int) -> None:
        """Make the grid hold ``rows`` models and hours lo..hi, growing it with room to spare (within
        :data:`MAX_CELLS`) so that a log read in order grows it a few times only."""
        n_rows, n_cols = self.counts.shape
        if rows <= n_rows and self.h0 <= lo and hi < self.h0 + n_cols:
            return
        cols = hi - lo + 1
        spare = max(24, cols // 2)
        before = spare if n_cols and lo < self.h0 else 0
        after = spare if not n_cols or hi >= self.h0 + n_cols else 0
        wanted = n_rows if rows <= n_rows else max(2 * n_rows, 64)
        new_rows = max(rows, min(wanted, MAX_CELLS // cols))  # rows past ``rows`` are spare, all zero
        room = max(0, MAX_CELLS // new_rows - cols)
        before, after = min(before, room), min(after, max(0, room - before))
        start, kept = lo - before, min(n_rows, new_rows)
        grown = np.zeros((new_rows, cols + before + after), np.int64)
        if n_cols:
            grown[:kept, self.h0 - start:self.h0 - start + n_cols] = self.counts[:kept]
        self.counts, self.h0 = grown, start
        sums = np.zeros((new_rows, 6))
        sums[:kept] = self.sums[:kept]
        self.sums = sums

    def hours(self) -> tuple[np.ndarray, float]:
        """The counts of the kept models over the hours from the first request's to the last's, and the epoch
        seconds of the first of those hours."""
        first, last = int(np.floor(self.first / HOUR)), int(np.floor(self.last / HOUR))
        return self.counts[:, first - self.h0:last - self.h0 + 1], first * HOUR


@njit(cache=True, nogil=True)
def _count(counts, sums, h0, ids, hours, prompt, completion, keep):
    n = 0
    for k in range(ids.size):
        m = ids[k]
        if not keep[m]:
            continue
        n += 1
        counts[m, hours[k] - h0] += 1
        p, c = prompt[k], completion[k]
        if not np.isnan(p):
            sums[m, 0] += 1.0
            sums[m, 1] += p
            sums[m, 2] += p * p
        if not np.isnan(c):
            sums[m, 3] += 1.0
            sums[m, 4] += c
            sums[m, 5] += c * c
    return n
