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
"""

from __future__ import annotations

import numba as nb
import numpy as np

from twin.core import (
    EV_PREEMPTED,
    apply_step_output,
    batch_shape,
    drop_finished,
    request_state,
    scheduler_ms,
    step_buffers,
    step_ms,
    trace_event,
    trace_scheduled,
)
from twin.policies import history as hx
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

# Indices into the integer parameter vector.
I_CACHE, I_SCHED, I_COLD, I_PREFETCH, I_QUEUES, I_PRELOAD, I_BYPASS = 0, 1, 2, 3, 4, 5, 6
N_INT_PARAMS = 7

# Policy statistics returned next to the counters.
(S_HITS, S_MISSES, S_EVICTIONS, S_STALL_S, S_CPU_STEPS, S_PEAK_RESIDENT, S_SWAP_INS, S_REFRESHES, S_LOADS,
 S_BYPASSES, S_SQUASHED, S_HISTORY_TOKENS, S_REUSED_TOKENS, S_PREFILL_TOKENS, S_KV_EVICTIONS, S_KV_SWAP_INS,
 S_INVALID_BLOCK_S, S_USED_BLOCK_S) = range(18)
N_STATS = 18


@nb.njit(cache=True)
def _settle(a, now, ad_state, ad_ready):
    if ad_state[a] == AD_LOADING and ad_ready[a] <= now:
        ad_state[a] = AD_GPU


@nb.njit(cache=True)
def _reclaimable(protect, now, ad_state, ad_ready, rc, ad_blocks, mem, hist):
    """Free blocks plus those of all idle history and of every idle adapter but ``protect`` (what
    evicting them all gives; under the dependency rule not adapters whose history is still coming in)."""
    free = mem[0] + mem[2]
    depend = hist[4][hx.HC_DEPEND]
    for a in range(ad_state.shape[0]):
        _settle(a, now, ad_state, ad_ready)
        if ad_state[a] == AD_GPU and rc[a] == 0 and a != protect and not (depend and hist[2][a, hx.AH_LOADING]):
            free += ad_blocks[a]
    return free


@nb.njit(cache=True)
def _make_room(need, protect, now, mode, ad_state, ad_ready, rc, qc, freq, freq_t, last_used, ad_tokens,
               ad_blocks, load_ms, fp, mem, stats, hist, partial=False):
    """Evict idle adapters and idle history (``twin.policies.history``) until ``need`` blocks are
    free (``mem[0]``); idle = on the GPU with no running request; what no unfinished request wants
    goes first, then the rest (then anything, for adapters the dependency rule held back). False if it
    cannot; then nothing is evicted, unless ``partial`` (KV for running requests: every block spared
    is a smaller preemption)."""
    na = ad_state.shape[0]
    if not partial and mem[0] < need and _reclaimable(protect, now, ad_state, ad_ready, rc, ad_blocks, mem,
                                                      hist) < need:
        return False
    depend = hist[4][hx.HC_DEPEND]
    ad_h = hist[2]
    ftot, low = 0.0, 0.0  # ELORA's terms for weighing history against adapters (fixed during one call)
    if mode == CACHE_ELORA and hist[4][hx.HC_ON]:
        for a in range(na):
            ftot += decayed(freq[a], freq_t[a], now, fp[P_FREQ_WINDOW_S])
        low = low_lora(freq, freq_t, now, fp[P_BATCH_WINDOW_S], hist[5][hx.HP_BS_AVG])
    cand = np.zeros(na, np.bool_)
    for tier in range(3):
        while mem[0] < need:
            n_c = 0
            for a in range(na):
                _settle(a, now, ad_state, ad_ready)
                cand[a] = (ad_state[a] == AD_GPU and rc[a] == 0 and a != protect and ad_blocks[a] > 0
                           and (tier == 2 or (qc[a] > 0) == (tier == 1))
                           and not (depend and ad_h[a, hx.AH_ENTRIES] > 0))
                n_c += cand[a]
            v, v_score = -1, np.inf
            if n_c > 0:
                score = eviction_scores(mode, now, cand, freq, freq_t, last_used, ad_tokens, load_ms, fp)
                v = int(np.argmin(score))
                v_score = score[v]
            c, c_score = -1, np.inf
            if mem[2] > 0:
                # Eq. 4 (Choice, the notes' ambiguity b): a LoRA's keep-value grows as evicting it
                # would leave fewer than Low_lora LoRAs; history leaves keep theirs.
                if mode == CACHE_ELORA and v >= 0 and mem[1] - 1 < low:
                    v_score *= min(1e6, low / max(mem[1] - 1, 1e-6))
                c, c_score = hx.best_victim(tier, now, mode == CACHE_ELORA, hist, mem, fp, ftot)
            if v < 0 and c < 0:
                break
            if c >= 0 and (v < 0 or mode != CACHE_ELORA and mode != CACHE_LRU or c_score <= v_score):
                hx.evict(c, hist, mem)
                stats[S_KV_EVICTIONS] += 1
                continue
            ad_state[v] = AD_HOST
            mem[0] += ad_blocks[v]
            mem[1] -= 1
            stats[S_EVICTIONS] += 1
    return mem[0] >= need


@nb.njit(cache=True)
def _start_load(a, now, mode, ad_state, ad_ready, rc, qc, freq, freq_t, last_used, ad_tokens, ad_blocks,
                load_ms, fp, mem, stats, pcie, hist):
    """Reserve ``a``'s blocks and queue its copy on the PCIe channel (``pcie[0]``: when it is free)."""
    if not _make_room(ad_blocks[a], a, now, mode, ad_state, ad_ready, rc, qc, freq, freq_t, last_used, ad_tokens,
                      ad_blocks, load_ms, fp, mem, stats, hist):
        return False
    mem[0] -= ad_blocks[a]
    mem[1] += 1
    stats[S_PEAK_RESIDENT] = max(stats[S_PEAK_RESIDENT], mem[1])
    start = max(now, pcie[0])
    ad_ready[a] = start + load_ms[a] / 1000.0
    pcie[0] = ad_ready[a]
    ad_state[a] = AD_LOADING
    stats[S_LOADS] += 1
    return True


