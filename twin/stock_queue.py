"""The stock loop's waiting queue (``twin.core``): vLLM's admission order without scanning the queue.

The queue order is a key per request: arrivals get their arrival index (increasing), preempted requests
get ever smaller negative keys (front). Requests of one adapter are always admitted in key order, so each
adapter keeps its own queue: a stack of preempted requests (linked list) in front of a pointer into its
arrivals. While fewer than ``max_loras`` adapters run, the next request is the head of the whole queue:
the last preempted request still waiting (a stack of them, stale entries dropped when they reach the top),
else the first arrival still waiting (a pointer that only moves forward), both O(1) amortised. Once the
LoRA set is full, a tournament tree over the adapters that have running requests gives, in O(log
adapters), the one whose head has the smallest key; an adapter whose head changed is marked stale and its
leaf updated just before the tree is read. Skipped requests never move, so the admission order is exactly
vLLM's.

The phases here are inlined into the stock loop (see "Phases" in ``twin.core``); numba's on-disk cache of
that loop is keyed on twin/core.py only: after editing this module, touch core.py.
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

from twin.states import REJECTED, WAITING

INF_KEY = np.int64(2**62)


class Queues(NamedTuple):
    """The waiting queue's structures (per request, per adapter, and the tree of running adapters)."""

    ad_list: np.ndarray  # per-adapter request lists (CSR over ad_start), arrival order
    qkey: np.ndarray  # per request: its key in the queue order
    stack_next: np.ndarray  # per request: the preempted request under it on its adapter's stack (int32)
    stack_top: np.ndarray  # per adapter: its last preempted request still waiting (-1: none)
    arr_ptr: np.ndarray  # per adapter: its next arrival not yet admitted
    arr_end: np.ndarray  # per adapter: one past its last arrived request
    run_count: np.ndarray  # per adapter: its running requests
    stale: np.ndarray  # per adapter: running, and its head changed since its leaf was written
    stale_list: np.ndarray  # the stale adapters (the first ``n_stale``)
    set_keys: np.ndarray  # the tree of running adapters (heap order, leaves from len/2): smallest head key
    set_idx: np.ndarray  # ... and the adapter holding it
    pre_req: np.ndarray  # preempted requests, latest on top ...
    pre_key: np.ndarray  # ... with the key each got (one no longer waiting with it is dropped at the top)


@nb.njit(cache=True)
def waiting_queues(ad_start, ad_list, n):
    """Empty queues for ``n`` requests of ``len(ad_start) - 1`` adapters."""
    na = ad_start.shape[0] - 1
    size = 1
    while size < na:
        size *= 2
    set_keys = np.full(2 * size, INF_KEY, np.int64)
    set_idx = np.zeros(2 * size, np.int64)
    for a in range(size):
        set_idx[size + a] = a
    for p in range(size - 1, 0, -1):
        set_idx[p] = set_idx[2 * p]
    return Queues(ad_list, np.zeros(n, np.int64), np.full(n, -1, np.int32), np.full(na, -1, np.int64),
                  ad_start[:-1].copy(), ad_start[:-1].copy(), np.zeros(na, np.int64), np.zeros(na, np.bool_),
                  np.empty(na, np.int64), set_keys, set_idx, np.empty(n + 1, np.int32), np.empty(n + 1, np.int64))


@nb.njit(cache=True, inline="always")
def tree_update(qs, a, key):
    """Set adapter ``a``'s leaf of the tree of running adapters to ``key`` and replay the matches above it,
    stopping where a winner is unchanged."""
    keys, idxs = qs.set_keys, qs.set_idx
    pos = keys.shape[0] // 2 + a
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
def drop_readmitted(pre_req, pre_key, n_pre, state, qkey):
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


@nb.njit(cache=True, inline="always")
def mark_stale(qs, a, n_stale):
    """Mark adapter ``a``'s head changed (once); returns the stale count."""
    if not qs.stale[a]:
        qs.stale[a] = True
        qs.stale_list[n_stale] = a
        n_stale += 1
    return n_stale


