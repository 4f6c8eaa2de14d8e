"""The numba-compiled event loop: one vLLM V1 engine, step by step.

vLLM V1 has no prefill/decode phases: each request has ``num_tokens`` known tokens (prompt + what
it generated) and ``computed`` tokens whose KV exists; a step gives each scheduled request
``min(num_tokens - computed, budget)`` tokens from a shared per-step budget, and a request whose
computed tokens catch up with its known tokens samples one new token. One ``schedule()`` is:

1. RUNNING loop, in admission order: allocate the blocks the new tokens need; when blocks run out,
   preempt the newest running request (free its blocks, ``computed = 0``, put it at the FRONT of
   the waiting queue) until the allocation fits or the request preempted itself.
2. WAITING loop, only if nothing was preempted: in queue order, admit while the budget lasts; a
   request whose adapter is not among the running requests' adapters when those already number
   ``max_loras`` is skipped and the scan goes on; a request whose blocks do not fit stops the scan.

The waiting queue (``twin.stock_queue``) gives the next request to admit in O(1) amortised, or
O(log adapters) once the LoRA set is full, without scanning the queue; skipped requests never move, so
the admission order is exactly vLLM's.

GPU adapter slots are an LRU of ``a_max`` entries, touched every step by every adapter in the
batch; a miss pays the adapter's load latency inside the step (serially, as vLLM loads inline).

Fast steps (:mod:`twin.steady_decode`): while every running request is scheduled in full (the last one
possibly cut by the budget) and granted its blocks, the requests that only decode advance implicitly, so a
step costs O(requests that arrive, prefill or finish) rather than O(batch) (2.4x on a light simulated hour).
A step where that does not hold runs the explicit RUNNING and WAITING loops; after it the loop waits 1, 2,
4 ... 64 explicit steps before trying again, so deep overload pays next to nothing for the check. A trace
keeps the loop explicit. Results are identical either way (tests/test_twin_steady_decode.py).

Phases. :func:`simulate_core` allocates the loop's state, grouped as named tuples of arrays (:class:`Engine`,
:class:`Requests`, ``stock_queue.Queues``, :class:`Slots`, :class:`Batch`, :class:`Steady`), and hands it to
:func:`run_loop`, a sequence of phase functions (arrivals, RUNNING loop, WAITING loop, adapter loads, step
output, fast-step bookkeeping); a phase takes the tuples and the scalars it reads and returns the scalars it
changes. ``run_loop`` is compiled without numba's reference counting (``_nrt=False``: it allocates nothing)
and the phases are inlined into it (``inline="always"``), so it compiles to the code of one function: a
phase costs no call and no atomic reference-count update (inlined into a counting function, each of its
array variables would cost one per use, which once took half the loop's time). Keep both: a phase called
instead of inlined passes each array as seven machine words per call (a split into called phases once cost
41-49 % more instructions; ``benchmarks/speed/twin_speed.py``). ``run_loop.inspect_llvm()`` should call no
``NRT_`` function. Helpers that allocate or that both engine loops call
with their own state (``apply_step_output``, ``twin.steady_decode``) stay plain functions. numba's on-disk
cache of ``run_loop`` holds the inlined phases and the functions it calls compiled in, and is keyed on
twin/core.py only: after editing ``twin.stock_queue`` or ``twin.steady_decode``, touch core.py.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numba as nb
import numpy as np

from twin.states import FINISHED, REJECTED, RUNNING, WAITING
from twin.steady_decode import block_phase, compact_running, finish_calendar, finishing, make_steady, materialize
from twin.stock_queue import INF_KEY, arrive, next_adapter, pop_head, requeue, tree_update, waiting_queues

# Trace event kinds (scheduler-fidelity tests).
EV_SCHEDULED, EV_ADMITTED, EV_PREEMPTED, EV_FINISHED = 0, 1, 2, 3

# ITL histogram: log-spaced bins from 1e-2 ms to 1e7 ms.
ITL_HIST_LO, ITL_HIST_BINS_PER_DECADE, ITL_HIST_DECADES = -2.0, 100, 9


@nb.njit(cache=True)
def itl_bin_of(gap_s, n_hist):
    """The ITL histogram's bin of a gap of ``gap_s``: bin k >= 1 holds the gaps of
    [10^(LO + (k-1)/BPD), 10^(LO + k/BPD)) ms, bin 0 and bin ``n_hist + 1`` the gaps below and above."""
    x = np.log10(gap_s * 1000.0) if gap_s > 0 else ITL_HIST_LO - 1
    return min(max(int((x - ITL_HIST_LO) * ITL_HIST_BINS_PER_DECADE) + 1, 0), n_hist + 1)


@nb.njit(cache=True)
def itl_bin_edges(n_hist):
    """``edges[k]``: the shortest gap (s) :func:`itl_bin_of` puts in bin k or above (k >= 1; ``edges[0]`` is
    -inf), found by bisecting over the gaps' bit patterns (positive doubles order as their bits), so a
    search over the edges gives :func:`itl_bin_of`'s bins exactly without a logarithm per step."""
    edges = np.empty(n_hist + 2)
    edges[0] = -np.inf
    gap = np.empty(1)
    bits = gap.view(np.int64)
    gap[0] = 1e300  # far above the top bin
    top = bits[0]
    lo = 0  # the bits of 0.0: bin 0
    for k in range(1, n_hist + 2):
        hi = top  # itl_bin_of(lo) < k <= itl_bin_of(hi)
        while hi - lo > 1:
            bits[0] = lo + (hi - lo) // 2
            if itl_bin_of(gap[0], n_hist) >= k:
                hi = bits[0]
            else:
                lo = bits[0]
        bits[0] = hi
        edges[k] = gap[0]
    return edges


