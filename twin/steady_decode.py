"""Steady decoders held implicitly, so that an engine step costs O(events), not O(batch).

Most running requests in most steps are *steady decoders*: they sampled a token in the previous step
and compute exactly that token in this one. When every running request is scheduled in full and every
block request is granted (the step's token demand fits the budget and its block demand fits the free
blocks), such a request's step is fully determined. So it is when the budget falls short only at the last
request in running order, a prompt being prefilled in chunks: the explicit scheduler reaches it last and
gives it what the others left (with mixed prompt lengths this is most steps that would otherwise be
explicit). A steady request's step: ``computed`` and the token count grow by one, it needs a new KV block
exactly when ``computed`` is a multiple of the block size, its inter-token gap is the step's length, and
it finishes at a step known from the start. :func:`twin.core.simulate_core`
then keeps each steady request as ``(computed at the step counter g0)`` and advances all of them at
once (a *fast step*):

* block demand: ``cnt[G % block_size]`` steady requests need one block at fast step ``G`` (each is
  counted under ``(g0 - computed) % block_size``);
* finishes: a calendar of fast-step numbers, a bucket per step (:func:`finish_calendar`, :func:`finishing`);
* ITL: all steady requests add one gap of the step's length.

A step where that does not hold runs the explicit scheduler after :func:`materialize` writes the
per-request state back; results are identical to stepping every request (checked by
tests/test_twin_steady_decode.py against the explicit loop alone).

numba's on-disk cache of ``simulate_core`` holds these functions compiled in and is keyed on
twin/core.py only: after editing this module, clear the ``*.nbi``/``*.nbc`` files (or touch core.py).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from twin.states import RUNNING

#: Rows of the finish calendar (:func:`finish_calendar`): per bucket, its first request, the fast step its
#: requests finish at and the lazy spell (epoch) they were made steady in.
CAL_FIRST, CAL_STEP, CAL_EPOCH = 0, 1, 2


@nb.njit(cache=True)
def finish_calendar(out_len):
    """The finish calendar: a ring of buckets, one per fast step, longer than any request's output (a steady
    request finishes fewer fast steps ahead than it has output tokens), so the requests pending in one bucket
    all finish at the same step. Each bucket chains its requests through ``fin_next``."""
    longest = 0
    for i in range(out_len.shape[0]):
        longest = max(longest, out_len[i])
    span = 2
    while span < longest + 2:
        span *= 2
    return np.full((3, span), -1, np.int64)


@nb.njit(cache=True)
def finishing(cal, g, epoch):
    """The first request of those that finish at fast step ``g`` (the next through ``fin_next``; -1 ends them), and
    empty its bucket; -1 if none."""
    b = g & (cal.shape[1] - 1)
    if cal[CAL_STEP, b] != g or cal[CAL_EPOCH, b] != epoch:
        return -1
    cal[CAL_STEP, b] = -1
    return cal[CAL_FIRST, b]


@nb.njit(cache=True, inline="always")
def block_phase(g0, computed, block_size):
    """The ``cnt`` bucket of a steady request: it needs a block at the fast steps ``G`` whose
    ``G % block_size`` equals this."""
    return (g0 - computed) % block_size


@nb.njit(cache=True)
def make_steady(r, g, computed, done_at, steady, g0, cnt, block_size, cal, fin_next, epoch):
    """Hold request ``r`` implicitly from fast step ``g`` on (it sampled in the step just ended), in the calendar
    at the fast step it finishes (buckets left from an earlier lazy ``epoch`` are stale: emptied first)."""
    steady[r] = True
    g0[r] = g
    cnt[block_phase(g, computed[r], block_size)] += 1
    # After m fast steps its token count is computed + 1 + m; it finishes in the step that reaches done_at.
    last = g + done_at[r] - 2 - computed[r]
    b = last & (cal.shape[1] - 1)
    if cal[CAL_STEP, b] != last or cal[CAL_EPOCH, b] != epoch:
        cal[CAL_FIRST, b] = -1
        cal[CAL_STEP, b] = last
        cal[CAL_EPOCH, b] = epoch
    fin_next[r] = cal[CAL_FIRST, b]
    cal[CAL_FIRST, b] = r


@nb.njit(cache=True)
def materialize(running, rlen, state, steady, g0, g, computed, ntok, blocks, last_tok, now, block_size, adapter,
                last_used, mark_used, step):
    """Write every steady request's state back and compact the running list (finished requests leave it, order
    kept); returns its length. With ``mark_used`` (a fast step ran since the requests were made steady), every
    running adapter was in the previous step's batch: its LRU stamp becomes ``step - 1``."""
    k = 0
    for q in range(rlen):
        r = running[q]
        if state[r] != RUNNING:
            continue
        if steady[r]:
            steady[r] = False
            computed[r] += g - g0[r]
            ntok[r] = computed[r] + 1
            blocks[r] = (computed[r] + block_size - 1) // block_size
            last_tok[r] = now
        if mark_used:
            last_used[adapter[r]] = step - 1
        running[k] = r
        k += 1
    return k


@nb.njit(cache=True)
def compact_running(running, rlen, state):
    """Drop finished requests from the running list (order kept); returns its length."""
    k = 0
    for q in range(rlen):
        r = running[q]
        if state[r] == RUNNING:
            running[k] = r
            k += 1
    return k