@nb.njit(cache=True, inline="always")
def arrive(now, qs, arrival, adapter, state, next_arr, in_flight, max_in_flight, n_waiting, rejected, n_stale):
    """Arrivals up to ``now`` join the back of the queue (or are refused over the client's cap)."""
    while next_arr < arrival.shape[0] and arrival[next_arr] <= now:
        r = next_arr
        a = adapter[r]
        was_empty = qs.stack_top[a] < 0 and qs.arr_ptr[a] == qs.arr_end[a]
        qs.arr_end[a] += 1
        if max_in_flight > 0 and in_flight + n_waiting >= max_in_flight:
            state[r] = REJECTED
            rejected += 1
        else:
            state[r] = WAITING
            qs.qkey[r] = r
            n_waiting += 1
        next_arr += 1
        if was_empty and qs.run_count[a] > 0:  # otherwise its leaf stays as it is
            n_stale = mark_stale(qs, a, n_stale)
    return next_arr, n_waiting, rejected, n_stale


@nb.njit(cache=True, inline="always")
def requeue(qs, v, av, front, n_pre, state):
    """Put the preempted request ``v`` (adapter ``av``) at the front of the queue, key ``-front``; returns
    the preempted stack's size and whether ``av`` stopped running."""
    qs.qkey[v] = -front
    qs.stack_next[v] = qs.stack_top[av]
    qs.stack_top[av] = v
    qs.run_count[av] -= 1
    tree_update(qs, av, qs.qkey[v] if qs.run_count[av] > 0 else INF_KEY)
    if n_pre == qs.pre_req.shape[0]:
        n_pre = drop_readmitted(qs.pre_req, qs.pre_key, n_pre, state, qs.qkey)
    qs.pre_req[n_pre] = v
    qs.pre_key[n_pre] = qs.qkey[v]
    return n_pre + 1, qs.run_count[av] == 0


@nb.njit(cache=True, inline="always")
def next_adapter(qs, state, adapter, lora_set_full, n_pre, first_wait, next_arr, n_stale):
    """The adapter whose queue holds the next request to admit: the whole queue's head, or, once the LoRA
    set is full, the running adapter with the smallest head key; -1 when none. Returns it with the updated
    preempted-stack size, first-waiting pointer and stale count."""
    if not lora_set_full:
        while n_pre > 0 and (state[qs.pre_req[n_pre - 1]] != WAITING
                             or qs.qkey[qs.pre_req[n_pre - 1]] != qs.pre_key[n_pre - 1]):
            n_pre -= 1
        if n_pre > 0:
            return np.int64(adapter[qs.pre_req[n_pre - 1]]), n_pre, first_wait, n_stale
        while first_wait < next_arr and (state[first_wait] != WAITING or qs.qkey[first_wait] != first_wait):
            first_wait += 1
        if first_wait == next_arr:
            return np.int64(-1), n_pre, first_wait, n_stale
        a = np.int64(adapter[first_wait])
        while state[qs.ad_list[qs.arr_ptr[a]]] == REJECTED:  # arrivals refused ahead of it
            qs.arr_ptr[a] += 1
        return a, n_pre, first_wait, n_stale
    while n_stale > 0:
        n_stale -= 1
        a = qs.stale_list[n_stale]
        qs.stale[a] = False
        while qs.arr_ptr[a] < qs.arr_end[a] and state[qs.ad_list[qs.arr_ptr[a]]] == REJECTED:
            qs.arr_ptr[a] += 1
        head = INF_KEY
        if qs.run_count[a] > 0 and qs.stack_top[a] >= 0:
            head = qs.qkey[qs.stack_top[a]]
        elif qs.run_count[a] > 0 and qs.arr_ptr[a] < qs.arr_end[a]:
            head = qs.qkey[qs.ad_list[qs.arr_ptr[a]]]
        tree_update(qs, a, head)
    if qs.set_keys[1] == INF_KEY:
        return np.int64(-1), n_pre, first_wait, n_stale  # every waiting request is skipped for the LoRA limit
    return qs.set_idx[1], n_pre, first_wait, n_stale


@nb.njit(cache=True, inline="always")
def pop_head(qs, a, from_stack, r, n_stale):
    """Take request ``r``, the head of adapter ``a``'s queue, off it (its new head reaches the tree when read)."""
    if from_stack:
        qs.stack_top[a] = qs.stack_next[r]
    else:
        qs.arr_ptr[a] += 1
    return mark_stale(qs, a, n_stale)