@nb.njit(cache=True)
def _swap_in_history(c, a, now, mode, ad_state, ad_ready, rc, qc, freq, freq_t, last_used, ad_tokens, ad_blocks,
                     load_ms, fp, mem, stats, pcie, hist):
    """Make room for host history ``c`` (sparing its adapter ``a``) and queue its copy back."""
    if not _make_room(hist[0][c, hx.HI_BLOCKS], a, now, mode, ad_state, ad_ready, rc, qc, freq, freq_t, last_used,
                      ad_tokens, ad_blocks, load_ms, fp, mem, stats, hist):
        return False
    hx.start_swap_in(c, now, hist, mem, pcie)
    stats[S_KV_SWAP_INS] += 1
    return True


@nb.njit(cache=True)
def _q_insert_after(r, after, q, q_tail, nxt, prv):
    prv[r] = after
    nxt[r] = nxt[after]
    if nxt[after] >= 0:
        prv[nxt[after]] = r
    else:
        q_tail[q] = r
    nxt[after] = r


@nb.njit(cache=True)
def _q_push(r, q, front, q_head, q_tail, nxt, prv):
    if front:
        nxt[r] = q_head[q]
        prv[r] = -1
        if q_head[q] >= 0:
            prv[q_head[q]] = r
        else:
            q_tail[q] = r
        q_head[q] = r
    elif q_tail[q] >= 0:
        _q_insert_after(r, q_tail[q], q, q_tail, nxt, prv)
    else:
        prv[r] = -1
        nxt[r] = -1
        q_head[q] = r
        q_tail[q] = r


@nb.njit(cache=True, inline="always")
def _back_to_waiting(v, adapter, blocks, computed, state, qc, rc, borrow, used, req_q, need_res, bypass_of, mem):
    """Free running request ``v``'s KV and mark it waiting to be recomputed (a preemption or a squash;
    the caller queues it). Returns (the borrowed quota it gives back, 1 if its adapter has no running
    request left). Without MLQ its quota terms are zero."""
    a = adapter[v]
    mem[0] += blocks[v]
    blocks[v] = 0
    computed[v] = 0
    state[v] = WAITING
    qc[a] += 1
    gave = borrow[v]
    if gave > 0:
        borrow[v] = 0.0
    else:
        used[req_q[v]] -= need_res[v]
    bypass_of[v] = -1
    rc[a] -= 1
    return gave, 1 if rc[a] == 0 else 0