@functools.cache
def itl_edges() -> np.ndarray:
    """The ITL histogram's :func:`itl_bin_edges` (computed once per process, in about a millisecond)."""
    return itl_bin_edges(ITL_HIST_BINS_PER_DECADE * ITL_HIST_DECADES)


@nb.njit(cache=True)
def itl_bin(gap_s, edges, b):
    """The bin of ``gap_s`` (:func:`itl_bin_of`), walked to from bin ``b``: a step lasts about as long as the
    last one, so this takes a comparison or two where a logarithm took tens of nanoseconds."""
    top = edges.shape[0] - 1
    while b < top and gap_s >= edges[b + 1]:
        b += 1
    while b > 0 and gap_s < edges[b]:
        b -= 1
    return b


@nb.njit(cache=True)
def step_ms(lat, b, prompt_tokens, n_adapters):
    """Step latency (ms) of the profile's model (``StepLatency.as_array`` order) for a batch of ``b``
    requests, ``prompt_tokens`` prefill tokens and ``n_adapters`` distinct adapters."""
    ms = (lat[1] + lat[0] * b + lat[2] * prompt_tokens) * (lat[4] + lat[3] * n_adapters) / 100.0
    if n_adapters > 0:
        ms += lat[5] + lat[6] * b + lat[7] * n_adapters
    return ms


@nb.njit(cache=True, inline="always")
def _blocks_short(tokens, blocks, block_size):
    """The KV blocks a request holding ``blocks`` lacks for ``tokens`` computed tokens."""
    need = tokens - blocks * block_size
    return (need + block_size - 1) // block_size if need > 0 else 0


@nb.njit(cache=True)
def scheduler_ms(sched, n_running, n_waiting, a_max):
    """Scheduler overhead (ms) of one step."""
    us = sched[0] * n_running + sched[1] * n_waiting + sched[2] * n_waiting * a_max / sched[4] + sched[3]
    return us / 1000.0 if us > 0 else 0.0


@nb.njit(cache=True)
def request_state(in_len, out_len):
    """Per-request arrays both engine loops keep: state, computed tokens, tokens so far, KV blocks,
    first-token / finish / last-token times (-1: not yet), and the token count at which a request is done
    (prompt + output). A finished request's inter-token gaps sum to its finish minus first-token time, so
    they are not summed per token."""
    n = in_len.shape[0]
    return (np.zeros(n, np.int8), np.zeros(n, np.int32), in_len.astype(np.int32).copy(), np.zeros(n, np.int32),
            np.full(n, -1.0), np.full(n, -1.0), np.full(n, -1.0), (in_len + out_len).astype(np.int32))


@nb.njit(cache=True)
def step_buffers(n, max_num_seqs, max_batched, duration, ts_dt, trace_cap):
    """Scratch of one engine step (running list, scheduled requests and tokens, batch adapters, positions of
    finished requests) and the recorded outputs (ITL histogram, time series, event trace) of both engine loops."""
    running = np.zeros(max(1, min(n, max_num_seqs)), np.int64)
    sched_req = np.zeros(max_batched + max_num_seqs, np.int64)
    sched_tok = np.zeros(max_batched + max_num_seqs, np.int64)
    batch_ads = np.zeros(max_batched + max_num_seqs, np.int64)
    done_j = np.zeros(max_batched + max_num_seqs, np.int64)
    itl_hist = np.zeros(ITL_HIST_BINS_PER_DECADE * ITL_HIST_DECADES + 2, np.int64)
    ts = np.zeros((int(duration / ts_dt) + 2 if ts_dt > 0 else 0, 4))
    trace = np.zeros((trace_cap, 4), np.float64)
    return running, sched_req, sched_tok, batch_ads, done_j, itl_hist, ts, trace


@nb.njit(cache=True)
def trace_event(trace, trace_cap, tr_i, now, r, tokens, kind):
    """Append one event to the trace while it has room; returns the new trace length."""
    if tr_i < trace_cap:
        trace[tr_i, 0] = now
        trace[tr_i, 1] = r
        trace[tr_i, 2] = tokens
        trace[tr_i, 3] = kind
        tr_i += 1
    return tr_i


@nb.njit(cache=True)
def trace_scheduled(trace, trace_cap, tr_i, now, sched_req, sched_tok, nsched, n_sched_running):
    """Append the step's scheduled/admitted events to the trace; returns the new trace length."""
    for j in range(nsched):
        tr_i = trace_event(trace, trace_cap, tr_i, now, sched_req[j], sched_tok[j],
                           EV_SCHEDULED if j < n_sched_running else EV_ADMITTED)
    return tr_i


