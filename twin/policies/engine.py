"""Event loop of one server under an alternative serving policy (Chameleon, Toppings, ELORA, S-LoRA).

It keeps vLLM V1's step model from ``twin.core`` (per-step token budget shared by running requests
first, chunked prefill, KV blocks, recompute preemption of the newest running request, the
profile's step latency and scheduler overhead) and changes what those systems change:

* Memory is one pool of KV blocks that also holds the adapters (S-LoRA's unified paging, which
  Chameleon, Toppings and ELORA all build on): an adapter takes blocks for its own rank, only while
  it is on the GPU, instead of vLLM's ``a_max`` slots of ``max_lora_rank`` carved out at start-up.
  ``a_max`` stays the most distinct adapters one batch may hold (vLLM's ``max_loras`` rule).
* Adapters live in host memory and are copied over one PCIe channel, one at a time (FIFO), so
  concurrent loads queue behind each other (the contention Chameleon measures). How a cold adapter
  is served is the cold-start mode: ``inline`` (the load runs inside the step and stalls the whole
  batch, vLLM/S-LoRA as Toppings describes them), ``async`` (copied in the background, only its
  requests wait), ``cpu`` (Toppings: the request is admitted at once and its LoRA runs on CPU
  cores while the copy proceeds).
* Idle adapters (no running request) stay cached in free blocks until memory is needed; then the
  cache rule picks victims (``rules.eviction_scores``): discard-after-use (S-LoRA), LRU, Chameleon's
  score or ELORA's retention value. Adapters wanted by queued requests are evicted last.
* Scheduling is vLLM's FIFO scan (a request whose adapter is not ready is skipped) or Chameleon's
  multi-level queues with token quotas (strict FIFO per queue, phase-2 redistribution of the quota
  of emptied queues). With ``bypass`` (the MICRO paper's Opportunistic Bypass; off: the blog's
  blocked head) a queue head whose adapter finds no memory even after every idle adapter is
  evicted lets younger requests of its queue whose adapters are on the GPU run first, each only if
  its predicted run time is shorter than the predicted wait for the head's memory
  (:func:`_memory_wait_s`); if the head's memory (counting the bypassers' KV) turns up before they
  finish, they are squashed (restarted later, right behind the head). A request holds
  ``input + predicted output`` tokens of its queue's quota from admission to finish. Deviation: the
  paper also debits its adapter's size per request; with many running requests sharing an adapter
  that counts the same weights many times, so here the adapter is paid once, in the memory pool,
  like every policy's adapters. Quotas share the
  pool's tokens; KV blocks are still allocated as vLLM does (a mis-predicted output can preempt).
* ELORA's swapper: every ``swap_period`` it brings in host adapters with the highest retention
  value while the pool is below the idle threshold and fewer than ``Low_lora`` LoRAs are resident.
* History KV of multi-turn conversations (``prefix_cache``; ``twin.policies.history``): a finished
  turn's KV stays in the pool for the next turn, which computes only its new tokens; idle history
  is evicted like an idle adapter (to host memory with ``host_kv``, and, under ``dependency``,
  before its adapter).

Structure. The loop's state is a few records, named tuples of arrays that numba compiles as structs
(a scalar the phases change is a 1-element array, since a named tuple's fields are fixed):
:class:`Server` (fixed settings), :class:`RequestState`, :class:`Adapters` (the adapter cache),
:class:`Pool` (the block pool and the host link), :class:`Queues`, :class:`Loop` (running list,
counters, one step's scratch), :class:`Outputs` and the history KV (``history.History``).
:func:`simulate_policy_core` is the sequence of phase functions over them, one step per turn. It
turns each named tuple into a record (``twin.policies.records``: one uncounted pointer, so a phase
call does not touch the reference count of every array) and frees them at the end.
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

from twin import core
from twin.core import (
    EV_PREEMPTED,
    apply_step_output,
    batch_shape,
    drop_finished,
    sample_series,
    scheduler_ms,
    step_buffers,
    step_ms,
    trace_event,
    trace_scheduled,
)
from twin.policies import history as hx
from twin.policies.records import free_records, new_record
from twin.policies.rules import (
    CACHE_DISCARD,
    CACHE_ELORA,
    CACHE_LRU,
    P_BATCH_WINDOW_S,
    P_CPU_SYNC_MS,
    P_FREQ_WINDOW_S,
    P_IDLE_THRESHOLD,
    P_REFRESH_S,
    P_SLO_S,
    P_SWAP_PERIOD_S,
    P_WRS_A,
    P_WRS_B,
    decayed,
    eviction_scores,
    kmeans_boundaries,
    low_lora,
    mlq_quotas,
    queue_of,
)
from twin.states import FINISHED, REJECTED, RUNNING, WAITING

SCHED_FIFO, SCHED_MLQ = 0, 1
COLD_INLINE, COLD_ASYNC, COLD_CPU = 0, 1, 2
AD_HOST, AD_LOADING, AD_GPU = 0, 1, 2

# What one waiting request does to the scan of its queue (:func:`_try_admit`).
SCAN_NEXT, SCAN_STOP, SCAN_ADMITTED, SCAN_BYPASS = 0, 1, 2, 3

# Policy statistics returned next to the counters.
(S_HITS, S_MISSES, S_EVICTIONS, S_STALL_S, S_CPU_STEPS, S_PEAK_RESIDENT, S_SWAP_INS, S_REFRESHES, S_LOADS,
 S_BYPASSES, S_SQUASHED, S_HISTORY_TOKENS, S_REUSED_TOKENS, S_PREFILL_TOKENS, S_KV_EVICTIONS, S_KV_SWAP_INS,
 S_INVALID_BLOCK_S, S_USED_BLOCK_S) = range(18)
N_STATS = 18


class Server(NamedTuple):
    """The server's fixed settings: its engine, the policy, what to record."""

    duration: float
    a_max: int  # most distinct adapters in one batch (vLLM's max_loras)
    pool_blocks: int
    block_size: int
    max_batched: int
    max_num_seqs: int
    full_prompt_admission: bool
    lat: np.ndarray  # step latency terms (twin.core.step_ms)
    sched: np.ndarray  # scheduler overhead terms (twin.core.scheduler_ms)
    cache: int  # rules.CACHE_*
    scheduler: int  # SCHED_*
    cold_start: int  # COLD_*
    prefetch: bool
    queues: int  # Chameleon's queues (MLQ)
    preload_all: bool
    bypass: bool
    fp: np.ndarray  # the policy's constants (rules.P_*)
    max_in_flight: int  # client-side cap on requests in flight (0 = none)
    ts_dt: float  # time-series sampling period, s (0 = off)
    trace_cap: int  # capacity of the event trace (0 = off)
    itl_edges: np.ndarray  # the ITL histogram's bin edges (twin.core.itl_bin_edges)