@nb.njit(cache=True)
def _kv_check(r, computed, ntok, block_size, max_batched, full_prompt_admission):
    """KV blocks waiting request ``r`` must find free to be admitted (the admission rule's check)."""
    if full_prompt_admission:
        return (ntok[r] + block_size - 1) // block_size
    return (min(ntok[r] - computed[r], max_batched) + block_size - 1) // block_size


@nb.njit(cache=True)
def _steps_left(r, computed, ntok, in_len, out_pred, max_batched):
    """Steps request ``r`` still needs as the scheduler predicts them: its prompt's remaining chunks
    plus the predicted output tokens not yet generated (at least one)."""
    prefill = max(0, in_len[r] - computed[r])
    return -(-prefill // max_batched) + max(1, out_pred[r] - max(0, ntok[r] - in_len[r]))


@nb.njit(cache=True)
def _memory_wait_s(shortfall, running, nrun, blocks, computed, ntok, in_len, out_pred, max_batched, step_s):
    """Chameleon's prediction of how soon ``shortfall`` blocks free up: running requests finish in
    order of their predicted remaining steps (x the recent step time) and return their KV blocks
    (Choice: adapters they leave idle are not counted, so the wait is an upper bound); inf if they
    never free enough."""
    if shortfall <= 0:
        return 0.0
    left = np.empty(nrun, np.int64)
    for j in range(nrun):
        left[j] = _steps_left(running[j], computed, ntok, in_len, out_pred, max_batched)
    freed = 0
    for j in np.argsort(left, kind="mergesort"):
        freed += blocks[running[j]]
        if freed >= shortfall:
            return left[j] * step_s
    return np.inf


@nb.njit(cache=True)
def _q_remove(r, q, q_head, q_tail, nxt, prv):
    if prv[r] >= 0:
        nxt[prv[r]] = nxt[r]
    else:
        q_head[q] = nxt[r]
    if nxt[r] >= 0:
        prv[nxt[r]] = prv[r]
    else:
        q_tail[q] = prv[r]


@nb.njit(cache=True)
def simulate_policy_core(
    arrival, adapter, in_len, out_len, out_pred, conv, history_len,  # requests, sorted by arrival
    ad_tokens, ad_blocks, ad_load_ms, ad_cpu_ms_per_token,  # per adapter
    duration, a_max, pool_blocks, block_size, max_batched, max_num_seqs, full_prompt_admission,
    lat, sched, ip, fp, max_in_flight, ts_dt, trace_cap, hist,
):
    n = arrival.shape[0]
    na = ad_tokens.shape[0]
    cache_mode, sched_mode, cold = ip[I_CACHE], ip[I_SCHED], ip[I_COLD]
    nq = ip[I_QUEUES] if sched_mode == SCHED_MLQ else 1

    state, computed, ntok, blocks, first_tok, finish, last_tok, done_at = request_state(in_len, out_len)
    admit_t = np.full(n, -1.0)
    nxt = np.full(n, -1, np.int64)
    prv = np.full(n, -1, np.int64)
    req_q = np.zeros(n, np.int64)
    wrs = np.zeros(n)
    need_res = np.zeros(n)  # tokens a request holds of its queue quota (MLQ)
    borrow = np.zeros(n)
    bypass_of = np.full(n, -1, np.int64)  # the blocked head a running request bypassed (MLQ bypass)
    blocked = np.full(nq, -1, np.int64)  # per queue: its head waiting for adapter memory, bypassed

    q_head = np.full(nq, -1, np.int64)
    q_tail = np.full(nq, -1, np.int64)
    bounds = np.empty(max(nq - 1, 0))
    for q in range(nq - 1):
        bounds[q] = (q + 1.0) / nq  # static equal-range queues until the first refresh
    quota = np.full(nq, float(pool_blocks * block_size) / nq)
    used = np.zeros(nq)
    borrowed = 0.0
    max_in_seen, max_out_seen = 1.0, 1.0
    max_ad_tokens = max(1.0, float(ad_tokens.max())) if na > 0 else 1.0
    next_refresh = fp[P_REFRESH_S]
    win_lo = 0

    ad_state = np.zeros(na, np.int8)
    ad_ready = np.zeros(na)
    rc = np.zeros(na, np.int64)
    qc = np.zeros(na, np.int64)
    freq = np.zeros(na)
    freq_t = np.zeros(na)
    last_used = np.zeros(na)
    stats = np.zeros(N_STATS)
    mem = np.zeros(3, np.int64)  # free blocks, resident (or loading) adapters, idle history blocks
    mem[0] = pool_blocks
    pcie = np.zeros(1)
    if ip[I_PRELOAD]:
        for a in range(na):
            if mem[0] >= ad_blocks[a]:
                ad_state[a] = AD_GPU
                mem[0] -= ad_blocks[a]
                mem[1] += 1
    batch_stamp = np.full(na, -1, np.int64)
    ad_prompt_tok = np.zeros(na)

    running, sched_req, sched_tok, batch_ads, done_j, itl_hist, ts, trace = step_buffers(
        n, max_num_seqs, max_batched, duration, ts_dt, trace_cap)
    n_hist = itl_hist.shape[0] - 2
    n_ts = ts.shape[0]
    ts_i = 0
    next_ts = 0.0
    tr_i = 0

    nrun = 0
    n_waiting = 0
    n_distinct = 0
    next_arr = 0
    now = 0.0
    step = 0
    preemptions = 0
    rejected = 0
    busy_s = 0.0
    bs_avg = 1.0
    step_avg_s = step_ms(lat, 1.0, 0.0, 1) / 1000.0  # recent step time (the bypass's predictions)
    next_swap = 0.0
    fw = fp[P_FREQ_WINDOW_S]
    history_on = hist[4][hx.HC_ON] != 0
    ad_h = hist[2]

    while True:
        # 1. Arrivals join the back of their queue; their adapter's copy starts (prefetch).
        while next_arr < n and arrival[next_arr] <= now:
            r = next_arr
            a = adapter[r]
            next_arr += 1
            if max_in_flight > 0 and nrun + n_waiting >= max_in_flight:
                state[r] = REJECTED
                rejected += 1
                continue
            state[r] = WAITING
            n_waiting += 1
            qc[a] += 1
            freq[a] = decayed(freq[a], freq_t[a], now, fw) + 1.0
            freq_t[a] = now
            _settle(a, now, ad_state, ad_ready)
            stats[S_HITS if ad_state[a] != AD_HOST else S_MISSES] += 1
            c = conv[r]
            if c >= 0 and history_on:
                hx.visit(c, now, hist, fw)
            if sched_mode == SCHED_MLQ:
                max_in_seen = max(max_in_seen, float(in_len[r]))
                max_out_seen = max(max_out_seen, float(out_pred[r]))
                wrs[r] = ((fp[P_WRS_A] * in_len[r] / max_in_seen + fp[P_WRS_B] * out_pred[r] / max_out_seen)
                          * max(ad_tokens[a], 1) / max_ad_tokens)
                req_q[r] = queue_of(wrs[r], bounds)
                need_res[r] = in_len[r] + out_pred[r]
            _q_push(r, req_q[r], False, q_head, q_tail, nxt, prv)
            if ip[I_PREFETCH] and cold != COLD_INLINE and ad_state[a] == AD_HOST:
                _start_load(a, now, cache_mode, ad_state, ad_ready, rc, qc, freq, freq_t, last_used, ad_tokens,
                            ad_blocks, ad_load_ms, fp, mem, stats, pcie, hist)
            # Host history comes back behind its adapter, never without it (ELORA swaps in only
            # subtrees whose parent is on the GPU).
            if (c >= 0 and history_on and ip[I_PREFETCH] and hist[0][c, hx.HI_STATE] == hx.H_HOST
                    and ad_state[a] != AD_HOST):
                _swap_in_history(c, a, now, cache_mode, ad_state, ad_ready, rc, qc, freq, freq_t, last_used,
                                 ad_tokens, ad_blocks, ad_load_ms, fp, mem, stats, pcie, hist)

        while ts_dt > 0 and next_ts <= now and ts_i < n_ts:
            ts[ts_i, 0] = next_ts
            ts[ts_i, 1] = nrun
            ts[ts_i, 2] = n_waiting
            ts[ts_i, 3] = (pool_blocks - mem[0]) / pool_blocks
            ts_i += 1
            next_ts += ts_dt

        if now >= duration:
            break

        # Chameleon: re-form the queues and their quotas from the last refresh period's requests.
        if sched_mode == SCHED_MLQ and now >= next_refresh:
            t_ref = fp[P_REFRESH_S]
            while win_lo < next_arr and arrival[win_lo] < now - t_ref:
                win_lo += 1
            m = next_arr - win_lo
            if m > 0:
                bounds = kmeans_boundaries(wrs[win_lo:next_arr].copy(), nq)
                s_max = np.zeros(nq)
                cnt = np.zeros(nq)
                d_sum = np.zeros(nq)
                d_cnt = np.zeros(nq)
                for r in range(win_lo, next_arr):
                    q = queue_of(wrs[r], bounds)
                    cnt[q] += 1
                    s_max[q] = max(s_max[q], need_res[r])
                    if state[r] == FINISHED:
                        d_sum[q] += finish[r] - admit_t[r]
                        d_cnt[q] += 1
                d_all = d_sum.sum() / d_cnt.sum() if d_cnt.sum() > 0 else 0.0
                dq = np.zeros(nq)
                for q in range(nq):
                    dq[q] = d_sum[q] / d_cnt[q] if d_cnt[q] > 0 else d_all
                quota = mlq_quotas(s_max, dq, cnt / t_ref, fp[P_SLO_S], float(pool_blocks * block_size))
                stats[S_REFRESHES] += 1
            next_refresh = now + t_ref

        # ELORA: periodic swap-in of valuable host adapters while memory is idle.
        if cache_mode == CACHE_ELORA and now >= next_swap:
            target = low_lora(freq, freq_t, now, fp[P_BATCH_WINDOW_S], bs_avg)
            idle_blocks = int((1.0 - fp[P_IDLE_THRESHOLD]) * pool_blocks)
            while mem[1] < np.ceil(target):
                cand = np.zeros(na, np.bool_)
                for a in range(na):
                    cand[a] = ad_state[a] == AD_HOST and freq[a] > 0 and mem[0] - ad_blocks[a] >= idle_blocks
                if not cand.any():
                    break
                score = eviction_scores(cache_mode, now, cand, freq, freq_t, last_used, ad_tokens, ad_load_ms, fp)
                best = int(np.argmax(np.where(cand, score, -1.0)))
                _start_load(best, now, cache_mode, ad_state, ad_ready, rc, qc, freq, freq_t, last_used,
                            ad_tokens, ad_blocks, ad_load_ms, fp, mem, stats, pcie, hist)
                stats[S_SWAP_INS] += 1
            next_swap = now + fp[P_SWAP_PERIOD_S]

        if nrun == 0 and n_waiting == 0:
            if next_arr >= n:
                break
            # An idle ELORA server still runs its swapper every period.
            now = min(arrival[next_arr], next_swap) if cache_mode == CACHE_ELORA else arrival[next_arr]
            continue

        # Chameleon's squash: a bypassed head whose memory (counting its bypassers' KV) is there now
        # gets it; its bypassers restart later, right behind it.
        for q in range(nq):
            r1 = blocked[q]
            if r1 < 0:
                continue
            a1 = adapter[r1]
            _settle(a1, now, ad_state, ad_ready)
            held = 0  # the bypassers' KV (Choice: their adapters, idle after a squash, are not counted)
            for j in range(nrun):
                if bypass_of[running[j]] == r1:
                    held += blocks[running[j]]
            free = _reclaimable(-1, now, ad_state, ad_ready, rc, ad_blocks, mem, hist)
            need1 = ad_blocks[a1] + _kv_check(r1, computed, ntok, block_size, max_batched, full_prompt_admission)
            waiting_head = state[r1] == WAITING and ad_state[a1] == AD_HOST and free < need1
            if waiting_head and held > 0 and free + held >= need1:
                k = 0
                after = r1
                for j in range(nrun):
                    v = running[j]
                    if bypass_of[v] != r1:
                        running[k] = v
                        k += 1
                        continue
                    gave, idle = _back_to_waiting(v, adapter, blocks, computed, state, qc, rc, borrow, used, req_q,
                                                  need_res, bypass_of, mem)
                    borrowed -= gave
                    n_waiting += 1
                    n_distinct -= idle
                    _q_insert_after(v, after, req_q[v], q_tail, nxt, prv)
                    after = v
                    stats[S_SQUASHED] += 1
                    tr_i = trace_event(trace, trace_cap, tr_i, now, v, 0, EV_PREEMPTED)
                nrun = k
                waiting_head = False
            if not waiting_head:
                blocked[q] = -1
                for j in range(nrun):
                    if bypass_of[running[j]] == r1:
                        bypass_of[running[j]] = -1

        # 2. RUNNING loop: KV for the new tokens; take blocks from idle adapters, then preempt.
        budget = max_batched
        nsched = 0
        preempted_now = False
        i = 0
        while i < nrun and budget > 0:
            r = running[i]
            num_new = min(ntok[r] - computed[r], budget)
            need = (computed[r] + num_new + block_size - 1) // block_size - blocks[r]
            if need > mem[0]:
                _make_room(need, -1, now, cache_mode, ad_state, ad_ready, rc, qc, freq, freq_t, last_used,
                           ad_tokens, ad_blocks, ad_load_ms, fp, mem, stats, hist, True)
            scheduled = True
            while need > mem[0]:
                v = running[nrun - 1]
                nrun -= 1
                gave, idle = _back_to_waiting(v, adapter, blocks, computed, state, qc, rc, borrow, used, req_q,
                                              need_res, bypass_of, mem)
                borrowed -= gave
                n_waiting += 1
                n_distinct -= idle
                preemptions += 1
                _q_push(v, req_q[v], True, q_head, q_tail, nxt, prv)
                preempted_now = True
                tr_i = trace_event(trace, trace_cap, tr_i, now, v, 0, EV_PREEMPTED)
                if v == r:
                    scheduled = False
                    break
            if not scheduled:
                break
            blocks[r] += need
            mem[0] -= need
            sched_req[nsched] = r
            sched_tok[nsched] = num_new
            nsched += 1
            budget -= num_new
            i += 1
        n_sched_running = nsched
        n_kept = nrun

        # 3. WAITING: FIFO scan (skip what is not ready) or Chameleon's two-phase quota fill.
        inline_ms = 0.0
        if not preempted_now:
            leftover = 0.0
            for phase in range(2 if sched_mode == SCHED_MLQ else 1):
                for q in range(nq):
                    if phase == 1 and leftover <= 0:
                        break
                    r = q_head[q]
                    bypassing = -1  # the head this scan bypasses
                    wait_s = 0.0  # its predicted wait for memory
                    while r >= 0 and budget > 0 and nrun < max_num_seqs:
                        nr = nxt[r]
                        a = adapter[r]
                        if sched_mode == SCHED_MLQ:
                            # A queue with nothing running may always start its head (Choice: else a
                            # quota below one request's size would starve the queue for good).
                            allow = quota[q] - used[q] if phase == 0 else leftover
                            if need_res[r] > allow and not (phase == 0 and used[q] <= 0):
                                break
                        if rc[a] == 0 and n_distinct >= a_max:
                            # vLLM's max_loras rule skips, in every scheduler (Choice for Chameleon:
                            # S-LoRA has no such limit; a blocked head here would idle the queue).
                            r = nr
                            continue
                        _settle(a, now, ad_state, ad_ready)
                        inline_load = False
                        if ad_state[a] == AD_HOST:
                            if cold == COLD_INLINE:
                                inline_load = True
                            else:
                                _start_load(a, now, cache_mode, ad_state, ad_ready, rc, qc, freq, freq_t, last_used,
                                            ad_tokens, ad_blocks, ad_load_ms, fp, mem, stats, pcie, hist)
                        if (cold == COLD_ASYNC and ad_state[a] != AD_GPU) or (cold == COLD_CPU and ad_state[a] == AD_HOST):
                            if sched_mode == SCHED_FIFO or bypassing >= 0:
                                r = nr
                                continue
                            if ip[I_BYPASS] and ad_state[a] == AD_HOST and r == q_head[q]:
                                # No memory for the head's adapter even with every idle adapter evicted.
                                bypassing = r
                                need1 = ad_blocks[a] + _kv_check(r, computed, ntok, block_size, max_batched,
                                                                 full_prompt_admission)
                                wait_s = _memory_wait_s(need1 - mem[0], running, nrun, blocks, computed, ntok,
                                                        in_len, out_pred, max_batched, step_avg_s)
                                r = nr
                                continue
                            break
                        if bypassing >= 0 and _steps_left(r, computed, ntok, in_len, out_pred,
                                                          max_batched) * step_avg_s >= wait_s:
                            r = nr
                            continue
                        # A later turn reuses its conversation's history KV (waiting while it swaps in).
                        c = conv[r]
                        took = 0
                        if c >= 0 and history_on and history_len[r] > 0:
                            hx.settle(c, now, hist, mem)
                            if hist[0][c, hx.HI_STATE] == hx.H_HOST and ad_state[a] != AD_HOST:
                                _swap_in_history(c, a, now, cache_mode, ad_state, ad_ready, rc, qc, freq, freq_t,
                                                 last_used, ad_tokens, ad_blocks, ad_load_ms, fp, mem, stats, pcie,
                                                 hist)
                            h_state = hist[0][c, hx.HI_STATE]
                            if h_state == hx.H_LOADING:
                                if sched_mode == SCHED_FIFO:
                                    r = nr
                                    continue
                                break
                            if h_state == hx.H_GPU and hist[0][c, hx.HI_BLOCKS] * block_size <= history_len[r]:
                                took = hx.take(r, c, now, hist, blocks, computed, mem)
                        num_new = min(ntok[r] - computed[r], budget)
                        need = (computed[r] + num_new + block_size - 1) // block_size - blocks[r]
                        check = (ntok[r] + block_size - 1) // block_size - blocks[r] if full_prompt_admission else need
                        extra = ad_blocks[a] if inline_load else 0
                        if check + extra > mem[0]:
                            _make_room(check + extra, a, now, cache_mode, ad_state, ad_ready, rc, qc, freq, freq_t,
                                       last_used, ad_tokens, ad_blocks, ad_load_ms, fp, mem, stats, hist)
                        if check + extra > mem[0]:
                            if took:
                                check += hx.give_back(r, c, hist, blocks, computed, mem)
                            own = ad_blocks[a] if ad_state[a] != AD_HOST else 0
                            if nrun == 0 and nsched == 0 and check + extra > pool_blocks - own:
                                # Cannot fit even into an empty pool: the server refuses it.
                                state[r] = REJECTED
                                rejected += 1
                                n_waiting -= 1
                                qc[a] -= 1
                                if c >= 0 and history_on:
                                    hist[3][c] -= 1
                                _q_remove(r, q, q_head, q_tail, nxt, prv)
                                r = nr
                                continue
                            break
                        if c >= 0 and history_on and admit_t[r] < 0:  # counted once, not per readmission
                            stats[S_HISTORY_TOKENS] += history_len[r]
                            stats[S_REUSED_TOKENS] += took
                        if inline_load:
                            ad_state[a] = AD_GPU
                            mem[0] -= ad_blocks[a]
                            mem[1] += 1
                            stats[S_PEAK_RESIDENT] = max(stats[S_PEAK_RESIDENT], mem[1])
                            inline_ms += ad_load_ms[a]
                            stats[S_LOADS] += 1
                        if bypassing >= 0:
                            bypass_of[r] = bypassing
                            blocked[q] = bypassing
                            stats[S_BYPASSES] += 1
                        if sched_mode == SCHED_MLQ:
                            if phase == 0:
                                used[q] += need_res[r]
                            else:
                                borrow[r] = need_res[r]
                                borrowed += need_res[r]
                                leftover -= need_res[r]
                        blocks[r] += need
                        mem[0] -= need
                        state[r] = RUNNING
                        if admit_t[r] < 0:
                            admit_t[r] = now
                        running[nrun] = r
                        nrun += 1
                        if rc[a] == 0:
                            n_distinct += 1
                        rc[a] += 1
                        qc[a] -= 1
                        n_waiting -= 1
                        _q_remove(r, q, q_head, q_tail, nxt, prv)
                        sched_req[nsched] = r
                        sched_tok[nsched] = num_new
                        nsched += 1
                        budget -= num_new
                        r = nr
                    if phase == 0 and sched_mode == SCHED_MLQ and q_head[q] < 0:
                        leftover += max(0.0, quota[q] - used[q])
                if phase == 0:
                    leftover = max(0.0, leftover - borrowed)

        if nsched == 0:
            # Nothing runnable: wait for the next arrival or the next adapter copy to land.
            t_next = arrival[next_arr] if next_arr < n else np.inf
            for a in range(na):
                if ad_state[a] == AD_LOADING:
                    t_next = min(t_next, ad_ready[a])
            if history_on:
                for c in range(hist[0].shape[0]):
                    hx.settle(c, now, hist, mem)
                    if hist[0][c, hx.HI_STATE] == hx.H_LOADING:
                        t_next = min(t_next, hist[1][c, hx.HF_READY])
            if t_next == np.inf:
                break
            now = max(now, t_next)
            continue

        # 4. Step cost: the profile's model, inline loads, CPU-assisted LoRA of loading adapters.
        n_tokens, n_decode, n_batch_ads = batch_shape(sched_req, sched_tok, nsched, computed, ntok, in_len, adapter,
                                                      batch_stamp, batch_ads, step)
        for j in range(n_batch_ads):
            ad_prompt_tok[batch_ads[j]] = 0.0
        for j in range(nsched):
            ad_prompt_tok[adapter[sched_req[j]]] += sched_tok[j]
        b = float(nsched)
        prompt_tokens = float(n_tokens - n_decode)
        ms = step_ms(lat, b, prompt_tokens, n_batch_ads)
        cpu_extra = -1.0
        for j in range(n_batch_ads):
            a = batch_ads[j]
            last_used[a] = now
            if ad_state[a] == AD_LOADING and ad_ready[a] > now:
                # Toppings: the not-yet-copied share of the adapter's layers runs on CPU cores,
                # overlapped with the GPU's base-model work; the step waits for the slower side.
                left = min(1.0, (ad_ready[a] - now) / max(ad_load_ms[a] / 1000.0, 1e-12))
                cpu_ms = ad_prompt_tok[a] * ad_cpu_ms_per_token[a] * left
                cpu_extra = max(cpu_extra, max(0.0, cpu_ms - ms))
        if cpu_extra >= 0:
            ms += cpu_extra + fp[P_CPU_SYNC_MS]
            stats[S_CPU_STEPS] += 1
        ms += scheduler_ms(sched, nrun, n_waiting, a_max)
        dt = (ms + inline_ms) / 1000.0
        stats[S_STALL_S] += inline_ms / 1000.0
        t_end = now + dt
        busy_s += dt
        k_bs = np.exp(-dt / fp[P_BATCH_WINDOW_S])
        bs_avg = bs_avg * k_bs + b * (1.0 - k_bs)
        step_avg_s = step_avg_s * k_bs + dt * (1.0 - k_bs)
        stats[S_PREFILL_TOKENS] += prompt_tokens
        if history_on:
            hist[5][hx.HP_BS_AVG] = bs_avg
            invalid = 0
            for a in range(na):
                if ad_state[a] == AD_HOST:
                    invalid += ad_h[a, hx.AH_BLOCKS]
            stats[S_INVALID_BLOCK_S] += invalid * dt
            stats[S_USED_BLOCK_S] += (pool_blocks - mem[0]) * dt

        if trace_cap > 0:
            tr_i = trace_scheduled(trace, trace_cap, tr_i, now, sched_req, sched_tok, nsched, n_sched_running)

        # 5. Apply the step's output: computed tokens, sampled tokens, finished requests (freed below).
        n_done, tr_i = apply_step_output(sched_req, sched_tok, nsched, now, t_end, computed, ntok, first_tok, last_tok,
                                         itl_hist, n_hist, done_at, state, finish, done_j, trace, trace_cap, tr_i)
        if n_done > 0:
            for f in range(n_done):
                r = sched_req[done_j[f]]
                a = adapter[r]
                c = conv[r]
                if c >= 0 and history_on:
                    hist[3][c] -= 1
                    hx.keep(r, c, t_end, hist, blocks, computed, mem)
                else:
                    mem[0] += blocks[r]
                    blocks[r] = 0
                rc[a] -= 1
                if sched_mode == SCHED_MLQ:
                    if borrow[r] > 0:
                        borrowed -= borrow[r]
                    else:
                        used[req_q[r]] -= need_res[r]
                    bypass_of[r] = -1
                if rc[a] == 0:
                    n_distinct -= 1
                    if cache_mode == CACHE_DISCARD and qc[a] == 0 and ad_blocks[a] > 0 and ad_h[a, hx.AH_ENTRIES] == 0:
                        ad_state[a] = AD_HOST  # S-LoRA: an adapter no request uses leaves the GPU
                        mem[0] += ad_blocks[a]
                        mem[1] -= 1
            nrun = drop_finished(running, nrun, done_j, n_done, n_sched_running, n_kept)
        now = t_end
        step += 1

    counters = np.array([preemptions, int(stats[S_LOADS]), rejected, step, ts_i, tr_i], np.int64)
    return (state, first_tok, finish, itl_hist, counters, busy_s, ts[:ts_i], trace[:tr_i],
            stats)