@nb.njit(cache=True, inline="always")
def batch_adapters(sched_req, nsched, adapter, batch_stamp, batch_ads, step):
    """List the distinct adapters of a step's batch in ``batch_ads``, stamping them with ``step`` in
    ``batch_stamp``; returns their number."""
    n_batch_ads = 0
    for j in range(nsched):
        a = adapter[sched_req[j]]
        if batch_stamp[a] != step:
            batch_stamp[a] = step
            batch_ads[n_batch_ads] = a
            n_batch_ads += 1
    return n_batch_ads


@nb.njit(cache=True, inline="always")
def batch_shape(sched_req, sched_tok, nsched, computed, ntok, in_len, adapter, batch_stamp, batch_ads, step):
    """(tokens, decode requests, distinct adapters) of a step's batch; the distinct adapters are listed
    in ``batch_ads`` (:func:`batch_adapters`)."""
    n_tokens = 0
    n_decode = 0
    for j in range(nsched):
        r = sched_req[j]
        n_tokens += sched_tok[j]
        if sched_tok[j] == 1 and computed[r] == ntok[r] - 1 and ntok[r] > in_len[r]:  # simulate_core's decode test
            n_decode += 1
    return n_tokens, n_decode, batch_adapters(sched_req, nsched, adapter, batch_stamp, batch_ads, step)


@nb.njit(cache=True)
def apply_step_output(sched_req, sched_tok, nsched, now, t_end, computed, ntok, first_tok, last_tok, itl_hist,
                      itl_edges, step_bin, n_implicit, done_at, state, finish, done_j, trace, trace_cap, tr_i):
    """Apply one step's output: computed tokens, sampled tokens (latencies, ITL histogram) and finished
    requests (marked FINISHED, their batch positions listed in ``done_j``, freed by the caller).
    ``n_implicit`` more tokens (the fast step's steady requests) follow one of the previous step. Every such
    gap is the step's length, binned once; ``step_bin``, the last step's bin, is where the search for a bin
    starts. Returns (number of finished requests, new trace length, this step's bin)."""
    n_done = 0
    n_step_gaps = n_implicit
    for j in range(nsched):
        r = sched_req[j]
        computed[r] += sched_tok[j]
        if computed[r] == ntok[r]:
            ntok[r] += 1
            prev = last_tok[r]
            if prev < 0:  # its first token (the first and last token times are set together)
                first_tok[r] = t_end
            elif prev == now:
                n_step_gaps += 1
            else:
                itl_hist[itl_bin(t_end - prev, itl_edges, step_bin)] += 1
            last_tok[r] = t_end
            if ntok[r] >= done_at[r]:
                state[r] = FINISHED
                finish[r] = t_end
                done_j[n_done] = j
                n_done += 1
                tr_i = trace_event(trace, trace_cap, tr_i, now, r, 0, EV_FINISHED)
    if n_step_gaps > 0:
        step_bin = itl_bin(t_end - now, itl_edges, step_bin)
        itl_hist[step_bin] += n_step_gaps
    return n_done, tr_i, step_bin


@nb.njit(cache=True)
def running_position(j, n_sched_running, n_kept):
    """Where the request scheduled ``j``-th in a step sits in the running list: the running loop schedules
    a prefix of it in order (``n_sched_running`` requests), admissions are appended after the ``n_kept``
    requests it kept."""
    return j if j < n_sched_running else n_kept + j - n_sched_running


@nb.njit(cache=True)
def drop_finished(running, nrun, done_j, n_done, n_sched_running, n_kept):
    """Close the gaps the step's finished requests (batch positions ``done_j``, from
    :func:`apply_step_output`) leave in the running list, keeping its order; returns its new length.
    Only the entries after the first finished one move, and no request's state is read."""
    k = running_position(done_j[0], n_sched_running, n_kept)
    for f in range(n_done):
        start = running_position(done_j[f], n_sched_running, n_kept) + 1
        end = running_position(done_j[f + 1], n_sched_running, n_kept) if f + 1 < n_done else nrun
        for q in range(start, end):
            running[k] = running[q]
            k += 1
    return k


@nb.njit(cache=True)
def group_by(keys, n_groups):
    """(starts, members): ``members[starts[g]:starts[g+1]]`` lists the positions holding key ``g`` in order,
    i.e. ``np.argsort(keys, kind="stable")`` for keys in ``[0, n_groups)`` as a counting sort (the
    per-adapter request lists of :func:`simulate_core`; a general sort of millions of requests costs
    as much as a tenth of a simulation)."""
    starts = np.zeros(n_groups + 1, np.int64)
    for i in range(keys.shape[0]):
        starts[keys[i] + 1] += 1
    for g in range(n_groups):
        starts[g + 1] += starts[g]
    fill = starts[:-1].copy()
    members = np.empty(keys.shape[0], np.int64)
    for i in range(keys.shape[0]):
        g = keys[i]
        members[fill[g]] = i
        fill[g] += 1
    return starts, members


