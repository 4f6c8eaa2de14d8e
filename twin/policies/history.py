"""History KV of multi-turn conversations (prefix caching) in the policy loop, ELORA's main lever.

When a turn finishes, the KV of its full blocks (the conversation so far) stays in the pool as the
conversation's history instead of being freed. The next turn of that conversation, whose prompt
starts with exactly those tokens, takes the blocks over and computes only the rest. Idle history is
evicted like an idle adapter when memory is needed (``twin.policies.engine._make_room``):

* Without a host tier it is dropped (vLLM's prefix cache); with one (ELORA) it is swapped out to host
  memory and swapped back in over the host link, on the same FIFO channel as adapter copies, when its
  next turn arrives (Choice: host memory never fills; swap-outs use the link's other direction, so
  they cost nothing here).
* With the dependency rule (ELORA's usage-dependency tree, §3.2 of the notes) an adapter with history
  on the GPU is not evicted: history is the tree's leaves, so all GPU history stays valid. Without it
  history may outlive its adapter on the GPU ("invalid KV", which ELORA measures at 42.4 % in vLLM).
* Victims: ELORA scores history like an adapter (eq. 5: swap-in cost x visit share x recency) and
  compares both kinds; LRU compares last-use times of both; the other caches evict history first, in
  LRU order, before any adapter of the same tier (what no unfinished request wants goes first).

Choices: a conversation's history is one node (ELORA splits it into 16 MB blocks; evicting a whole
conversation at once is coarser), a preempted request's KV is freed rather than cached, and the
swapper prefetches only adapters (history comes back when its next turn arrives).

State is the record :class:`History` (per conversation, per adapter, and the settings). The pool's
counter ``pool.history`` (``twin.policies.engine.Pool``) is the blocks held by idle GPU history.
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

from twin.policies.rules import P_FREQ_WINDOW_S, P_RECENCY_TAU_S, decayed

H_NONE, H_GPU, H_HOST, H_LOADING = 0, 1, 2, 3


class History(NamedTuple):
    """History KV per conversation ``c`` and per adapter ``a``, and its settings."""

    state: np.ndarray  # c: H_NONE, H_GPU, H_HOST or H_LOADING
    blocks: np.ndarray  # c: its KV blocks
    adapter: np.ndarray  # c: the adapter of its turns
    last: np.ndarray  # c: last use
    freq: np.ndarray  # c: decayed visit count ...
    freq_t: np.ndarray  # c: ... and its stamp
    ready: np.ndarray  # c: when its swap-in lands
    pending: np.ndarray  # c: unfinished turns
    ad_entries: np.ndarray  # a: history entries on (or coming to) the GPU
    ad_idle_blocks: np.ndarray  # a: the idle ones' blocks
    ad_loading: np.ndarray  # a: those coming
    on: bool  # history is kept (prefix caching)
    host: bool  # a host tier: evicted history is swapped out, not dropped
    depend: bool  # the dependency rule
    block_size: int
    swap_ms_per_token: float  # host link time of one token's KV


def history_state(conv_adapter: np.ndarray, on: bool, host: bool, depend: bool, block_size: int,
                  swap_ms_per_token: float, n_adapters: int) -> History:
    """The history of conversations owned by ``conv_adapter`` (all idle, nothing cached)."""
    nc = conv_adapter.shape[0]
    return History(np.zeros(nc, np.int64), np.zeros(nc, np.int64), conv_adapter.astype(np.int64), np.zeros(nc),
                   np.zeros(nc), np.zeros(nc), np.zeros(nc), np.zeros(nc, np.int64), np.zeros(n_adapters, np.int64),
                   np.zeros(n_adapters, np.int64), np.zeros(n_adapters, np.int64), bool(on), bool(host), bool(depend),
                   int(block_size), float(swap_ms_per_token))


@nb.njit(cache=True)
def settle(c, now, hist, pool):
    """A swap-in that has landed makes its history idle GPU history."""
    if hist.state[c] == H_LOADING and hist.ready[c] <= now:
        hist.state[c] = H_GPU
        pool.history[0] += hist.blocks[c]
        hist.ad_idle_blocks[hist.adapter[c]] += hist.blocks[c]
        hist.ad_loading[hist.adapter[c]] -= 1


@nb.njit(cache=True)
def start_swap_in(c, now, hist, pool):
    """Bring host history ``c`` back (its blocks already free in ``pool.free``), queued on the link."""
    b = hist.blocks[c]
    pool.free[0] -= b
    hist.ad_entries[hist.adapter[c]] += 1
    hist.ad_loading[hist.adapter[c]] += 1
    start = max(now, pool.link[0])
    hist.ready[c] = start + b * hist.block_size * hist.swap_ms_per_token / 1000.0
    pool.link[0] = hist.ready[c]
    hist.state[c] = H_LOADING


@nb.njit(cache=True)
def visit(c, now, hist, window_s):
    hist.freq[c] = decayed(hist.freq[c], hist.freq_t[c], now, window_s) + 1.0
    hist.freq_t[c] = now
    hist.pending[c] += 1


@nb.njit(cache=True)
def evict(c, hist, pool):
    """Evict idle GPU history ``c``: to host memory with a host tier, else dropped."""
    b = hist.blocks[c]
    a = hist.adapter[c]
    pool.free[0] += b
    pool.history[0] -= b
    hist.ad_entries[a] -= 1
    hist.ad_idle_blocks[a] -= b
    if hist.host:
        hist.state[c] = H_HOST
    else:
        hist.state[c] = H_NONE
        hist.blocks[c] = 0


@nb.njit(cache=True)
def take(r, c, now, hist, blocks, computed, pool):
    """Turn ``r`` takes over its conversation's idle GPU history: its KV blocks and computed tokens.
    Returns the tokens reused."""
    b = hist.blocks[c]
    pool.history[0] -= b
    hist.ad_idle_blocks[hist.adapter[c]] -= b
    hist.ad_entries[hist.adapter[c]] -= 1
    hist.state[c] = H_NONE
    hist.blocks[c] = 0
    hist.last[c] = now
    blocks[r] = b
    computed[r] = b * hist.block_size
    return computed[r]


@nb.njit(cache=True)
def give_back(r, c, hist, blocks, computed, pool):
    """Undo :func:`take` (the turn could not be admitted after all); returns the blocks given back."""
    b = blocks[r]
    pool.history[0] += b
    hist.ad_idle_blocks[hist.adapter[c]] += b
    hist.ad_entries[hist.adapter[c]] += 1
    hist.state[c] = H_GPU
    hist.blocks[c] = b
    blocks[r] = 0
    computed[r] = 0
    return b


@nb.njit(cache=True)
def keep(r, c, now, hist, blocks, computed, pool):
    """A finished turn leaves its full blocks as the conversation's history (replacing whatever history
    the conversation had; with open-loop arrivals that may be a later turn's); the partial last block
    is freed (added to ``pool.free``)."""
    a = hist.adapter[c]
    settle(c, now, hist, pool)
    if hist.state[c] == H_GPU:
        evict(c, hist, pool)
    if hist.state[c] != H_LOADING:  # a swap-in in flight keeps its blocks until it lands
        hist.state[c] = H_NONE
        hist.blocks[c] = 0
        full = min(blocks[r], computed[r] // hist.block_size)
        pool.free[0] += blocks[r] - full
        if full > 0:
            hist.state[c] = H_GPU
            hist.blocks[c] = full
            pool.history[0] += full
            hist.ad_entries[a] += 1
            hist.ad_idle_blocks[a] += full
    else:
        pool.free[0] += blocks[r]
    hist.last[c] = now
    blocks[r] = 0


@nb.njit(cache=True)
def best_victim(tier, now, mode_elora, hist, pool, fp, ftot):
    """The idle GPU history to evict first in ``tier`` (0: no unfinished turn wants it, 1: one does,
    2: any) and its keep-value (lower goes first): ELORA's eq. 5 (``ftot``: all adapters' decayed
    visits), else its last use. Ties (ELORA's recency term underflows for long-idle history) go to
    the least recently used. -1 if none."""
    best, best_v, best_t = -1, np.inf, np.inf
    if pool.history[0] == 0:
        return best, best_v
    for c in range(hist.state.shape[0]):
        settle(c, now, hist, pool)
        if hist.state[c] != H_GPU or tier < 2 and (hist.pending[c] > 0) != (tier == 1):
            continue
        last = hist.last[c]
        if mode_elora:
            age = now - last
            visit_share = decayed(hist.freq[c], hist.freq_t[c], now, fp[P_FREQ_WINDOW_S]) / ftot if ftot > 0 else 0.0
            cost = hist.blocks[c] * hist.block_size * hist.swap_ms_per_token
            v = cost * visit_share * (1.0 - 1.0 / (1.0 + np.exp(-age / fp[P_RECENCY_TAU_S])))
        else:
            v = last
        if v < best_v or v == best_v and last < best_t:
            best, best_v, best_t = c, v, last
    return best, best_v
