"""``greedy``: our first-fit-decreasing packer (the default algorithm).

Same adapter order as the study (rank groups largest first, rates zigzag), but each GPU takes the
*largest* prefix of the remaining queue that its best A_max keeps from starving — found by
exponential + binary search instead of the study's fixed testing points — and A_max is chosen
among every memory-feasible candidate, not just the current and the next grid value. A GPU is
therefore filled to its packing limit (Max_pack) rather than to the last testing point below it.

Then, with the number of GPUs fixed, the plan is rebalanced: the same fill is rerun with a cap on
each GPU's arriving load, bisected down to the smallest cap that still fits, so spare capacity is
spread over every GPU instead of left on the last one.

With a compiled-tree predictor each search runs in one compiled call (:mod:`planner.prefix_search`).

An adapter too hot for one GPU on its own is split into replicas with routing weights (each replica
gets an equal share of its traffic), unless ``split_hot`` is off, in which case the plan is
infeasible.
"""

from __future__ import annotations

import math

import numpy as np

from planner.packing import GpuGroup, PackRequest, a_max_limit, best_a_max, not_enough_gpus, priority_order
from planner.prefix_search import Entry, PrefixSearch, shares_of
from twin.errors import InfeasibleError

#: Replicas of a hot adapter are sized to this fraction of what one GPU sustains alone.
HOT_REPLICA_FILL = 0.9
#: Relative precision of the balancing bisection on the per-GPU load cap.
BALANCE_TOLERANCE = 0.02


def plan_greedy(req: PackRequest, split_hot: bool = True, balance: bool = True,
                entries: list[Entry] | None = None, max_gpus: int | None = None) -> list[GpuGroup]:
    """Pack every adapter of ``req`` (or just ``entries``: adapter index, traffic share) on at most
    ``max_gpus`` (default ``req.max_gpus``) GPUs."""
    if entries is None:
        entries = [(i, 1.0) for i in range(len(req.ranks))]
    share = dict(entries)
    order = priority_order(req.ranks, req.rates_rps)
    queue: list[Entry] = [(i, share[i]) for i in order if i in share]
    _check_servable(req, queue)
    limit = req.max_gpus if max_gpus is None else max_gpus
    search = PrefixSearch(req, queue)
    spans = _fill(search, None, limit, split_hot)
    if balance and len(spans) > 1:
        spans = _balanced(search, spans)
    return [GpuGroup(shares_of(queue[pos:pos + k]), a_max) for pos, k, a_max in spans]


def _check_servable(req: PackRequest, queue: list[Entry]) -> None:
    unstartable = [r for r in set(req.ranks.tolist()) if a_max_limit(req.kv, [r]) < 1]
    idx = np.array([i for i, _ in queue], np.int64)
    bad = idx[np.isin(req.ranks[idx], unstartable)].tolist()
    if bad:
        ids = ", ".join(req.adapter_id(i) for i in bad[:8])
        raise InfeasibleError(f"memory error: profile {req.profile.profile_id} starts no engine with "
                              f"--max-lora-rank {int(req.ranks[bad[0]])} (adapters {ids})")


Span = tuple[int, int, int]  # a GPU's queue entries queue[pos:pos+k] and its A_max


def _fill(search: PrefixSearch, load_cap: float | None, max_gpus: int, split_hot: bool,
          before: list[Span] = ()) -> list[Span]:
    """Fill GPUs one after another with the largest feasible prefix of the search's queue (``before``: a fill
    under another cap, whose GPU bounds the search takes as guesses).

    The queue is modified in place when a hot adapter at its head is split into replicas (only past
    the spans already filled, so they stay valid).
    """
    req, queue = search.req, search.queue
    spans: list[Span] = []
    pos = 0
    while pos < len(queue):
        if len(spans) == max_gpus:
            raise not_enough_gpus(req, sorted({i for i, _ in queue[pos:]}), len(spans))
        guess = None
        if len(spans) < len(before):
            start, length, _ = before[len(spans)]
            guess = start + length - pos if start + length > pos else None
        k, a_max = _largest_prefix(search, pos, load_cap, guess)
        if k == 0:
            if load_cap is not None:  # the cap is below this adapter's own load: the cap is too low
                raise not_enough_gpus(req, sorted({i for i, _ in queue[pos:]}), len(spans))
            _split_head(req, queue, pos, split_hot)
            search.reset()
            continue
        spans.append((pos, k, a_max))
        pos += k
    return spans