class Engine(NamedTuple):
    """The server's settings, its step-cost model and what the run records (``simulate_core``'s arguments)."""

    duration: float
    a_max: int
    usable_blocks: int
    block_size: int
    max_batched: int
    max_num_seqs: int
    full_prompt_admission: bool
    lat: np.ndarray  # step latency terms (step_ms)
    sched: np.ndarray  # scheduler overhead terms (scheduler_ms)
    max_in_flight: int  # client-side cap on requests in flight (0 = none)
    ts_dt: float  # time-series sampling period, s (0 = off)
    trace_cap: int  # capacity of the step-event trace (0 = off)
    itl_edges: np.ndarray  # the ITL histogram's bin edges (itl_bin_edges)


class Requests(NamedTuple):
    """Per-request inputs and state, in arrival order (``request_state``)."""

    arrival: np.ndarray
    adapter: np.ndarray  # uint64 adapter ids
    in_len: np.ndarray
    out_len: np.ndarray
    state: np.ndarray
    computed: np.ndarray  # tokens whose KV exists
    ntok: np.ndarray  # known tokens (prompt + sampled)
    blocks: np.ndarray  # KV blocks held
    first_tok: np.ndarray
    finish: np.ndarray
    last_tok: np.ndarray
    done_at: np.ndarray  # the token count at which it finishes


class Slots(NamedTuple):
    """The GPU's adapter slots (an LRU of ``a_max``) and the adapter's load latency (ms)."""

    resident: np.ndarray
    last_used: np.ndarray  # the step it was last in a batch
    batch_stamp: np.ndarray  # the step it was last listed in ``Batch.batch_ads``
    load_ms: np.ndarray


class Batch(NamedTuple):
    """The running list (admission order) and one step's schedule."""

    running: np.ndarray  # uint64
    sched_req: np.ndarray  # uint64: the scheduled requests, running ones first
    sched_tok: np.ndarray  # ... and the tokens each computes
    batch_ads: np.ndarray  # the step's adapters (while lazy: those that may miss)
    done_j: np.ndarray  # positions in sched_req of the requests that finished in the step


class Steady(NamedTuple):
    """Steady decoders held implicitly (``twin.steady_decode``) and the explicit ones beside them."""

    steady: np.ndarray
    g0: np.ndarray  # the fast step each was made steady at (int32)
    cnt: np.ndarray  # steady requests per block phase
    cal: np.ndarray  # finish calendar: steady requests by the fast step they finish at
    fin_next: np.ndarray  # next request in its calendar bucket (int32)
    xlist: np.ndarray  # the explicit running requests, in running order (uint64)


@nb.njit(cache=True)
def simulate_core(
    arrival, adapter, in_len, out_len,  # requests, sorted by arrival
    ad_start, ad_list,  # per-adapter request lists (CSR, arrival order)
    ad_load_ms,  # per-adapter CPU->GPU load latency (ms)
    duration, a_max, usable_blocks, block_size, max_batched, max_num_seqs,
    full_prompt_admission,
    lat,  # k4, k5, kp, k6, k7, l0, l1, l2[, arrival delay: not read here] (see twin.profile.StepLatency)
    sched,  # k1, k2, k3, intercept (µs), n_served
    max_in_flight,  # client-side cap on requests in flight (0 = none)
    ts_dt,  # time-series sampling period, s (0 = off)
    trace_cap,  # capacity of the step-event trace (0 = off)
    itl_edges,  # the ITL histogram's bin edges (itl_bin_edges)
):
    """Run one server: allocate the loop's state, run :func:`run_loop`, return what it recorded."""
    n = arrival.shape[0]
    na = ad_start.shape[0] - 1
    state, computed, ntok, blocks, first_tok, finish, last_tok, done_at = request_state(in_len, out_len)
    rq = Requests(arrival, adapter, in_len, out_len, state, computed, ntok, blocks, first_tok, finish, last_tok,
                  done_at)
    resident = np.zeros(na, np.bool_)
    resident[:min(a_max, na)] = True  # static adapters are activated at start-up
    slots = Slots(resident, np.full(na, -1, np.int64), np.full(na, -1, np.int64), ad_load_ms)
    running, sched_req, sched_tok, batch_ads, done_j, itl_hist, ts, trace = step_buffers(
        n, max_num_seqs, max_batched, duration, ts_dt, trace_cap)
    # Unsigned request indices (and adapter ids, see simulate()) spare numba's negative-index wraparound
    # on each of the many per-request array accesses of a step: about 1.3x on the whole loop.
    bt = Batch(running.view(np.uint64), sched_req.view(np.uint64), sched_tok, batch_ads, done_j)
    sd = Steady(np.zeros(n, np.bool_), np.zeros(n, np.int32), np.zeros(block_size, np.int64),
                finish_calendar(out_len), np.empty(n, np.int32), np.zeros(running.shape[0], np.int64).view(np.uint64))
    eng = Engine(duration, a_max, usable_blocks, block_size, max_batched, max_num_seqs, full_prompt_admission, lat,
                 sched, max_in_flight, ts_dt, trace_cap, itl_edges)
    preemptions, loads, rejected, step, ts_i, tr_i, g, busy_s = run_loop(
        eng, rq, waiting_queues(ad_start, ad_list, n), slots, bt, sd, itl_hist, ts, trace)
    counters = np.array([preemptions, loads, rejected, step, ts_i, tr_i, g], np.int64)
    return (state, first_tok, finish, itl_hist, counters, busy_s, ts[:ts_i], trace[:tr_i])