class RequestState(NamedTuple):
    """Per request, sorted by arrival: its inputs, then the loop's state (``twin.core.request_state``)."""

    arrival: np.ndarray
    adapter: np.ndarray
    in_len: np.ndarray
    out_pred: np.ndarray  # predicted output tokens (Chameleon's scheduler)
    conv: np.ndarray  # conversation (-1: a single-turn request)
    history_len: np.ndarray  # tokens of its conversation before this turn
    state: np.ndarray
    computed: np.ndarray
    ntok: np.ndarray
    blocks: np.ndarray
    first_tok: np.ndarray
    finish: np.ndarray
    last_tok: np.ndarray
    done_at: np.ndarray
    admit_t: np.ndarray  # first admission (-1: not yet)


class Adapters(NamedTuple):
    """The adapter cache, per adapter: its inputs, then where it is and how it is used."""

    tokens: np.ndarray  # pool tokens of its weights
    blocks: np.ndarray  # pool blocks of its weights
    load_ms: np.ndarray  # host-to-GPU copy time
    cpu_ms_per_token: np.ndarray  # its LoRA on CPU cores (Toppings)
    state: np.ndarray  # AD_HOST, AD_LOADING or AD_GPU
    ready: np.ndarray  # when its copy lands
    rc: np.ndarray  # running requests
    qc: np.ndarray  # waiting requests
    freq: np.ndarray  # decayed use count (rules.decayed) ...
    freq_t: np.ndarray  # ... and its stamp
    last_used: np.ndarray
    bs_avg: np.ndarray  # [0]: recent batch size (ELORA's Low_lora, eq. 3)


class Pool(NamedTuple):
    """The one pool of KV blocks that also holds the adapters, and the host link (1-element arrays)."""

    free: np.ndarray  # free blocks
    resident: np.ndarray  # adapters on (or coming to) the GPU
    history: np.ndarray  # blocks held by idle GPU history
    link: np.ndarray  # when the PCIe channel is free (copies queue on it FIFO)


class Queues(NamedTuple):
    """The waiting queues (vLLM's one, or Chameleon's) as linked lists of requests, and Chameleon's
    quotas, queue cut-offs and bypass."""

    head: np.ndarray  # per queue
    tail: np.ndarray
    nxt: np.ndarray  # per request: the next one in its queue (-1: none)
    prv: np.ndarray
    req_q: np.ndarray  # per request: its queue
    wrs: np.ndarray  # per request: its WRS (what decides its queue)
    need_res: np.ndarray  # per request: tokens it holds of its queue's quota (MLQ)
    borrow: np.ndarray  # per request: tokens it borrowed in phase 2 instead
    bypass_of: np.ndarray  # per request: the blocked head it bypassed (-1: none)
    blocked: np.ndarray  # per queue: its head waiting for adapter memory, bypassed (-1: none)
    bounds: np.ndarray  # WRS cut-offs between the queues
    quota: np.ndarray  # per queue: its tokens ...
    used: np.ndarray  # ... and those its requests hold
    borrowed: np.ndarray  # [0]: tokens held by borrowers
    max_in_seen: np.ndarray  # [0]: longest prompt so far (WRS scale)
    max_out_seen: np.ndarray  # [0]: longest predicted output so far
    max_ad_tokens: float  # largest adapter (WRS scale)
    next_refresh: np.ndarray  # [0]: time of the next re-forming of the queues
    win_lo: np.ndarray  # [0]: first request of the refresh window


class Loop(NamedTuple):
    """The running list, the loop's counters (1-element arrays) and one step's scratch."""

    running: np.ndarray  # running requests in admission order (the first nrun[0])
    nrun: np.ndarray
    n_waiting: np.ndarray
    n_distinct: np.ndarray  # distinct adapters of the running requests
    next_arr: np.ndarray  # the next request to arrive
    rejected: np.ndarray
    preemptions: np.ndarray
    busy_s: np.ndarray
    step_avg_s: np.ndarray  # recent step time (the bypass's predictions)
    next_swap: np.ndarray  # when ELORA's swapper runs next
    sched_req: np.ndarray  # the step's scheduled requests ...
    sched_tok: np.ndarray  # ... their tokens ...
    nsched: np.ndarray  # ... and their number
    budget: np.ndarray  # tokens left in the step
    inline_ms: np.ndarray  # inline adapter loads the step waits for
    batch_ads: np.ndarray  # the batch's distinct adapters (twin.core.batch_shape)
    batch_stamp: np.ndarray
    ad_prompt_tok: np.ndarray  # per adapter: the step's tokens (CPU-assisted LoRA)
    done_j: np.ndarray  # positions of the step's finished requests


class Outputs(NamedTuple):
    """What the run records: ITL histogram, time series, event trace and policy statistics."""

    itl_hist: np.ndarray
    step_bin: np.ndarray  # [0]: the ITL bin of the last step's length
    ts: np.ndarray
    ts_i: np.ndarray  # [0]: samples taken
    next_ts: np.ndarray  # [0]: time of the next sample
    trace: np.ndarray
    tr_i: np.ndarray  # [0]: events recorded
    stats: np.ndarray  # S_*


def new_requests(arrival, adapter, in_len, out_len, out_pred, conv, history_len) -> RequestState:
    """The requests (sorted by arrival) before the run: none arrived."""
    return RequestState(arrival, adapter, in_len, out_pred, conv, history_len, *core.request_state(in_len, out_len),
                        np.full(arrival.shape[0], -1.0))


def new_adapters(tokens, blocks, load_ms, cpu_ms_per_token) -> Adapters:
    """The adapters before the run: all in host memory, unused."""
    na = tokens.shape[0]
    return Adapters(tokens, blocks, load_ms, cpu_ms_per_token, np.zeros(na, np.int8), np.zeros(na),
                    np.zeros(na, np.int64), np.zeros(na, np.int64), np.zeros(na), np.zeros(na), np.zeros(na),
                    np.ones(1))


@nb.njit(cache=True)
def _settle(a, now, ads):
    if ads.state[a] == AD_LOADING and ads.ready[a] <= now:
        ads.state[a] = AD_GPU


@nb.njit(cache=True)
def _reclaimable(protect, now, ads, pool, hist):
    """Free blocks plus those of all idle history and of every idle adapter but ``protect`` (what
    evicting them all gives; under the dependency rule not adapters whose history is still coming in)."""
    free = pool.free[0] + pool.history[0]
    for a in range(ads.state.shape[0]):
        _settle(a, now, ads)
        if ads.state[a] == AD_GPU and ads.rc[a] == 0 and a != protect and not (hist.depend and hist.ad_loading[a]):
            free += ads.blocks[a]
    return free


