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

Waiting structures (why the scan is not O(waiting requests)). The queue order is a key per
request: arrivals get their arrival index (increasing), preempted requests get ever smaller
negative keys (front). Requests of one adapter are always admitted in key order, so each adapter
keeps its own queue: a stack of preempted requests (linked list) in front of a pointer into its
arrivals. While fewer than ``max_loras`` adapters run, the next request is the head of the whole
queue: the last preempted request still waiting (a stack of them, stale entries dropped when they
reach the top), else the first arrival still waiting (a pointer that only moves forward), both
O(1) amortised. Once the LoRA set is full, a tournament tree over the adapters that have running
requests gives, in O(log adapters), the one whose head has the smallest key; an adapter whose head
changed is marked and its leaf updated just before the tree is read. Skipped requests never move,
so the admission order is exactly vLLM's.

GPU adapter slots are an LRU of ``a_max`` entries, touched every step by every adapter in the
batch; a miss pays the adapter's load latency inside the step (serially, as vLLM loads inline).

Fast steps (:mod:`twin.steady_decode`): while every running request is scheduled in full (the last one
possibly cut by the budget) and granted its blocks, the requests that only decode advance implicitly, so a
step costs O(requests that arrive, prefill or finish) rather than O(batch) (2.4x on a light simulated hour).
A step where that does not hold runs the explicit loop below; after it the loop waits 1, 2, 4 ... 64
explicit steps before trying again, so deep overload pays next to nothing for the check. A trace keeps the
loop explicit. Results are identical either way (tests/test_twin_steady_decode.py).