@nb.njit(cache=True, _nrt=False)
def run_loop(eng, rq, qs, slots, bt, sd, itl_hist, ts, trace):
    """The engine loop, one step per turn: arrivals, RUNNING loop, WAITING loop, step cost, step output.
    Returns the counters (preemptions, adapter loads, rejected requests, steps, time-series samples, trace
    events, fast steps) and the busy time (s)."""
    n = rq.arrival.shape[0]
    block_size = eng.block_size
    nrun = 0
    n_waiting = 0
    n_distinct = 0  # adapters with running requests
    free_blocks = eng.usable_blocks
    front = 0  # preemptions so far: the next preempted request's key is -front
    next_arr = 0
    now = 0.0
    step = 0
    preemptions = 0
    loads = 0
    rejected = 0
    busy_s = 0.0
    n_stale = 0
    n_pre = 0
    first_wait = 0  # the first arrival that may still be waiting (only moves forward)
    n_resident = min(eng.a_max, slots.resident.shape[0])
    ts_i = 0
    next_ts = 0.0
    tr_i = 0

    # Fast steps (twin.steady_decode) while ``lazy``.
    epoch = 0  # lazy spells so far: the calendar's entries of earlier ones are stale
    nx = 0
    n_steady = 0
    g = 0  # fast steps so far
    fast_ran = False  # a fast step ran since the requests were last made steady
    rlen = 0  # running-list length while lazy (finished requests stay in it until compacted)
    lazy = False
    step_bin = 0  # the ITL bin of the last step's length
    slow_left = 0  # explicit steps to run before trying fast ones again
    backoff = 1

    while True:
        next_arr, n_waiting, rejected, n_stale = arrive(now, qs, rq.arrival, rq.adapter, rq.state, next_arr, nrun,
                                                        eng.max_in_flight, n_waiting, rejected, n_stale)
        ts_i, next_ts = sample_series(ts, ts_i, next_ts, eng.ts_dt, now, nrun, n_waiting, eng.usable_blocks,
                                      free_blocks)
        if now >= eng.duration:
            break
        if nrun == 0 and n_waiting == 0:
            if next_arr >= n:
                break
            now = rq.arrival[next_arr]
            continue

        if lazy:
            demand, need_blocks, cut = fast_step_demand(eng, rq, bt, sd, g, nx, n_steady, rlen)
            if demand > eng.max_batched or need_blocks > free_blocks:  # explicit steps again, for a while
                rlen = materialize(bt.running, rlen, rq.state, sd.steady, sd.g0, g, rq.computed, rq.ntok, rq.blocks,
                                   rq.last_tok, now, block_size, rq.adapter, slots.last_used, fast_ran, step)
                n_steady = 0
                sd.cnt.fill(0)
                epoch += 1
                nx = 0
                lazy = False
                slow_left = backoff
                backoff = min(2 * backoff, 64)

        # 1. RUNNING loop.
        budget = eng.max_batched
        if lazy:
            budget -= demand
            free_blocks -= need_blocks
            nsched, n_decode, n_batch_ads = schedule_fast(rq, slots, bt, sd, nx, n_steady, cut, step, block_size)
            preempted_now = False
        else:
            (nsched, budget, n_decode, n_batch_ads, preempted_now, nrun, free_blocks, n_waiting, n_distinct, front,
             n_pre, preemptions, tr_i) = schedule_running(eng, rq, qs, slots, bt, trace, now, step, nrun, budget,
                                                          free_blocks, n_waiting, n_distinct, front, n_pre,
                                                          preemptions, tr_i)
        n_sched_running = nsched
        n_kept = nrun

        # 2. WAITING loop (skipped in a step that preempted).
        if not preempted_now:
            (nsched, budget, nrun, rlen, n_waiting, n_distinct, free_blocks, rejected, n_batch_ads, n_stale, n_pre,
             first_wait) = schedule_waiting(eng, rq, qs, slots, bt, lazy, step, next_arr, nsched, budget, nrun, rlen,
                                            n_waiting, n_distinct, free_blocks, rejected, n_batch_ads, n_stale, n_pre,
                                            first_wait)

        if nsched + n_steady == 0:
            # Nothing runnable now (e.g. only a rejected head): wait for the next arrival.
            if next_arr >= n:
                break
            now = max(now, rq.arrival[next_arr])
            continue

        # 3. Step cost: batch shape, adapter loads, scheduler overhead.
        n_tokens = eng.max_batched - budget
        load_ms, n_resident, loads = load_adapters(slots, bt, qs.run_count, n_batch_ads, lazy, step, eng.a_max,
                                                   n_resident, loads)
        n_step_ads = n_distinct if lazy else n_batch_ads
        b = float(nsched + n_steady)
        prompt_tokens = float(n_tokens - n_decode)
        ms = step_ms(eng.lat, b, prompt_tokens, n_step_ads) + scheduler_ms(eng.sched, nrun, n_waiting, eng.a_max)
        dt = (ms + load_ms) / 1000.0
        t_end = now + dt
        busy_s += dt
        if eng.trace_cap > 0:
            tr_i = trace_scheduled(trace, eng.trace_cap, tr_i, now, bt.sched_req, bt.sched_tok, nsched,
                                   n_sched_running)

        # 4. The step's output: computed tokens, sampled tokens, finished requests (their blocks freed).
        n_done, tr_i, step_bin = apply_step_output(bt.sched_req, bt.sched_tok, nsched, now, t_end, rq.computed,
                                                   rq.ntok, rq.first_tok, rq.last_tok, itl_hist, eng.itl_edges,
                                                   step_bin, n_steady, rq.done_at, rq.state, rq.finish, bt.done_j,
                                                   trace, eng.trace_cap, tr_i)
        if lazy:
            n_steady, free_blocks, nrun, n_distinct = finish_steady(rq, qs, slots, sd, g, epoch, t_end, step,
                                                                    block_size, n_steady, free_blocks, nrun,
                                                                    n_distinct)
        free_blocks, n_distinct = free_finished(rq, qs, slots, bt, n_done, lazy, step, free_blocks, n_distinct)

        # 5. Fast steps: after one, the explicit requests that sampled become steady; after an explicit step,
        # try fast ones (unless backing off or tracing).
        if lazy:
            nrun -= n_done
            n_steady, nx = split_steady(rq, sd, bt.sched_req, nsched, g + 1, t_end, epoch, block_size, n_steady)
            g += 1
            fast_ran = True
            backoff = 1
        else:
            if n_done > 0:
                nrun = drop_finished(bt.running, nrun, bt.done_j, n_done, n_sched_running, n_kept)
            if eng.trace_cap == 0:
                if slow_left > 0:
                    slow_left -= 1
                else:
                    n_steady, nx = split_steady(rq, sd, bt.running, nrun, g, t_end, epoch, block_size, n_steady)
                    rlen = nrun
                    fast_ran = False
                    lazy = True
        now = t_end
        step += 1

    return preemptions, loads, rejected, step, ts_i, tr_i, g, busy_s