@nb.njit(cache=True)
def _lora_victim(tier, protect, now, srv, ads, hist, cand):
    """The idle adapter to evict first in ``tier`` (as :func:`_make_room`'s) and its keep-value; -1 if none."""
    n_c = 0
    for a in range(ads.state.shape[0]):
        _settle(a, now, ads)
        cand[a] = (ads.state[a] == AD_GPU and ads.rc[a] == 0 and a != protect and ads.blocks[a] > 0
                   and (tier == 2 or (ads.qc[a] > 0) == (tier == 1))
                   and not (hist.depend and hist.ad_entries[a] > 0))
        n_c += cand[a]
    if n_c == 0:
        return -1, np.inf
    score = eviction_scores(srv.cache, now, cand, ads.freq, ads.freq_t, ads.last_used, ads.tokens, ads.load_ms,
                            srv.fp)
    v = int(np.argmin(score))
    return v, score[v]


@nb.njit(cache=True)
def _make_room(need, protect, now, srv, ads, pool, hist, stats, partial=False):
    """Evict idle adapters and idle history (``twin.policies.history``) until ``need`` blocks are
    free (``pool.free``); idle = on the GPU with no running request; what no unfinished request wants
    goes first, then the rest (then anything, for adapters the dependency rule held back). False if it
    cannot; then nothing is evicted, unless ``partial`` (KV for running requests: every block spared
    is a smaller preemption)."""
    na = ads.state.shape[0]
    if not partial and pool.free[0] < need and _reclaimable(protect, now, ads, pool, hist) < need:
        return False
    elora = srv.cache == CACHE_ELORA
    ftot, low = 0.0, 0.0  # ELORA's terms for weighing history against adapters (fixed during one call)
    if elora and hist.on:
        for a in range(na):
            ftot += decayed(ads.freq[a], ads.freq_t[a], now, srv.fp[P_FREQ_WINDOW_S])
        low = low_lora(ads.freq, ads.freq_t, now, srv.fp[P_BATCH_WINDOW_S], ads.bs_avg[0])
    cand = np.zeros(na, np.bool_)
    for tier in range(3):
        while pool.free[0] < need:
            v, v_score = _lora_victim(tier, protect, now, srv, ads, hist, cand)
            c, c_score = -1, np.inf
            if pool.history[0] > 0:
                # Eq. 4 (Choice, the notes' ambiguity b): a LoRA's keep-value grows as evicting it
                # would leave fewer than Low_lora LoRAs; history leaves keep theirs.
                if elora and v >= 0 and pool.resident[0] - 1 < low:
                    v_score *= min(1e6, low / max(pool.resident[0] - 1, 1e-6))
                c, c_score = hx.best_victim(tier, now, elora, hist, pool, srv.fp, ftot)
            if v < 0 and c < 0:
                break
            if c >= 0 and (v < 0 or not elora and srv.cache != CACHE_LRU or c_score <= v_score):
                hx.evict(c, hist, pool)
                stats[S_KV_EVICTIONS] += 1
                continue
            ads.state[v] = AD_HOST
            pool.free[0] += ads.blocks[v]
            pool.resident[0] -= 1
            stats[S_EVICTIONS] += 1
    return pool.free[0] >= need


@nb.njit(cache=True)
def _reserve(a, ads, pool, stats):
    """Take adapter ``a``'s blocks for a load (its copy is the caller's)."""
    pool.free[0] -= ads.blocks[a]
    pool.resident[0] += 1
    stats[S_PEAK_RESIDENT] = max(stats[S_PEAK_RESIDENT], pool.resident[0])
    stats[S_LOADS] += 1


@nb.njit(cache=True)
def _start_load(a, now, srv, ads, pool, hist, stats):
    """Reserve ``a``'s blocks and queue its copy on the PCIe channel."""
    if not _make_room(ads.blocks[a], a, now, srv, ads, pool, hist, stats):
        return False
    _reserve(a, ads, pool, stats)
    start = max(now, pool.link[0])
    ads.ready[a] = start + ads.load_ms[a] / 1000.0
    pool.link[0] = ads.ready[a]
    ads.state[a] = AD_LOADING
    return True


@nb.njit(cache=True)
def _swap_in_history(c, a, now, srv, ads, pool, hist, stats):
    """Make room for host history ``c`` (sparing its adapter ``a``) and queue its copy back."""
    if not _make_room(hist.blocks[c], a, now, srv, ads, pool, hist, stats):
        return False
    hx.start_swap_in(c, now, hist, pool)
    stats[S_KV_SWAP_INS] += 1
    return True


@nb.njit(cache=True)
def _q_insert_after(r, after, q, qs):
    qs.prv[r] = after
    qs.nxt[r] = qs.nxt[after]
    if qs.nxt[after] >= 0:
        qs.prv[qs.nxt[after]] = r
    else:
        qs.tail[q] = r
    qs.nxt[after] = r


@nb.njit(cache=True)
def _q_push(r, q, front, qs):
    if front:
        qs.nxt[r] = qs.head[q]
        qs.prv[r] = -1
        if qs.head[q] >= 0:
            qs.prv[qs.head[q]] = r
        else:
            qs.tail[q] = r
        qs.head[q] = r
    elif qs.tail[q] >= 0:
        _q_insert_after(r, qs.tail[q], q, qs)
    else:
        qs.prv[r] = -1
        qs.nxt[r] = -1
        qs.head[q] = r
        qs.tail[q] = r


@nb.njit(cache=True)
def _q_remove(r, q, qs):
    if qs.prv[r] >= 0:
        qs.nxt[qs.prv[r]] = qs.nxt[r]
    else:
        qs.head[q] = qs.nxt[r]
    if qs.nxt[r] >= 0:
        qs.prv[qs.nxt[r]] = qs.prv[r]
    else:
        qs.tail[q] = qs.prv[r]


@nb.njit(cache=True)
def _dequeue(r, q, a, ads, qs, lp):
    """Waiting request ``r`` (of adapter ``a``) leaves queue ``q``: admitted or refused."""
    lp.n_waiting[0] -= 1
    ads.qc[a] -= 1
    _q_remove(r, q, qs)


@nb.njit(cache=True, inline="always")
def _release_claims(r, qs):
    """Give back what running request ``r`` held of its queue (MLQ; without it both terms are zero):
    its quota tokens, or those it borrowed, and its bypass mark."""
    if qs.borrow[r] > 0:
        qs.borrowed[0] -= qs.borrow[r]
        qs.borrow[r] = 0.0
    else:
        qs.used[qs.req_q[r]] -= qs.need_res[r]
    qs.bypass_of[r] = -1