def _largest_prefix(search: PrefixSearch, pos: int, load_cap: float | None,
                    guess: int | None = None) -> tuple[int, int]:
    """Largest k such that queue[pos:pos+k] passes the GPU test (within ``load_cap`` arriving tok/s), and
    the A_max it passes with."""
    k_max = len(search.queue) - pos
    if load_cap is not None:
        cum = np.cumsum(search.entry_loads()[pos:])
        k_max = max(1, int(np.searchsorted(cum, load_cap * (1 + 1e-9), side="right")))
    return search.largest(pos, k_max, guess)


def _split_head(req: PackRequest, queue: list[Entry], pos: int, split_hot: bool) -> None:
    """The adapter at queue[pos] starves a GPU on its own: replace it by equal-share replicas."""
    i, share = queue[pos]
    lo, hi = 0.0, share  # fraction of its traffic one GPU sustains alone: ok at lo, not at hi
    for _ in range(12):
        mid = (lo + hi) / 2
        if best_a_max(req, {i: mid}).ok:
            lo = mid
        else:
            hi = mid
    rate = float(req.rates_rps[i] * share)
    if lo <= 0.0:
        raise InfeasibleError(f"adapter {req.adapter_id(i)} cannot be served by any GPU of profile "
                              f"{req.profile.profile_id}, even at a tiny share of its traffic{_own_slo(req, i)}")
    if not split_hot:
        raise InfeasibleError(
            f"adapter {req.adapter_id(i)} is too hot for one GPU: {rate:.3g} req/s arriving, one GPU of "
            f"profile {req.profile.profile_id} keeps up with about {rate * lo / share:.3g} req/s of it; "
            "allow replicas (drop --no-split-hot) or lower its rate")
    n = math.ceil(share / (lo * HOT_REPLICA_FILL))
    queue[pos:pos + 1] = [(i, share / n)] * n


def _balanced(search: PrefixSearch, fill: list[Span]) -> list[Span]:
    """Rerun the fill with the smallest per-GPU load cap that still fits in as many GPUs (the queue is
    not changed: a capped fill splits no adapter, so the search's answers stay valid)."""
    req, queue, n_gpus = search.req, search.queue, len(fill)
    per_adapter = req.arriving_tok_s
    loads = [sum(per_adapter[i] * s for i, s in shares_of(queue[pos:pos + k]).items()) for pos, k, _ in fill]
    lo = float(sum(loads)) / n_gpus  # no cap below the mean fits
    hi = max(loads)
    best = fill
    while hi - lo > BALANCE_TOLERANCE * hi:
        cap = (lo + hi) / 2
        try:
            best = _fill(search, cap, n_gpus, split_hot=False, before=best)
            hi = cap
        except InfeasibleError:
            lo = cap
    return best


def _own_slo(req: PackRequest, i: int) -> str:
    """Adapter ``i``'s own latency limits (the workload's max_ttft_s / max_tpot_ms), as the likely cause."""
    limits = (("max_ttft_s", req.adapter_ttft_s), ("max_tpot_ms", req.adapter_tpot_ms))
    own = [f"{name} {v[i]:g}" for name, v in limits if v is not None and np.isfinite(v[i])]
    if not own:
        return ""
    return f" within its own {' and '.join(own)} (loosen {'it' if len(own) == 1 else 'them'} in the workload)"