@nb.njit(cache=True, inline="always")
def sample_series(ts, ts_i, next_ts, ts_dt, now, nrun, n_waiting, total_blocks, free_blocks):
    """Time-series samples (running, waiting, share of blocks in use) up to ``now``; returns the next sample's
    row and time. Both engine loops' sampling."""
    while ts_dt > 0 and next_ts <= now and ts_i < ts.shape[0]:
        ts[ts_i, 0] = next_ts
        ts[ts_i, 1] = nrun
        ts[ts_i, 2] = n_waiting
        ts[ts_i, 3] = (total_blocks - free_blocks) / total_blocks
        ts_i += 1
        next_ts += ts_dt
    return ts_i, next_ts


@nb.njit(cache=True, inline="always")
def fast_step_demand(eng, rq, bt, sd, g, nx, n_steady, rlen):
    """A fast step's token and block demand, and the tokens the budget leaves the last running request when it
    cuts that request's prefill (0: none cut). A fast step needs every running request scheduled in full,
    except that the budget may cut the last one in running order (as the explicit loop would: all before it
    fit), and every block granted."""
    block_size = eng.block_size
    demand = n_steady
    need_blocks = sd.cnt[g % block_size]
    for q in range(nx):
        r = sd.xlist[q]
        num_new = rq.ntok[r] - rq.computed[r]
        demand += num_new
        need = rq.computed[r] + num_new - rq.blocks[r] * block_size
        if need > 0:
            need_blocks += (need + block_size - 1) // block_size
    cut = 0
    if demand > eng.max_batched and nx > 0:
        r = sd.xlist[nx - 1]
        rest = rq.ntok[r] - rq.computed[r]
        last = rlen - 1
        while last > 0 and rq.state[bt.running[last]] != RUNNING:  # finished requests wait to be compacted
            last -= 1
        if demand - rest < eng.max_batched and bt.running[last] == r:
            cut = eng.max_batched - (demand - rest)
            demand = eng.max_batched
            need_blocks += (_blocks_short(rq.computed[r] + cut, rq.blocks[r], block_size)
                            - _blocks_short(rq.computed[r] + rest, rq.blocks[r], block_size))
    return demand, need_blocks, cut