@nb.njit(cache=True, inline="always")
def _back_to_waiting(v, rq, ads, pool, qs, lp):
    """Free running request ``v``'s KV and mark it waiting to be recomputed (a preemption or a squash;
    the caller takes it off the running list and queues it)."""
    a = rq.adapter[v]
    pool.free[0] += rq.blocks[v]
    rq.blocks[v] = 0
    rq.computed[v] = 0
    rq.state[v] = WAITING
    ads.qc[a] += 1
    _release_claims(v, qs)
    ads.rc[a] -= 1
    lp.n_waiting[0] += 1
    if ads.rc[a] == 0:
        lp.n_distinct[0] -= 1


@nb.njit(cache=True)
def _kv_check(r, srv, rq):
    """KV blocks waiting request ``r`` must find free to be admitted (the admission rule's check)."""
    bs = srv.block_size
    if srv.full_prompt_admission:
        return (rq.ntok[r] + bs - 1) // bs
    return (min(rq.ntok[r] - rq.computed[r], srv.max_batched) + bs - 1) // bs


@nb.njit(cache=True)
def _steps_left(r, srv, rq):
    """Steps request ``r`` still needs as the scheduler predicts them: its prompt's remaining chunks
    plus the predicted output tokens not yet generated (at least one)."""
    prefill = max(0, rq.in_len[r] - rq.computed[r])
    return -(-prefill // srv.max_batched) + max(1, rq.out_pred[r] - max(0, rq.ntok[r] - rq.in_len[r]))


@nb.njit(cache=True)
def _memory_wait_s(shortfall, srv, rq, lp):
    """Chameleon's prediction of how soon ``shortfall`` blocks free up: running requests finish in
    order of their predicted remaining steps (x the recent step time) and return their KV blocks
    (Choice: adapters they leave idle are not counted, so the wait is an upper bound); inf if they
    never free enough."""
    if shortfall <= 0:
        return 0.0
    nrun = lp.nrun[0]
    left = np.empty(nrun, np.int64)
    for j in range(nrun):
        left[j] = _steps_left(lp.running[j], srv, rq)
    freed = 0
    for j in np.argsort(left, kind="mergesort"):
        freed += rq.blocks[lp.running[j]]
        if freed >= shortfall:
            return left[j] * lp.step_avg_s[0]
    return np.inf


@nb.njit(cache=True)
def _new_pool(srv, ads):
    """The pool at start-up: empty, or holding every adapter that fits (``preload_all``)."""
    pool = new_record(Pool(np.full(1, srv.pool_blocks, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64),
                          np.zeros(1)))
    if srv.preload_all:
        for a in range(ads.state.shape[0]):
            if pool.free[0] >= ads.blocks[a]:
                ads.state[a] = AD_GPU
                pool.free[0] -= ads.blocks[a]
                pool.resident[0] += 1
    return pool


@nb.njit(cache=True)
def _new_queues(srv, ads, n):
    """Empty queues: one, or Chameleon's with static equal-range cut-offs and equal quotas until the
    first refresh."""
    nq = srv.queues if srv.scheduler == SCHED_MLQ else 1
    bounds = np.empty(max(nq - 1, 0))
    for q in range(nq - 1):
        bounds[q] = (q + 1.0) / nq
    na = ads.tokens.shape[0]
    return new_record(Queues(np.full(nq, -1, np.int64), np.full(nq, -1, np.int64), np.full(n, -1, np.int64),
                  np.full(n, -1, np.int64), np.zeros(n, np.int64), np.zeros(n), np.zeros(n), np.zeros(n),
                  np.full(n, -1, np.int64), np.full(nq, -1, np.int64), bounds,
                  np.full(nq, float(srv.pool_blocks * srv.block_size) / nq), np.zeros(nq), np.zeros(1),
                  np.ones(1), np.ones(1), max(1.0, float(ads.tokens.max())) if na > 0 else 1.0,
                  np.full(1, srv.fp[P_REFRESH_S]), np.zeros(1, np.int64)))


@nb.njit(cache=True)
def _new_loop(srv, rq, ads):
    """Nothing running or waiting, at time 0, and the step buffers (``twin.core.step_buffers``)."""
    n = rq.arrival.shape[0]
    na = ads.state.shape[0]
    running, sched_req, sched_tok, batch_ads, done_j, itl_hist, ts, trace = step_buffers(
        n, srv.max_num_seqs, srv.max_batched, srv.duration, srv.ts_dt, srv.trace_cap)
    z = np.zeros(1, np.int64)
    lp = Loop(running, z.copy(), z.copy(), z.copy(), z.copy(), z.copy(), z.copy(), np.zeros(1),
              np.full(1, step_ms(srv.lat, 1.0, 0.0, 1) / 1000.0), np.zeros(1), sched_req, sched_tok, z.copy(),
              z.copy(), np.zeros(1), batch_ads, np.full(na, -1, np.int64), np.zeros(na), done_j)
    out = Outputs(itl_hist, z.copy(), ts, z.copy(), np.zeros(1), trace, z.copy(), np.zeros(N_STATS))
    return new_record(lp), new_record(out)


@nb.njit(cache=True)
def _arrive(now, srv, rq, ads, pool, qs, hist, lp, stats):
    """Arrivals up to ``now`` join the back of their queue (or are refused past ``max_in_flight``)."""
    n = rq.arrival.shape[0]
    while lp.next_arr[0] < n and rq.arrival[lp.next_arr[0]] <= now:
        r = lp.next_arr[0]
        lp.next_arr[0] += 1
        if srv.max_in_flight > 0 and lp.nrun[0] + lp.n_waiting[0] >= srv.max_in_flight:
            rq.state[r] = REJECTED
            lp.rejected[0] += 1
        else:
            _enqueue(r, now, srv, rq, ads, pool, qs, hist, lp, stats)


@nb.njit(cache=True)
def _enqueue(r, now, srv, rq, ads, pool, qs, hist, lp, stats):
    """Arrival ``r`` waits in its queue; its adapter's copy starts (prefetch), its history follows."""
    a = rq.adapter[r]
    rq.state[r] = WAITING
    lp.n_waiting[0] += 1
    ads.qc[a] += 1
    fw = srv.fp[P_FREQ_WINDOW_S]
    ads.freq[a] = decayed(ads.freq[a], ads.freq_t[a], now, fw) + 1.0
    ads.freq_t[a] = now
    _settle(a, now, ads)
    stats[S_HITS if ads.state[a] != AD_HOST else S_MISSES] += 1
    c = rq.conv[r]
    if c >= 0 and hist.on:
        hx.visit(c, now, hist, fw)
    if srv.scheduler == SCHED_MLQ:
        _classify(r, srv, rq, ads, qs)
    _q_push(r, qs.req_q[r], False, qs)
    if srv.prefetch and srv.cold_start != COLD_INLINE and ads.state[a] == AD_HOST:
        _start_load(a, now, srv, ads, pool, hist, stats)
    # Host history comes back behind its adapter, never without it (ELORA swaps in only
    # subtrees whose parent is on the GPU).
    if c >= 0 and hist.on and srv.prefetch and hist.state[c] == hx.H_HOST and ads.state[a] != AD_HOST:
        _swap_in_history(c, a, now, srv, ads, pool, hist, stats)


@nb.njit(cache=True)
def _classify(r, srv, rq, ads, qs):
    """Chameleon: arrival ``r``'s WRS (prompt and predicted output, scaled by the largest seen, times
    its adapter's size), hence its queue, and the quota tokens it will hold."""
    fp = srv.fp
    qs.max_in_seen[0] = max(qs.max_in_seen[0], float(rq.in_len[r]))
    qs.max_out_seen[0] = max(qs.max_out_seen[0], float(rq.out_pred[r]))
    qs.wrs[r] = ((fp[P_WRS_A] * rq.in_len[r] / qs.max_in_seen[0] + fp[P_WRS_B] * rq.out_pred[r] / qs.max_out_seen[0])
                 * max(ads.tokens[rq.adapter[r]], 1) / qs.max_ad_tokens)
    qs.req_q[r] = queue_of(qs.wrs[r], qs.bounds)
    qs.need_res[r] = rq.in_len[r] + rq.out_pred[r]


@nb.njit(cache=True)
def _sample(now, srv, pool, lp, out):
    """Time-series samples (running, waiting, pool use) up to ``now``."""
    out.ts_i[0], out.next_ts[0] = sample_series(out.ts, out.ts_i[0], out.next_ts[0], srv.ts_dt, now, lp.nrun[0],
                                                lp.n_waiting[0], srv.pool_blocks, pool.free[0])


@nb.njit(cache=True)
def _refresh_queues(now, srv, rq, qs, lp, stats):
    """Chameleon: re-form the queues and their quotas from the last refresh period's requests."""
    nq = qs.head.shape[0]
    t_ref = srv.fp[P_REFRESH_S]
    hi = lp.next_arr[0]
    while qs.win_lo[0] < hi and rq.arrival[qs.win_lo[0]] < now - t_ref:
        qs.win_lo[0] += 1
    lo = qs.win_lo[0]
    if hi - lo > 0:
        qs.bounds[:] = kmeans_boundaries(qs.wrs[lo:hi].copy(), nq)
        s_max = np.zeros(nq)
        cnt = np.zeros(nq)
        d_sum = np.zeros(nq)
        d_cnt = np.zeros(nq)
        for r in range(lo, hi):
            q = queue_of(qs.wrs[r], qs.bounds)
            cnt[q] += 1
            s_max[q] = max(s_max[q], qs.need_res[r])
            if rq.state[r] == FINISHED:
                d_sum[q] += rq.finish[r] - rq.admit_t[r]
                d_cnt[q] += 1
        d_all = d_sum.sum() / d_cnt.sum() if d_cnt.sum() > 0 else 0.0
        dq = np.zeros(nq)
        for q in range(nq):
            dq[q] = d_sum[q] / d_cnt[q] if d_cnt[q] > 0 else d_all
        qs.quota[:] = mlq_quotas(s_max, dq, cnt / t_ref, srv.fp[P_SLO_S], float(srv.pool_blocks * srv.block_size))
        stats[S_REFRESHES] += 1
    qs.next_refresh[0] = now + t_ref


@nb.njit(cache=True)
def _swap_in_idle(now, srv, ads, pool, hist, lp, stats):
    """ELORA's swapper: bring in the host adapters of highest retention value while the pool stays
    below the idle threshold and fewer than Low_lora adapters are resident."""
    na = ads.state.shape[0]
    target = low_lora(ads.freq, ads.freq_t, now, srv.fp[P_BATCH_WINDOW_S], ads.bs_avg[0])
    idle_blocks = int((1.0 - srv.fp[P_IDLE_THRESHOLD]) * srv.pool_blocks)
    while pool.resident[0] < np.ceil(target):
        cand = np.zeros(na, np.bool_)
        for a in range(na):
            cand[a] = ads.state[a] == AD_HOST and ads.freq[a] > 0 and pool.free[0] - ads.blocks[a] >= idle_blocks
        if not cand.any():
            break
        score = eviction_scores(srv.cache, now, cand, ads.freq, ads.freq_t, ads.last_used, ads.tokens, ads.load_ms,
                                srv.fp)
        best = int(np.argmax(np.where(cand, score, -1.0)))
        _start_load(best, now, srv, ads, pool, hist, stats)
        stats[S_SWAP_INS] += 1
    lp.next_swap[0] = now + srv.fp[P_SWAP_PERIOD_S]


@nb.njit(cache=True)
def _squash_bypassers(now, srv, rq, ads, pool, qs, hist, lp, out):
    """Chameleon's squash: a bypassed head whose memory (counting its bypassers' KV) is there now
    gets it; its bypassers restart later, right behind it. A head no longer blocked is unmarked."""
    for q in range(qs.head.shape[0]):
        r1 = qs.blocked[q]
        if r1 < 0:
            continue
        a1 = rq.adapter[r1]
        _settle(a1, now, ads)
        held = 0  # the bypassers' KV (Choice: their adapters, idle after a squash, are not counted)
        for j in range(lp.nrun[0]):
            if qs.bypass_of[lp.running[j]] == r1:
                held += rq.blocks[lp.running[j]]
        free = _reclaimable(-1, now, ads, pool, hist)
        need1 = ads.blocks[a1] + _kv_check(r1, srv, rq)
        waiting_head = rq.state[r1] == WAITING and ads.state[a1] == AD_HOST and free < need1
        if waiting_head and held > 0 and free + held >= need1:
            _squash(r1, now, srv, rq, ads, pool, qs, lp, out)
            waiting_head = False
        if not waiting_head:
            qs.blocked[q] = -1
            for j in range(lp.nrun[0]):
                if qs.bypass_of[lp.running[j]] == r1:
                    qs.bypass_of[lp.running[j]] = -1


@nb.njit(cache=True)
def _squash(r1, now, srv, rq, ads, pool, qs, lp, out):
    """Send the running requests that bypassed head ``r1`` back to its queue, right behind it."""
    k = 0
    after = r1
    for j in range(lp.nrun[0]):
        v = lp.running[j]
        if qs.bypass_of[v] != r1:
            lp.running[k] = v
            k += 1
            continue
        _back_to_waiting(v, rq, ads, pool, qs, lp)
        _q_insert_after(v, after, qs.req_q[v], qs)
        after = v
        out.stats[S_SQUASHED] += 1
        out.tr_i[0] = trace_event(out.trace, srv.trace_cap, out.tr_i[0], now, v, 0, EV_PREEMPTED)
    lp.nrun[0] = k


@nb.njit(cache=True)
def _schedule_running(now, srv, rq, ads, pool, qs, hist, lp, out):
    """Start the step with vLLM's RUNNING loop: KV for the running requests' new tokens, from free
    blocks, then idle adapters and history, then by preempting the newest running request. True if
    it preempted (then the step admits no waiting request)."""
    bs = srv.block_size
    budget = srv.max_batched
    nsched = 0
    nrun = lp.nrun[0]
    preempted = False
    i = 0
    while i < nrun and budget > 0:
        r = lp.running[i]
        num_new = min(rq.ntok[r] - rq.computed[r], budget)
        need = (rq.computed[r] + num_new + bs - 1) // bs - rq.blocks[r]
        if need > pool.free[0]:
            _make_room(need, -1, now, srv, ads, pool, hist, out.stats, True)
        scheduled = True
        while need > pool.free[0]:
            v = lp.running[nrun - 1]
            nrun -= 1
            _back_to_waiting(v, rq, ads, pool, qs, lp)
            lp.preemptions[0] += 1
            _q_push(v, qs.req_q[v], True, qs)
            preempted = True
            out.tr_i[0] = trace_event(out.trace, srv.trace_cap, out.tr_i[0], now, v, 0, EV_PREEMPTED)
            if v == r:
                scheduled = False
                break
        if not scheduled:
            break
        rq.blocks[r] += need
        pool.free[0] -= need
        lp.sched_req[nsched] = r
        lp.sched_tok[nsched] = num_new
        nsched += 1
        budget -= num_new
        i += 1
    lp.nrun[0] = nrun
    lp.nsched[0] = nsched
    lp.budget[0] = budget
    lp.inline_ms[0] = 0.0
    return preempted


@nb.njit(cache=True)
def _admit_waiting(now, srv, rq, ads, pool, qs, hist, lp, out):
    """vLLM's WAITING loop: one FIFO scan that skips what is not ready, or Chameleon's two-phase quota
    fill (phase 2 lends the quota that emptied queues leave over to the others, in queue order)."""
    mlq = srv.scheduler == SCHED_MLQ
    leftover = 0.0
    for phase in range(2 if mlq else 1):
        for q in range(qs.head.shape[0]):
            if phase == 1 and leftover <= 0:
                break
            leftover = _scan_queue(q, phase, leftover, now, srv, rq, ads, pool, qs, hist, lp, out)
            if phase == 0 and mlq and qs.head[q] < 0:
                leftover += max(0.0, qs.quota[q] - qs.used[q])
        if phase == 0:
            leftover = max(0.0, leftover - qs.borrowed[0])


@nb.njit(cache=True)
def _scan_queue(q, phase, leftover, now, srv, rq, ads, pool, qs, hist, lp, out):
    """Admit from queue ``q`` in order while the step has tokens and seats, within the queue's quota
    (MLQ phase 0) or the ``leftover`` quota (phase 1, returned less what was borrowed)."""
    mlq = srv.scheduler == SCHED_MLQ
    r = qs.head[q]
    bypassing = -1  # the head this scan bypasses
    wait_s = 0.0  # its predicted wait for memory
    while r >= 0 and lp.budget[0] > 0 and lp.nrun[0] < srv.max_num_seqs:
        nr = qs.nxt[r]
        if mlq:
            # A queue with nothing running may always start its head (Choice: else a
            # quota below one request's size would starve the queue for good).
            allow = qs.quota[q] - qs.used[q] if phase == 0 else leftover
            if qs.need_res[r] > allow and not (phase == 0 and qs.used[q] <= 0):
                break
        act = _try_admit(r, q, bypassing, wait_s, now, srv, rq, ads, pool, qs, hist, lp, out)
        if act == SCAN_STOP:
            break
        if act == SCAN_BYPASS:
            # No memory for the head's adapter even with every idle adapter evicted.
            bypassing = r
            need1 = ads.blocks[rq.adapter[r]] + _kv_check(r, srv, rq)
            wait_s = _memory_wait_s(need1 - pool.free[0], srv, rq, lp)
        elif act == SCAN_ADMITTED and mlq:
            if phase == 0:
                qs.used[q] += qs.need_res[r]
            else:
                qs.borrow[r] = qs.need_res[r]
                qs.borrowed[0] += qs.need_res[r]
                leftover -= qs.need_res[r]
        r = nr
    return leftover


@nb.njit(cache=True, inline="always")  # per waiting request, once per scan
def _try_admit(r, q, bypassing, wait_s, now, srv, rq, ads, pool, qs, hist, lp, out):
    """Admit waiting request ``r`` if its adapter is ready (starting its copy if not) and its KV fits
    (after evictions). Returns what the scan does next (SCAN_*): skip ``r``, stop, go on after
    admitting it, or bypass it (the head of queue ``q``)."""
    a = rq.adapter[r]
    if ads.rc[a] == 0 and lp.n_distinct[0] >= srv.a_max:
        # vLLM's max_loras rule skips, in every scheduler (Choice for Chameleon:
        # S-LoRA has no such limit; a blocked head here would idle the queue).
        return SCAN_NEXT
    _settle(a, now, ads)
    inline_load = False
    if ads.state[a] == AD_HOST:
        if srv.cold_start == COLD_INLINE:
            inline_load = True
        else:
            _start_load(a, now, srv, ads, pool, hist, out.stats)
    if (srv.cold_start == COLD_ASYNC and ads.state[a] != AD_GPU) or (srv.cold_start == COLD_CPU
                                                                     and ads.state[a] == AD_HOST):
        if srv.scheduler == SCHED_FIFO or bypassing >= 0:
            return SCAN_NEXT
        if srv.bypass and ads.state[a] == AD_HOST and r == qs.head[q]:
            return SCAN_BYPASS
        return SCAN_STOP
    if bypassing >= 0 and _steps_left(r, srv, rq) * lp.step_avg_s[0] >= wait_s:
        return SCAN_NEXT
    c = rq.conv[r]
    took = 0
    if c >= 0 and hist.on and rq.history_len[r] > 0:
        took = _reuse_history(r, c, a, now, srv, rq, ads, pool, hist, out.stats)
        if took < 0:  # still coming in: FIFO skips the turn, a Chameleon queue waits for it
            return SCAN_NEXT if srv.scheduler == SCHED_FIFO else SCAN_STOP
    bs = srv.block_size
    num_new = min(rq.ntok[r] - rq.computed[r], lp.budget[0])
    need = (rq.computed[r] + num_new + bs - 1) // bs - rq.blocks[r]
    check = (rq.ntok[r] + bs - 1) // bs - rq.blocks[r] if srv.full_prompt_admission else need
    extra = ads.blocks[a] if inline_load else 0
    if check + extra > pool.free[0]:
        _make_room(check + extra, a, now, srv, ads, pool, hist, out.stats)
    if check + extra > pool.free[0]:
        if took:
            check += hx.give_back(r, c, hist, rq.blocks, rq.computed, pool)
        return _refuse_if_never_fits(r, q, a, check + extra, srv, rq, ads, qs, hist, lp)
    _admit(r, q, a, c, took, need, num_new, inline_load, bypassing, now, rq, ads, pool, qs, hist, lp, out.stats)
    return SCAN_ADMITTED


@nb.njit(cache=True)
def _reuse_history(r, c, a, now, srv, rq, ads, pool, hist, stats):
    """A later turn takes over its conversation's history KV (host history is swapped back in first,
    if its adapter is not on the host). Returns the tokens reused, or -1 while a swap-in is under way."""
    hx.settle(c, now, hist, pool)
    if hist.state[c] == hx.H_HOST and ads.state[a] != AD_HOST:
        _swap_in_history(c, a, now, srv, ads, pool, hist, stats)
    if hist.state[c] == hx.H_LOADING:
        return -1
    if hist.state[c] == hx.H_GPU and hist.blocks[c] * srv.block_size <= rq.history_len[r]:
        return hx.take(r, c, now, hist, rq.blocks, rq.computed, pool)
    return 0


@nb.njit(cache=True)
def _refuse_if_never_fits(r, q, a, blocks, srv, rq, ads, qs, hist, lp):
    """Waiting request ``r`` needs ``blocks`` that are not free: it stops the scan, unless it could
    not fit even into an empty pool, where the server refuses it and the scan goes on."""
    own = ads.blocks[a] if ads.state[a] != AD_HOST else 0
    if lp.nrun[0] == 0 and lp.nsched[0] == 0 and blocks > srv.pool_blocks - own:
        rq.state[r] = REJECTED
        lp.rejected[0] += 1
        c = rq.conv[r]
        if c >= 0 and hist.on:
            hist.pending[c] -= 1
        _dequeue(r, q, a, ads, qs, lp)
        return SCAN_NEXT
    return SCAN_STOP


@nb.njit(cache=True)
def _admit(r, q, a, c, took, need, num_new, inline_load, bypassing, now, rq, ads, pool, qs, hist, lp, stats):
    """Waiting request ``r`` runs: its KV blocks, an inline load of its adapter, the bypass it makes,
    its place in the running list and the step."""
    if c >= 0 and hist.on and rq.admit_t[r] < 0:  # counted once, not per readmission
        stats[S_HISTORY_TOKENS] += rq.history_len[r]
        stats[S_REUSED_TOKENS] += took
    if inline_load:
        ads.state[a] = AD_GPU
        _reserve(a, ads, pool, stats)
        lp.inline_ms[0] += ads.load_ms[a]
    if bypassing >= 0:
        qs.bypass_of[r] = bypassing
        qs.blocked[q] = bypassing
        stats[S_BYPASSES] += 1
    rq.blocks[r] += need
    pool.free[0] -= need
    rq.state[r] = RUNNING
    if rq.admit_t[r] < 0:
        rq.admit_t[r] = now
    lp.running[lp.nrun[0]] = r
    lp.nrun[0] += 1
    if ads.rc[a] == 0:
        lp.n_distinct[0] += 1
    ads.rc[a] += 1
    _dequeue(r, q, a, ads, qs, lp)
    nsched = lp.nsched[0]
    lp.sched_req[nsched] = r
    lp.sched_tok[nsched] = num_new
    lp.nsched[0] = nsched + 1
    lp.budget[0] -= num_new


@nb.njit(cache=True)
def _next_event(now, rq, ads, pool, hist, lp):
    """Nothing runnable: the time of the next arrival or of the next adapter or history copy to land
    (inf: none)."""
    n = rq.arrival.shape[0]
    t_next = rq.arrival[lp.next_arr[0]] if lp.next_arr[0] < n else np.inf
    for a in range(ads.state.shape[0]):
        if ads.state[a] == AD_LOADING:
            t_next = min(t_next, ads.ready[a])
    if hist.on:
        for c in range(hist.state.shape[0]):
            hx.settle(c, now, hist, pool)
            if hist.state[c] == hx.H_LOADING:
                t_next = min(t_next, hist.ready[c])
    return t_next


@nb.njit(cache=True)
def _step_cost(now, step, srv, rq, ads, pool, hist, lp, stats):
    """The step's duration (s): the profile's model, inline loads, CPU-assisted LoRA of adapters still
    being copied (Toppings), scheduler overhead. Updates the recent batch size and step time, and the
    time integrals of the pool's use."""
    nsched = lp.nsched[0]
    n_tokens, n_decode, n_batch_ads = batch_shape(lp.sched_req, lp.sched_tok, nsched, rq.computed, rq.ntok, rq.in_len,
                                                  rq.adapter, lp.batch_stamp, lp.batch_ads, step)
    b = float(nsched)
    prompt_tokens = float(n_tokens - n_decode)
    ms = step_ms(srv.lat, b, prompt_tokens, n_batch_ads)
    cpu_extra = _cpu_assist_ms(now, ms, n_batch_ads, rq, ads, lp)
    if cpu_extra >= 0:
        ms += cpu_extra + srv.fp[P_CPU_SYNC_MS]
        stats[S_CPU_STEPS] += 1
    ms += scheduler_ms(srv.sched, lp.nrun[0], lp.n_waiting[0], srv.a_max)
    dt = (ms + lp.inline_ms[0]) / 1000.0
    stats[S_STALL_S] += lp.inline_ms[0] / 1000.0
    lp.busy_s[0] += dt
    k_bs = np.exp(-dt / srv.fp[P_BATCH_WINDOW_S])
    ads.bs_avg[0] = ads.bs_avg[0] * k_bs + b * (1.0 - k_bs)
    lp.step_avg_s[0] = lp.step_avg_s[0] * k_bs + dt * (1.0 - k_bs)
    stats[S_PREFILL_TOKENS] += prompt_tokens
    if hist.on:
        invalid = 0
        for a in range(ads.state.shape[0]):
            if ads.state[a] == AD_HOST:
                invalid += hist.ad_idle_blocks[a]
        stats[S_INVALID_BLOCK_S] += invalid * dt
        stats[S_USED_BLOCK_S] += (srv.pool_blocks - pool.free[0]) * dt
    return dt


@nb.njit(cache=True)
def _cpu_assist_ms(now, ms, n_batch_ads, rq, ads, lp):
    """Toppings: the not-yet-copied share of a loading adapter's layers runs on CPU cores, overlapped
    with the GPU's ``ms`` of base-model work; the step waits for the slower side. Returns the extra
    ms (-1: no adapter of the batch is loading). Stamps the batch's adapters as used."""
    for j in range(n_batch_ads):
        lp.ad_prompt_tok[lp.batch_ads[j]] = 0.0
    for j in range(lp.nsched[0]):
        lp.ad_prompt_tok[rq.adapter[lp.sched_req[j]]] += lp.sched_tok[j]
    cpu_extra = -1.0
    for j in range(n_batch_ads):
        a = lp.batch_ads[j]
        ads.last_used[a] = now
        if ads.state[a] == AD_LOADING and ads.ready[a] > now:
            left = min(1.0, (ads.ready[a] - now) / max(ads.load_ms[a] / 1000.0, 1e-12))
            cpu_ms = lp.ad_prompt_tok[a] * ads.cpu_ms_per_token[a] * left
            cpu_extra = max(cpu_extra, max(0.0, cpu_ms - ms))
    return cpu_extra


@nb.njit(cache=True)
def _apply_output(now, t_end, n_sched_running, n_kept, srv, rq, ads, pool, qs, hist, lp, out):
    """Record the step and apply its output: computed and sampled tokens; finished requests free their
    KV (or leave it as history), their quota and, under discard-after-use, their idle adapter."""
    nsched = lp.nsched[0]
    if srv.trace_cap > 0:
        out.tr_i[0] = trace_scheduled(out.trace, srv.trace_cap, out.tr_i[0], now, lp.sched_req, lp.sched_tok, nsched,
                                      n_sched_running)
    n_done, tr_i, step_bin = apply_step_output(lp.sched_req, lp.sched_tok, nsched, now, t_end, rq.computed, rq.ntok,
                                               rq.first_tok, rq.last_tok, out.itl_hist, srv.itl_edges, out.step_bin[0],
                                               0, rq.done_at, rq.state, rq.finish, lp.done_j, out.trace, srv.trace_cap,
                                               out.tr_i[0])
    out.tr_i[0] = tr_i
    out.step_bin[0] = step_bin
    if n_done > 0:
        for f in range(n_done):
            _finish(lp.sched_req[lp.done_j[f]], t_end, srv, rq, ads, pool, qs, hist, lp)
        lp.nrun[0] = drop_finished(lp.running, lp.nrun[0], lp.done_j, n_done, n_sched_running, n_kept)


@nb.njit(cache=True)
def _finish(r, t_end, srv, rq, ads, pool, qs, hist, lp):
    """Finished request ``r`` gives back its KV (a conversation's turn keeps it as history), its quota
    and its adapter's use; S-LoRA's discard-after-use sends an adapter nobody wants to the host."""
    a = rq.adapter[r]
    c = rq.conv[r]
    if c >= 0 and hist.on:
        hist.pending[c] -= 1
        hx.keep(r, c, t_end, hist, rq.blocks, rq.computed, pool)
    else:
        pool.free[0] += rq.blocks[r]
        rq.blocks[r] = 0
    ads.rc[a] -= 1
    _release_claims(r, qs)
    if ads.rc[a] == 0:
        lp.n_distinct[0] -= 1
        if srv.cache == CACHE_DISCARD and ads.qc[a] == 0 and ads.blocks[a] > 0 and hist.ad_entries[a] == 0:
            ads.state[a] = AD_HOST  # S-LoRA: an adapter no request uses leaves the GPU
            pool.free[0] += ads.blocks[a]
            pool.resident[0] -= 1


@nb.njit(cache=True)
def simulate_policy_core(requests, adapters, server, history):
    """Run the server on requests ``requests`` (:func:`new_requests`) and adapters ``adapters``
    (:func:`new_adapters`) with settings ``server`` and the history KV ``history``
    (``history.history_state``). Returns the stock loop's outputs (``twin.core.simulate_core``) and
    the policy statistics (S_*)."""
    rq, ads, srv, hist = new_record(requests), new_record(adapters), new_record(server), new_record(history)
    pool = _new_pool(srv, ads)
    qs = _new_queues(srv, ads, rq.arrival.shape[0])
    lp, out = _new_loop(srv, rq, ads)
    n = rq.arrival.shape[0]
    now = 0.0
    step = 0
    while True:
        _arrive(now, srv, rq, ads, pool, qs, hist, lp, out.stats)
        _sample(now, srv, pool, lp, out)
        if now >= srv.duration:
            break
        if srv.scheduler == SCHED_MLQ and now >= qs.next_refresh[0]:
            _refresh_queues(now, srv, rq, qs, lp, out.stats)
        if srv.cache == CACHE_ELORA and now >= lp.next_swap[0]:
            _swap_in_idle(now, srv, ads, pool, hist, lp, out.stats)
        if lp.nrun[0] == 0 and lp.n_waiting[0] == 0:
            if lp.next_arr[0] >= n:
                break
            # An idle ELORA server still runs its swapper every period.
            t_arr = rq.arrival[lp.next_arr[0]]
            now = min(t_arr, lp.next_swap[0]) if srv.cache == CACHE_ELORA else t_arr
            continue
        _squash_bypassers(now, srv, rq, ads, pool, qs, hist, lp, out)
        preempted = _schedule_running(now, srv, rq, ads, pool, qs, hist, lp, out)
        n_sched_running, n_kept = lp.nsched[0], lp.nrun[0]
        if not preempted:
            _admit_waiting(now, srv, rq, ads, pool, qs, hist, lp, out)
        if lp.nsched[0] == 0:
            t_next = _next_event(now, rq, ads, pool, hist, lp)
            if t_next == np.inf:
                break
            now = max(now, t_next)
            continue
        t_end = now + _step_cost(now, step, srv, rq, ads, pool, hist, lp, out.stats)
        _apply_output(now, t_end, n_sched_running, n_kept, srv, rq, ads, pool, qs, hist, lp, out)
        now = t_end
        step += 1

    counters = np.array([lp.preemptions[0], int(out.stats[S_LOADS]), lp.rejected[0], step, out.ts_i[0], out.tr_i[0]],
                        np.int64)
    result = (rq.state, rq.first_tok, rq.finish, out.itl_hist, counters, lp.busy_s[0], out.ts[:out.ts_i[0]],
              out.trace[:out.tr_i[0]], out.stats)
    free_records((rq, ads, srv, hist, pool, qs, lp, out))
    return result