Speed notes (``benchmarks/speed/twin_speed.py``): numba's ``inline="always"`` inlines at its IR level, and
in this large loop that is sometimes much slower than a plain call; each helper keeps the form that
measured faster. A helper that takes arrays and branches is called, not inlined: inlined, numba
reference-counts its array arguments on every call (an atomic update each, which LLVM cannot prune across
the branch), and that once took half the loop's time. For the same reason no array variable of the loop is
ever reassigned (the finish calendar has a fixed size). Check with ``simulate_core.inspect_llvm``: its body
should call ``NRT_incref``/``NRT_decref`` only on entry and exit.
"""

from __future__ import annotations

import functools

import numba as nb
import numpy as np

from twin.states import FINISHED, REJECTED, RUNNING, WAITING
from twin.steady_decode import block_phase, compact_running, finish_calendar, finishing, make_steady, materialize

INF_KEY = np.int64(2**62)

# Trace event kinds (scheduler-fidelity tests).
EV_SCHEDULED, EV_ADMITTED, EV_PREEMPTED, EV_FINISHED = 0, 1, 2, 3

# ITL histogram: log-spaced bins from 1e-2 ms to 1e7 ms.
ITL_HIST_LO, ITL_HIST_BINS_PER_DECADE, ITL_HIST_DECADES = -2.0, 100, 9


@nb.njit(cache=True, inline="always")
def _tree_update(keys, idxs, size, a, key):
    """Set leaf ``a`` to ``key`` and replay the matches above it, stopping where a winner is unchanged."""
    pos = size + a
    keys[pos] = key
    pos >>= 1
    while pos >= 1:
        left = 2 * pos
        w = left if keys[left] <= keys[left + 1] else left + 1
        if keys[pos] == keys[w] and idxs[pos] == idxs[w]:
            break
        keys[pos] = keys[w]
        idxs[pos] = idxs[w]
        pos >>= 1


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
def _drop_readmitted(pre_req, pre_key, n_pre, state, qkey):
    """Compact the stack of preempted requests to those still waiting with the key they were preempted with;
    returns its new size."""
    k = 0
    for i in range(n_pre):
        r = pre_req[i]
        if state[r] == WAITING and qkey[r] == pre_key[i]:
            pre_req[k] = r
            pre_key[k] = pre_key[i]
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
    n = arrival.shape[0]
    na = ad_start.shape[0] - 1

    # --- per-request state
    state, computed, ntok, blocks, first_tok, finish, last_tok, done_at = request_state(in_len, out_len)
    qkey = np.zeros(n, np.int64)
    stack_next = np.full(n, -1, np.int32)  # int32 (as g0, fin_next): less memory; n < 2**31

    # --- per-adapter queues and trees
    stack_top = np.full(na, -1, np.int64)
    arr_ptr = ad_start[:-1].copy()  # next arrival of this adapter not yet admitted
    arr_end = ad_start[:-1].copy()  # one past the last arrived request of this adapter
    run_count = np.zeros(na, np.int64)
    # Running adapters whose queue head changed since the tree of running adapters last saw it: the tree is
    # brought up to date where it is read, when the LoRA set is full (it is a function of its leaves).
    stale = np.zeros(na, np.bool_)
    stale_list = np.empty(na, np.int64)
    n_stale = 0
    size = 1
    while size < na:
        size *= 2
    set_keys = np.full(2 * size, INF_KEY, np.int64)
    set_idx = np.zeros(2 * size, np.int64)
    for a in range(size):
        set_idx[size + a] = a
    for p in range(size - 1, 0, -1):
        set_idx[p] = set_idx[2 * p]
    # The whole queue's head: the last preempted request still waiting (preempted requests, latest on top, with
    # the key each got; one no longer waiting with that key is dropped when it reaches the top), else the first
    # arrival still waiting (``first_wait``, which only moves forward).
    pre_req = np.empty(n + 1, np.int32)
    pre_key = np.empty(n + 1, np.int64)
    n_pre = 0
    first_wait = 0

    # --- GPU adapter slots (LRU)
    resident = np.zeros(na, np.bool_)
    last_used = np.full(na, -1, np.int64)
    n_resident = 0
    for a in range(min(a_max, na)):  # static adapters are activated at start-up
        resident[a] = True
        n_resident += 1
    batch_stamp = np.full(na, -1, np.int64)

    running, sched_req, sched_tok, batch_ads, done_j, itl_hist, ts, trace = step_buffers(
        n, max_num_seqs, max_batched, duration, ts_dt, trace_cap)
    # Unsigned request indices (and adapter ids, see simulate()) spare numba's negative-index wraparound
    # on each of the many per-request array accesses of a step: about 1.3x on the whole loop.
    running = running.view(np.uint64)
    sched_req = sched_req.view(np.uint64)
    n_ts = ts.shape[0]
    ts_i = 0
    next_ts = 0.0
    tr_i = 0

    nrun = 0
    n_waiting = 0
    n_distinct = 0
    free_blocks = usable_blocks
    front = 0
    next_arr = 0
    now = 0.0
    step = 0
    preemptions = 0
    loads = 0
    rejected = 0
    busy_s = 0.0

    # --- steady decoders held implicitly (twin.steady_decode): fast steps while ``lazy``
    steady = np.zeros(n, np.bool_)
    g0 = np.zeros(n, np.int32)
    cnt = np.zeros(block_size, np.int64)  # steady requests per block phase
    cal = finish_calendar(out_len)  # steady requests by the fast step they finish at
    fin_next = np.empty(n, np.int32)
    epoch = 0  # lazy spells so far: the calendar's entries of earlier ones are stale
    xlist = np.zeros(running.shape[0], np.int64).view(np.uint64)  # the other running requests, in running order
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
        # 1. Arrivals up to now join the back of the waiting queue.
        while next_arr < n and arrival[next_arr] <= now:
            r = next_arr
            a = adapter[r]
            was_empty = stack_top[a] < 0 and arr_ptr[a] == arr_end[a]
            arr_end[a] += 1
            if max_in_flight > 0 and nrun + n_waiting >= max_in_flight:
                state[r] = REJECTED
                rejected += 1
            else:
                state[r] = WAITING
                qkey[r] = r
                n_waiting += 1
            next_arr += 1
            if was_empty and run_count[a] > 0 and not stale[a]:  # otherwise its leaf stays as it is
                stale[a] = True
                stale_list[n_stale] = a
                n_stale += 1

        while ts_dt > 0 and next_ts <= now and ts_i < n_ts:
            ts[ts_i, 0] = next_ts
            ts[ts_i, 1] = nrun
            ts[ts_i, 2] = n_waiting
            ts[ts_i, 3] = (usable_blocks - free_blocks) / usable_blocks
            ts_i += 1
            next_ts += ts_dt

        if now >= duration:
            break
        if nrun == 0 and n_waiting == 0:
            if next_arr >= n:
                break
            now = arrival[next_arr]
            continue

        if lazy:
            # A fast step needs every running request scheduled in full, except that the token budget may cut
            # the prefill of the last one in running order (as the explicit loop would: all before it fit),
            # and every block granted.
            demand = n_steady
            need_blocks = cnt[g % block_size]
            for q in range(nx):
                r = xlist[q]
                num_new = ntok[r] - computed[r]
                demand += num_new
                need = computed[r] + num_new - blocks[r] * block_size
                if need > 0:
                    need_blocks += (need + block_size - 1) // block_size
            cut = 0  # the tokens the last running request gets when the budget cuts it (0: none cut)
            if demand > max_batched and nx > 0:
                r = xlist[nx - 1]
                rest = ntok[r] - computed[r]
                last = rlen - 1
                while last > 0 and state[running[last]] != RUNNING:  # finished requests wait to be compacted
                    last -= 1
                if demand - rest < max_batched and running[last] == r:
                    cut = max_batched - (demand - rest)
                    demand = max_batched
                    need_blocks += (_blocks_short(computed[r] + cut, blocks[r], block_size)
                                    - _blocks_short(computed[r] + rest, blocks[r], block_size))
            if demand > max_batched or need_blocks > free_blocks:
                rlen = materialize(running, rlen, state, steady, g0, g, computed, ntok, blocks, last_tok, now,
                                   block_size, adapter, last_used, fast_ran, step)
                n_steady = 0
                cnt.fill(0)
                epoch += 1
                nx = 0
                lazy = False
                slow_left = backoff
                backoff = min(2 * backoff, 64)

        # 2. RUNNING loop.
        budget = max_batched
        nsched = 0
        # Decodes (one token past the prompt, nothing to recompute) are counted in the RUNNING loop: an admitted
        # request never decodes, as it is new (prompts have >= 1 token: twin.workload's draw_requests and
        # trace_requests ensure it) or was preempted (computed 0). The test is written out: as an
        # inlined helper it halved the loop's speed.
        n_decode = 0
        n_batch_ads = 0
        preempted_now = False
        if lazy:  # steady requests take one token each and cnt[g % block_size] blocks; the others in full (or cut)
            budget -= demand
            free_blocks -= need_blocks
            n_decode = n_steady
            for q in range(nx):
                r = xlist[q]
                num_new = cut if cut > 0 and q == nx - 1 else ntok[r] - computed[r]
                need = computed[r] + num_new - blocks[r] * block_size
                if need > 0:
                    blocks[r] += (need + block_size - 1) // block_size
                if num_new == 1 and computed[r] == ntok[r] - 1 and ntok[r] > in_len[r]:
                    n_decode += 1
                sched_req[nsched] = r
                sched_tok[nsched] = num_new
                nsched += 1
                a = adapter[r]
                if not resident[a] and batch_stamp[a] != step:  # only these can miss: steady adapters stay loaded
                    batch_stamp[a] = step
                    batch_ads[n_batch_ads] = a
                    n_batch_ads += 1
        i = nrun if lazy else 0
        while i < nrun and budget > 0:
            r = running[i]
            num_new = min(ntok[r] - computed[r], budget)
            # New blocks: ceil((computed + num_new) / block_size) - blocks, divided only past the last block.
            need = computed[r] + num_new - blocks[r] * block_size
            need = (need + block_size - 1) // block_size if need > 0 else 0
            scheduled = True
            while need > free_blocks:
                v = running[nrun - 1]
                nrun -= 1
                av = adapter[v]
                free_blocks += blocks[v]
                blocks[v] = 0
                computed[v] = 0
                state[v] = WAITING
                n_waiting += 1
                preemptions += 1
                front += 1
                qkey[v] = -front
                stack_next[v] = stack_top[av]
                stack_top[av] = v
                run_count[av] -= 1
                if run_count[av] == 0:
                    n_distinct -= 1
                _tree_update(set_keys, set_idx, size, av, qkey[v] if run_count[av] > 0 else INF_KEY)
                if n_pre == pre_req.shape[0]:
                    n_pre = _drop_readmitted(pre_req, pre_key, n_pre, state, qkey)
                pre_req[n_pre] = v
                pre_key[n_pre] = qkey[v]
                n_pre += 1
                preempted_now = True
                tr_i = trace_event(trace, trace_cap, tr_i, now, v, 0, EV_PREEMPTED)
                if v == r:
                    scheduled = False
                    break
            if not scheduled:
                break
            if need > 0:
                blocks[r] += need
                free_blocks -= need
            if num_new == 1 and computed[r] == ntok[r] - 1 and ntok[r] > in_len[r]:
                n_decode += 1
            sched_req[nsched] = r
            sched_tok[nsched] = num_new
            nsched += 1
            budget -= num_new
            i += 1
            a = adapter[r]
            if batch_stamp[a] != step:
                batch_stamp[a] = step
                batch_ads[n_batch_ads] = a
                n_batch_ads += 1
        n_sched_running = nsched
        n_kept = nrun

        # 3. WAITING loop (skipped in a step that preempted).
        if not preempted_now:
            while budget > 0 and n_waiting > 0 and nrun < max_num_seqs:
                if n_distinct < a_max:  # the head of the whole queue
                    while n_pre > 0 and (state[pre_req[n_pre - 1]] != WAITING
                                         or qkey[pre_req[n_pre - 1]] != pre_key[n_pre - 1]):
                        n_pre -= 1
                    if n_pre > 0:
                        a = np.int64(adapter[pre_req[n_pre - 1]])
                    else:
                        while first_wait < next_arr and (state[first_wait] != WAITING or qkey[first_wait] != first_wait):
                            first_wait += 1
                        if first_wait == next_arr:
                            break
                        a = np.int64(adapter[first_wait])
                        while state[ad_list[arr_ptr[a]]] == REJECTED:  # arrivals refused ahead of it
                            arr_ptr[a] += 1
                else:  # the first request of a running adapter
                    while n_stale > 0:
                        n_stale -= 1
                        a = stale_list[n_stale]
                        stale[a] = False
                        while arr_ptr[a] < arr_end[a] and state[ad_list[arr_ptr[a]]] == REJECTED:
                            arr_ptr[a] += 1
                        head = INF_KEY
                        if run_count[a] > 0 and stack_top[a] >= 0:
                            head = qkey[stack_top[a]]
                        elif run_count[a] > 0 and arr_ptr[a] < arr_end[a]:
                            head = qkey[ad_list[arr_ptr[a]]]
                        _tree_update(set_keys, set_idx, size, a, head)
                    a = set_idx[1]
                    if set_keys[1] == INF_KEY:
                        break  # every waiting request is skipped for the LoRA limit
                from_stack = stack_top[a] >= 0
                r = stack_top[a] if from_stack else ad_list[arr_ptr[a]]
                num_new = min(ntok[r] - computed[r], budget)
                need = (num_new + block_size - 1) // block_size
                check = (ntok[r] + block_size - 1) // block_size if full_prompt_admission else need
                if check > free_blocks:
                    if nrun == 0 and nsched == 0:
                        # Can never fit, even into an empty cache: vLLM would reject it up front.
                        state[r] = REJECTED
                        rejected += 1
                    else:
                        break
                else:
                    blocks[r] = need
                    free_blocks -= need
                    state[r] = RUNNING
                    if lazy:
                        if rlen == running.shape[0]:
                            rlen = compact_running(running, rlen, state)
                        running[rlen] = r
                        rlen += 1
                    else:
                        running[nrun] = r
                    nrun += 1
                    if run_count[a] == 0:
                        n_distinct += 1
                    run_count[a] += 1
                    sched_req[nsched] = r
                    sched_tok[nsched] = num_new
                    nsched += 1
                    budget -= num_new
                    if batch_stamp[a] != step and not (lazy and resident[a]):
                        batch_stamp[a] = step
                        batch_ads[n_batch_ads] = a
                        n_batch_ads += 1
                # Pop r from its adapter's queue (its new head reaches the tree of running adapters when read).
                n_waiting -= 1
                if from_stack:
                    stack_top[a] = stack_next[r]
                else:
                    arr_ptr[a] += 1
                if not stale[a]:
                    stale[a] = True
                    stale_list[n_stale] = a
                    n_stale += 1

        if nsched + n_steady == 0:
            # Nothing runnable now (e.g. only a rejected head): wait for the next arrival.
            if next_arr >= n:
                break
            now = max(now, arrival[next_arr])
            continue

        # 4. Step cost: batch shape, adapter loads, scheduler overhead.
        n_tokens = max_batched - budget
        # While lazy, batch_ads lists only the adapters that may miss; the batch is every adapter with running
        # requests, whose LRU stamps are written when they stop running (or by materialize).
        load_ms = 0.0
        for j in range(n_batch_ads):
            a = batch_ads[j]
            if not resident[a]:
                if n_resident >= a_max:
                    victim = -1
                    for c in range(na):
                        if (resident[c] and (run_count[c] == 0 if lazy else batch_stamp[c] != step)
                                and (victim < 0 or last_used[c] < last_used[victim])):
                            victim = c
                    resident[victim] = False
                    n_resident -= 1
                resident[a] = True
                n_resident += 1
                load_ms += ad_load_ms[a]
                loads += 1
            last_used[a] = step
        n_step_ads = n_distinct if lazy else n_batch_ads
        b = float(nsched + n_steady)
        prompt_tokens = float(n_tokens - n_decode)
        ms = step_ms(lat, b, prompt_tokens, n_step_ads) + scheduler_ms(sched, nrun, n_waiting, a_max)
        dt = (ms + load_ms) / 1000.0
        t_end = now + dt
        busy_s += dt

        if trace_cap > 0:
            tr_i = trace_scheduled(trace, trace_cap, tr_i, now, sched_req, sched_tok, nsched, n_sched_running)

        # 5. Apply the step's output: computed tokens, sampled tokens, finished requests (freed below).
        n_done, tr_i, step_bin = apply_step_output(sched_req, sched_tok, nsched, now, t_end, computed, ntok,
                                                   first_tok, last_tok, itl_hist, itl_edges, step_bin, n_steady,
                                                   done_at, state, finish, done_j, trace, trace_cap, tr_i)
        if lazy:
            r = finishing(cal, g, epoch)
            while r >= 0:  # steady requests that sampled their last token
                cnt[block_phase(g0[r], computed[r], block_size)] -= 1  # computed: still its value when made steady
                c = done_at[r] - 1
                steady[r] = False
                n_steady -= 1
                computed[r] = c
                ntok[r] = done_at[r]
                last_tok[r] = t_end
                state[r] = FINISHED
                finish[r] = t_end
                free_blocks += (c + block_size - 1) // block_size
                blocks[r] = 0
                nrun -= 1
                a = adapter[r]
                run_count[a] -= 1
                if run_count[a] == 0:
                    n_distinct -= 1
                    _tree_update(set_keys, set_idx, size, a, INF_KEY)
                    last_used[a] = step
                r = fin_next[r]
        for f in range(n_done):
            r = sched_req[done_j[f]]
            free_blocks += blocks[r]
            blocks[r] = 0
            a = adapter[r]
            run_count[a] -= 1
            if run_count[a] == 0:
                n_distinct -= 1
                _tree_update(set_keys, set_idx, size, a, INF_KEY)
                if lazy:
                    last_used[a] = step
        if lazy:
            nrun -= n_done
            k = 0
            for q in range(nsched):  # the scheduled explicit requests, in running order
                r = sched_req[q]
                if state[r] != RUNNING:
                    continue
                if computed[r] == ntok[r] - 1 and last_tok[r] == t_end:  # sampled: steady from the next fast step
                    make_steady(r, g + 1, computed, done_at, steady, g0, cnt, block_size, cal, fin_next, epoch)
                    n_steady += 1
                else:
                    xlist[k] = r
                    k += 1
            nx = k
            g += 1
            fast_ran = True
            backoff = 1
        else:
            if n_done > 0:
                nrun = drop_finished(running, nrun, done_j, n_done, n_sched_running, n_kept)
            if trace_cap == 0:
                if slow_left > 0:
                    slow_left -= 1
                else:  # try fast steps: requests that sampled in this step become steady
                    for q in range(nrun):
                        r = running[q]
                        if computed[r] == ntok[r] - 1 and last_tok[r] == t_end:
                            make_steady(r, g, computed, done_at, steady, g0, cnt, block_size, cal, fin_next, epoch)
                            n_steady += 1
                        else:
                            xlist[nx] = r
                            nx += 1
                    rlen = nrun
                    fast_ran = False
                    lazy = True
        now = t_end
        step += 1

    counters = np.array([preemptions, loads, rejected, step, ts_i, tr_i, g], np.int64)
    return (state, first_tok, finish, itl_hist, counters, busy_s,
            ts[:ts_i], trace[:tr_i])