@nb.njit(cache=True, inline="always")
def schedule_fast(rq, slots, bt, sd, nx, n_steady, cut, step, block_size):
    """A fast step's RUNNING loop: steady requests take one token each, implicitly; the explicit ones are
    scheduled in full (the last one ``cut`` when the budget cuts it), their blocks granted. Returns the
    scheduled count, the decodes and the listed adapters (only those that may miss: steady ones stay loaded).

    Decodes (one token past the prompt, nothing to recompute) are counted in the RUNNING loops: an admitted
    request never decodes, as it is new (prompts have >= 1 token: twin.workload's draw_requests and
    trace_requests ensure it) or was preempted (computed 0)."""
    nsched = 0
    n_decode = n_steady
    n_batch_ads = 0
    for q in range(nx):
        r = sd.xlist[q]
        num_new = cut if cut > 0 and q == nx - 1 else rq.ntok[r] - rq.computed[r]
        need = rq.computed[r] + num_new - rq.blocks[r] * block_size
        if need > 0:
            rq.blocks[r] += (need + block_size - 1) // block_size
        if num_new == 1 and rq.computed[r] == rq.ntok[r] - 1 and rq.ntok[r] > rq.in_len[r]:
            n_decode += 1
        bt.sched_req[nsched] = r
        bt.sched_tok[nsched] = num_new
        nsched += 1
        a = rq.adapter[r]
        if not slots.resident[a] and slots.batch_stamp[a] != step:
            slots.batch_stamp[a] = step
            bt.batch_ads[n_batch_ads] = a
            n_batch_ads += 1
    return nsched, n_decode, n_batch_ads


@nb.njit(cache=True, inline="always")
def schedule_running(eng, rq, qs, slots, bt, trace, now, step, nrun, budget, free_blocks, n_waiting, n_distinct,
                     front, n_pre, preemptions, tr_i):
    """vLLM's RUNNING loop: in admission order, each running request gets the tokens it has left (within the
    budget) and the blocks they need; when blocks run out, the newest running request is preempted (its
    blocks freed, ``computed = 0``, to the front of the queue) until they fit or the request preempted
    itself, which ends the loop."""
    block_size = eng.block_size
    nsched = 0
    n_decode = 0
    n_batch_ads = 0
    preempted_now = False
    i = 0
    while i < nrun and budget > 0:
        r = bt.running[i]
        num_new = min(rq.ntok[r] - rq.computed[r], budget)
        # New blocks: ceil((computed + num_new) / block_size) - blocks, divided only past the last block.
        need = rq.computed[r] + num_new - rq.blocks[r] * block_size
        need = (need + block_size - 1) // block_size if need > 0 else 0
        scheduled = True
        while need > free_blocks:
            v = bt.running[nrun - 1]
            nrun -= 1
            free_blocks += rq.blocks[v]
            rq.blocks[v] = 0
            rq.computed[v] = 0
            rq.state[v] = WAITING
            n_waiting += 1
            preemptions += 1
            front += 1
            n_pre, stopped = requeue(qs, v, rq.adapter[v], front, n_pre, rq.state)
            if stopped:
                n_distinct -= 1
            preempted_now = True
            tr_i = trace_event(trace, eng.trace_cap, tr_i, now, v, 0, EV_PREEMPTED)
            if v == r:
                scheduled = False
                break
        if not scheduled:
            break
        if need > 0:
            rq.blocks[r] += need
            free_blocks -= need
        # The decode test is written out: as an inlined helper it halved the loop's speed.
        if num_new == 1 and rq.computed[r] == rq.ntok[r] - 1 and rq.ntok[r] > rq.in_len[r]:
            n_decode += 1
        bt.sched_req[nsched] = r
        bt.sched_tok[nsched] = num_new
        nsched += 1
        budget -= num_new
        i += 1
        a = rq.adapter[r]
        if slots.batch_stamp[a] != step:
            slots.batch_stamp[a] = step
            bt.batch_ads[n_batch_ads] = a
            n_batch_ads += 1
    return (nsched, budget, n_decode, n_batch_ads, preempted_now, nrun, free_blocks, n_waiting, n_distinct, front,
            n_pre, preemptions, tr_i)


@nb.njit(cache=True, inline="always")
def schedule_waiting(eng, rq, qs, slots, bt, lazy, step, next_arr, nsched, budget, nrun, rlen, n_waiting,
                     n_distinct, free_blocks, rejected, n_batch_ads, n_stale, n_pre, first_wait):
    """vLLM's WAITING loop: admit in queue order (``twin.stock_queue``) while budget, sequences and blocks last; a
    request of an adapter beyond the ``max_loras`` running ones is skipped; one whose blocks do not fit stops
    the scan (and is rejected when nothing runs: it would never fit)."""
    block_size = eng.block_size
    while budget > 0 and n_waiting > 0 and nrun < eng.max_num_seqs:
        a, n_pre, first_wait, n_stale = next_adapter(qs, rq.state, rq.adapter, n_distinct >= eng.a_max, n_pre,
                                                     first_wait, next_arr, n_stale)
        if a < 0:
            break
        from_stack = qs.stack_top[a] >= 0
        r = qs.stack_top[a] if from_stack else qs.ad_list[qs.arr_ptr[a]]
        num_new = min(rq.ntok[r] - rq.computed[r], budget)
        need = (num_new + block_size - 1) // block_size
        check = (rq.ntok[r] + block_size - 1) // block_size if eng.full_prompt_admission else need
        if check > free_blocks:
            if nrun == 0 and nsched == 0:
                # Can never fit, even into an empty cache: vLLM would reject it up front.
                rq.state[r] = REJECTED
                rejected += 1
            else:
                break
        else:
            rq.blocks[r] = need
            free_blocks -= need
            rq.state[r] = RUNNING
            if lazy:
                if rlen == bt.running.shape[0]:
                    rlen = compact_running(bt.running, rlen, rq.state)
                bt.running[rlen] = r
                rlen += 1
            else:
                bt.running[nrun] = r
            nrun += 1
            if qs.run_count[a] == 0:
                n_distinct += 1
            qs.run_count[a] += 1
            bt.sched_req[nsched] = r
            bt.sched_tok[nsched] = num_new
            nsched += 1
            budget -= num_new
            if slots.batch_stamp[a] != step and not (lazy and slots.resident[a]):
                slots.batch_stamp[a] = step
                bt.batch_ads[n_batch_ads] = a
                n_batch_ads += 1
        n_waiting -= 1
        n_stale = pop_head(qs, a, from_stack, r, n_stale)
    return (nsched, budget, nrun, rlen, n_waiting, n_distinct, free_blocks, rejected, n_batch_ads, n_stale, n_pre,
            first_wait)


