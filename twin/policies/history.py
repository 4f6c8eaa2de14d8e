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

State is kept in a few arrays bundled as the tuple ``hist`` = ``(hi, hf, ad_h, cq, hc, hp)``:
``hi[c]`` = state, blocks, adapter; ``hf[c]`` = last use, visit count, its stamp, swap-in ready
time; ``ad_h[a]`` = history entries on (or coming to) the GPU, the idle ones' blocks, those coming;
``cq[c]`` = unfinished turns; ``hc`` = on, host tier, dependency, block size; ``hp`` = swap ms per
token, recent batch size.
The pool's third counter ``mem[2]`` is the blocks held by idle GPU history.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from twin.policies.rules import P_FREQ_WINDOW_S, P_RECENCY_TAU_S, decayed

H_NONE, H_GPU, H_HOST, H_LOADING = 0, 1, 2, 3
HI_STATE, HI_BLOCKS, HI_ADAPTER = 0, 1, 2
HF_LAST, HF_FREQ, HF_FREQ_T, HF_READY = 0, 1, 2, 3
AH_ENTRIES, AH_BLOCKS, AH_LOADING = 0, 1, 2
HC_ON, HC_HOST, HC_DEPEND, HC_BLOCK = 0, 1, 2, 3
HP_SWAP_MS_PER_TOKEN, HP_BS_AVG = 0, 1


def history_state(conv_adapter: np.ndarray, on: bool, host: bool, depend: bool, block_size: int,
                  swap_ms_per_token: float, n_adapters: int):
    """The ``hist`` tuple for conversations owned by ``conv_adapter`` (all idle, nothing cached)."""
    nc = conv_adapter.shape[0]
    hi = np.zeros((nc, 3), np.int64)
    hi[:, HI_ADAPTER] = conv_adapter
    hf = np.zeros((nc, 4))
    hc = np.array([on, host, depend, block_size], np.int64)
    hp = np.array([swap_ms_per_token, 1.0])
    return hi, hf, np.zeros((n_adapters, 3), np.int64), np.zeros(nc, np.int64), hc, hp


@nb.njit(cache=True)
def settle(c, now, hist, mem):
    """A swap-in that has landed makes its history idle GPU history."""
    hi = hist[0]
    if hi[c, HI_STATE] == H_LOADING and hist[1][c, HF_READY] <= now:
        hi[c, HI_STATE] = H_GPU
        mem[2] += hi[c, HI_BLOCKS]
        hist[2][hi[c, HI_ADAPTER], AH_BLOCKS] += hi[c, HI_BLOCKS]
        hist[2][hi[c, HI_ADAPTER], AH_LOADING] -= 1


@nb.njit(cache=True)
def start_swap_in(c, now, hist, mem, pcie):
    """Bring host history ``c`` back (its blocks already free in ``mem[0]``), queued on the link."""
    hi, hf = hist[0], hist[1]
    b = hi[c, HI_BLOCKS]
    mem[0] -= b
    hist[2][hi[c, HI_ADAPTER], AH_ENTRIES] += 1
    hist[2][hi[c, HI_ADAPTER], AH_LOADING] += 1
    start = max(now, pcie[0])
    hf[c, HF_READY] = start + b * hist[4][HC_BLOCK] * hist[5][HP_SWAP_MS_PER_TOKEN] / 1000.0
    pcie[0] = hf[c, HF_READY]
    hi[c, HI_STATE] = H_LOADING


@nb.njit(cache=True)
def visit(c, now, hist, window_s):
    hf = hist[1]
    hf[c, HF_FREQ] = decayed(hf[c, HF_FREQ], hf[c, HF_FREQ_T], now, window_s) + 1.0
    hf[c, HF_FREQ_T] = now
    hist[3][c] += 1


@nb.njit(cache=True)
def evict(c, hist, mem):
    """Evict idle GPU history ``c``: to host memory with a host tier, else dropped."""
    hi, ad_h = hist[0], hist[2]
    b = hi[c, HI_BLOCKS]
    a = hi[c, HI_ADAPTER]
    mem[0] += b
    mem[2] -= b
    ad_h[a, AH_ENTRIES] -= 1
    ad_h[a, AH_BLOCKS] -= b
    if hist[4][HC_HOST]:
        hi[c, HI_STATE] = H_HOST
    else:
        hi[c, HI_STATE] = H_NONE
        hi[c, HI_BLOCKS] = 0