@nb.njit(cache=True, inline="always")
def load_adapters(slots, bt, run_count, n_batch_ads, lazy, step, a_max, n_resident, loads):
    """The step's adapters into the GPU's slots: a miss evicts the least recently used adapter not in the batch
    and pays its load latency inside the step (vLLM loads inline). While lazy, ``batch_ads`` lists only the
    adapters that may miss; the batch is every adapter with running requests, whose LRU stamps are written
    when they stop running (or by ``materialize``). Returns the load time (ms), resident count and loads."""
    load_ms = 0.0
    for j in range(n_batch_ads):
        a = bt.batch_ads[j]
        if not slots.resident[a]:
            if n_resident >= a_max:
                victim = -1
                for c in range(slots.resident.shape[0]):
                    if (slots.resident[c] and (run_count[c] == 0 if lazy else slots.batch_stamp[c] != step)
                            and (victim < 0 or slots.last_used[c] < slots.last_used[victim])):
                        victim = c
                slots.resident[victim] = False
                n_resident -= 1
            slots.resident[a] = True
            n_resident += 1
            load_ms += slots.load_ms[a]
            loads += 1
        slots.last_used[a] = step
    return load_ms, n_resident, loads


@nb.njit(cache=True, inline="always")
def stop_running(qs, slots, a, stamp, step, n_distinct):
    """A request of adapter ``a`` stopped running: the adapter leaves the LoRA set with its last one (its LRU
    stamp written when ``stamp``). Returns the running adapters' count."""
    qs.run_count[a] -= 1
    if qs.run_count[a] == 0:
        n_distinct -= 1
        tree_update(qs, a, INF_KEY)
        if stamp:
            slots.last_used[a] = step
    return n_distinct


@nb.njit(cache=True, inline="always")
def finish_steady(rq, qs, slots, sd, g, epoch, t_end, step, block_size, n_steady, free_blocks, nrun, n_distinct):
    """Steady requests that sampled their last token in fast step ``g`` finish: their state written out, their
    blocks freed."""
    r = finishing(sd.cal, g, epoch)
    while r >= 0:
        sd.cnt[block_phase(sd.g0[r], rq.computed[r], block_size)] -= 1  # computed: still its value when made steady
        c = rq.done_at[r] - 1
        sd.steady[r] = False
        n_steady -= 1
        rq.computed[r] = c
        rq.ntok[r] = rq.done_at[r]
        rq.last_tok[r] = t_end
        rq.state[r] = FINISHED
        rq.finish[r] = t_end
        free_blocks += (c + block_size - 1) // block_size
        rq.blocks[r] = 0
        nrun -= 1
        n_distinct = stop_running(qs, slots, rq.adapter[r], True, step, n_distinct)
        r = sd.fin_next[r]
    return n_steady, free_blocks, nrun, n_distinct


@nb.njit(cache=True, inline="always")
def free_finished(rq, qs, slots, bt, n_done, lazy, step, free_blocks, n_distinct):
    """The scheduled requests that finished in the step free their blocks."""
    for f in range(n_done):
        r = bt.sched_req[bt.done_j[f]]
        free_blocks += rq.blocks[r]
        rq.blocks[r] = 0
        n_distinct = stop_running(qs, slots, rq.adapter[r], lazy, step, n_distinct)
    return free_blocks, n_distinct


@nb.njit(cache=True, inline="always")
def split_steady(rq, sd, reqs, count, g_first, t_end, epoch, block_size, n_steady):
    """Of the running requests in ``reqs[:count]``, those that sampled in the step that ended at ``t_end``
    become steady from fast step ``g_first``; the others are listed explicit, in order. Returns the steady
    and explicit counts."""
    nx = 0
    for q in range(count):
        r = reqs[q]
        if rq.state[r] != RUNNING:
            continue
        if rq.computed[r] == rq.ntok[r] - 1 and rq.last_tok[r] == t_end:
            make_steady(r, g_first, rq.computed, rq.done_at, sd.steady, sd.g0, sd.cnt, block_size, sd.cal,
                        sd.fin_next, epoch)
            n_steady += 1
        else:
            sd.xlist[nx] = r
            nx += 1
    return n_steady, nx