@nb.njit(cache=True)
def take(r, c, now, hist, blocks, computed, mem):
    """Turn ``r`` takes over its conversation's idle GPU history: its KV blocks and computed tokens.
    Returns the tokens reused."""
    hi, ad_h = hist[0], hist[2]
    b = hi[c, HI_BLOCKS]
    mem[2] -= b
    ad_h[hi[c, HI_ADAPTER], AH_BLOCKS] -= b
    ad_h[hi[c, HI_ADAPTER], AH_ENTRIES] -= 1
    hi[c, HI_STATE] = H_NONE
    hi[c, HI_BLOCKS] = 0
    hist[1][c, HF_LAST] = now
    blocks[r] = b
    computed[r] = b * hist[4][HC_BLOCK]
    return computed[r]


@nb.njit(cache=True)
def give_back(r, c, hist, blocks, computed, mem):
    """Undo :func:`take` (the turn could not be admitted after all); returns the blocks given back."""
    hi, ad_h = hist[0], hist[2]
    b = blocks[r]
    mem[2] += b
    ad_h[hi[c, HI_ADAPTER], AH_BLOCKS] += b
    ad_h[hi[c, HI_ADAPTER], AH_ENTRIES] += 1
    hi[c, HI_STATE] = H_GPU
    hi[c, HI_BLOCKS] = b
    blocks[r] = 0
    computed[r] = 0
    return b


@nb.njit(cache=True)
def keep(r, c, now, hist, blocks, computed, mem):
    """A finished turn leaves its full blocks as the conversation's history (replacing whatever history
    the conversation had; with open-loop arrivals that may be a later turn's); the partial last block
    is freed (added to ``mem[0]``)."""
    hi, ad_h = hist[0], hist[2]
    a = hi[c, HI_ADAPTER]
    settle(c, now, hist, mem)
    if hi[c, HI_STATE] == H_GPU:
        evict(c, hist, mem)
    if hi[c, HI_STATE] != H_LOADING:  # a swap-in in flight keeps its blocks until it lands
        hi[c, HI_STATE] = H_NONE
        hi[c, HI_BLOCKS] = 0
        full = min(blocks[r], computed[r] // hist[4][HC_BLOCK])
        mem[0] += blocks[r] - full
        if full > 0:
            hi[c, HI_STATE] = H_GPU
            hi[c, HI_BLOCKS] = full
            mem[2] += full
            ad_h[a, AH_ENTRIES] += 1
            ad_h[a, AH_BLOCKS] += full
    else:
        mem[0] += blocks[r]
    hist[1][c, HF_LAST] = now
    blocks[r] = 0


@nb.njit(cache=True)
def best_victim(tier, now, mode_elora, hist, mem, fp, ftot):
    """The idle GPU history to evict first in ``tier`` (0: no unfinished turn wants it, 1: one does,
    2: any) and its keep-value (lower goes first): ELORA's eq. 5 (``ftot``: all adapters' decayed
    visits), else its last use. Ties (ELORA's recency term underflows for long-idle history) go to
    the least recently used. -1 if none."""
    hi, hf, cq, hp = hist[0], hist[1], hist[3], hist[5]
    best, best_v, best_t = -1, np.inf, np.inf
    if mem[2] == 0:
        return best, best_v
    for c in range(hi.shape[0]):
        settle(c, now, hist, mem)
        if hi[c, HI_STATE] != H_GPU or tier < 2 and (cq[c] > 0) != (tier == 1):
            continue
        last = hf[c, HF_LAST]
        if mode_elora:
            age = now - last
            visit_share = decayed(hf[c, HF_FREQ], hf[c, HF_FREQ_T], now, fp[P_FREQ_WINDOW_S]) / ftot if ftot > 0 else 0.0
            cost = hi[c, HI_BLOCKS] * hist[4][HC_BLOCK] * hp[HP_SWAP_MS_PER_TOKEN]
            v = cost * visit_share * (1.0 - 1.0 / (1.0 + np.exp(-age / fp[P_RECENCY_TAU_S])))
        else:
            v = last
        if v < best_v or v == best_v and last < best_t:
            best, best_v, best_t = c, v, last
    return best, best_v
