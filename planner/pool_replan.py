"""Re-plan a pool plan: each kind's GPUs re-planned as ``planner replan`` re-plans a plan of one profile.

An adapter stays on the kind it is on (moving kinds would stop it on one set of hosts and start it on
another); a new adapter, or one its kind can no longer serve, goes to the kind that serves the previous plan's
tokens at the lowest price (price per hour of its GPUs over the tokens they serve), else to the cheapest kind
that can serve it. Where a kind at its ``count`` has no room for adapters with the new traffic, those go to the
next kind in that order that serves them, and the kinds are re-planned again (a move the SLO forces, made
whatever the churn budget); the GPUs of a kind with a cheaper kind of the same profile that has a count are
emptied into that one where it holds them within its count and that costs less (within the churn budget; up to
:data:`BACK_ROUNDS` times). The churn budget is spent kind by kind in the pool's order; ``--gpu-tolerance`` holds
per kind. Which kinds to use is chosen again by a fresh ``planner plan --pool``, not by a re-plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from models.scenario import Predictor
from planner.confirm import Progress
from planner.packing import NotEnoughGpusError, listed
from planner.placement import Placement, engine_settings
from planner.plan import UNLIMITED_GPUS, PlanOptions
from planner.pool import GPU_RESOURCE, GpuKind, Kind, Pool
from planner.pool_plan import PoolPlanner, instance_prefix, pool_placement
from planner.replan import ChurnBudget, changes, replan
from planner.verdict import ServiceBar
from twin.errors import InfeasibleError
from twin.profile import Profile, recorded_profile
from twin.workload import Workload

#: Times a re-plan empties dearer GPUs into a cheaper kind of the same profile, each from the last one's result.
BACK_ROUNDS = 4


def recorded_pool(previous: Placement) -> Pool:
    """The pool a plan was made over, as it recorded it (kinds, profiles, prices, counts, node selectors)."""
    kinds = []
    for k in previous.kinds().values():
        profile = recorded_profile(k)
        # plans before vllm-cpu kinds asked no GPU recorded the GPU default for them too
        resource = None if profile.engine.device == "cpu" and k.get("resource") == GPU_RESOURCE else k.get("resource")
        kinds.append(Kind(GpuKind(name=k["name"], profile=k["profile_id"], price_per_hour=k["price_per_hour"],
                                  count=k.get("count"), node_selector=k["node_selector"], resource=resource), profile))
    pool = previous.inputs["pool"]
    return Pool(str(pool.get("path", "")), str(pool.get("sha256", "")), tuple(kinds))


def replan_pool(previous: Placement, workload_path, workload: Workload, opts: PlanOptions,
                predictor_for: Callable[[Profile], Predictor], bar_for: Callable[[Placement, Profile], ServiceBar],
                split_hot: bool, budget: ChurnBudget, progress: Progress | None = None) -> Placement:
    """Re-plan ``previous`` (a pool plan) for ``workload``; ``bar_for(kind's part, profile)`` is the bar a kind's
    GPUs are judged by (the part's recorded one, with the user's overrides)."""
    pool = recorded_pool(previous)
    planner = PoolPlanner(workload, pool, predictor_for, opts, progress)
    order = _kind_order(previous, pool)
    kind_of = _kinds_tonight(previous, workload, pool, planner, order)
    index = {a.adapter_id: i for i, a in enumerate(workload.adapters)}
    closed = np.zeros((len(pool.kinds), len(workload)), bool)  # kinds found with no room for an adapter
    spilled: dict[str, str] = {}

    def run(kinds: np.ndarray, why: dict[str, str]) -> Placement:
        return _replan_kinds(previous, workload_path, planner, kinds, why, opts, bar_for, split_hot, budget, progress)

    while True:
        try:
            result, why = run(kind_of, spilled), spilled
            for _ in range(BACK_ROUNDS):
                back = _back_to_cheaper(result, kind_of, why, planner, order, index, budget, run, progress)
                if back is None:
                    break
                result, kind_of, why = back
            return result
        except _KindFull as full:
            j, kind = full.kind, pool.kinds[full.kind]
            ids = full.error.adapter_ids
            if not ids:
                raise full.error from None
            at = np.array([index[a] for a in ids], np.int64)
            closed[j, at] = True
            open_kinds = [[k for k in order if planner.servable[pool.kinds[k].name][i] and not closed[k, i]]
                          for i in at]
            if not all(open_kinds):
                stuck = [a for a, o in zip(ids, open_kinds) if not o]
                raise InfeasibleError(
                    f"kind {kind.name} is at its count ({_gpus(kind.spec.count)}) and has no room for "
                    f"{listed(stuck)} with this traffic, and no other kind of the pool serves "
                    f"{'it' if len(stuck) == 1 else 'them'} with room left; a re-plan keeps adapters on their "
                    "kinds: `planner plan --pool` chooses every adapter's kind again (more moves), or raise the "
                    "counts") from None
            for i, a, o in zip(at, ids, open_kinds):
                kind_of[i] = o[0]
                spilled[a] = f"kind {kind.name} is at its count ({_gpus(kind.spec.count)}) and has no room for it"
            if progress:
                progress(f"kind {kind.name}: at its count of {_gpus(kind.spec.count)} with no room for "
                         f"{listed(list(ids))}: moving {'it' if len(ids) == 1 else 'them'} to the next kind "
                         "and re-planning the kinds again")


def _back_to_cheaper(result: Placement, kind_of: np.ndarray, why: dict[str, str], planner: PoolPlanner,
                     order: list[int], index: dict[str, int], budget: ChurnBudget,
                     run: Callable[[np.ndarray, dict[str, str]], Placement],
                     progress: Progress | None) -> tuple[Placement, np.ndarray, dict[str, str]] | None:
    """``result`` (re-planned with ``kind_of``, moves ``why``) with the GPUs of a kind emptied into a cheaper kind
    of the same profile that has a count (an adapter spilled there on a busy night comes back when it quietens):
    all of them, else half, else the least loaded one, within ``budget``'s moves, where the kinds re-planned with
    those adapters there (``run``) hold them within the count and cost less; with its kinds and moves. None where
    none does."""
    pool = planner.pool
    cost = result.summary()["cost_per_hour"]
    for c in order:
        cheap = pool.kinds[c]
        dear = {k.name for k in pool.kinds
                if k.price > cheap.price and k.profile.profile_id == cheap.profile.profile_id}
        gpus = sorted((i for i in result.instances if i.kind in dear), key=lambda i: i.arriving_tok_s)
        if cheap.spec.count is None or not gpus:
            continue  # an unlimited cheaper kind of the same profile is never left for a dearer one
        moves = None if budget.max_moves is None else budget.max_moves - len(result.changes["moved_adapters"])
        for take in sorted({len(gpus), len(gpus) // 2, 1} - {0}, reverse=True):
            moving = sorted({a for inst in gpus[:take] for a in inst.adapters})
            if moves is not None and len(moving) > moves:
                continue
            trial = kind_of.copy()
            trial[[index[a] for a in moving]] = c
            if progress:
                progress(f"kind {cheap.name}: trying the adapters of {_gpus(take)} of {', '.join(sorted(dear))} "
                         "there (cheaper, the same profile)")
            moved = {**why, **{a: f"back to kind {cheap.name}: cheaper, with room under its count" for a in moving}}
            try:
                back = run(trial, moved)
            except _KindFull:
                continue
            if back.summary()["cost_per_hour"] < cost - 1e-9:
                return back, trial, moved
    return None


class _KindFull(Exception):
    """Re-planning the kind ``kind`` (pool index) ran out of its count (``error`` names the adapters left)."""

    def __init__(self, kind: int, error: NotEnoughGpusError):
        super().__init__(str(error))
        self.kind, self.error = kind, error


def _replan_kinds(previous: Placement, workload_path, planner: PoolPlanner, kind_of: np.ndarray,
                  spilled: dict[str, str], opts: PlanOptions, bar_for, split_hot: bool, budget: ChurnBudget,
                  progress: Progress | None) -> Placement:
    """Each kind's GPUs re-planned for the adapters ``kind_of`` puts on it (``spilled``: adapters moved off a
    kind at its count, with why); :class:`_KindFull` where a kind with a count has no room."""
    pool = planner.pool
    parts = {kind["name"]: part for kind, part in previous.by_kind()}
    out_parts, restarts, reasons, held_back, fresh = [], {}, {}, [], 0
    left = budget
    for j, kind in enumerate(pool.kinds):
        members = np.flatnonzero(kind_of == j)
        if not len(members):
            continue  # its GPUs, if any, are removed
        part = parts.get(kind.name) or Placement({"profile_id": kind.profile.profile_id}, [], [],
                                                 engine_settings(kind.profile))
        bar = bar_for(part, kind.profile)
        req = replace(planner.request(kind, members, replace(planner.opts, slowdown=bar.slowdown, few=bar.few)),
                      max_gpus=kind.spec.count or UNLIMITED_GPUS)
        if progress:
            progress(f"kind {kind.name}: re-planning {len(members):,} adapters on {len(part.instances)} GPU(s)")
        try:
            new = replan(part, workload_path, req, split_hot=split_hot, confirm=opts.confirm, run=opts.run, bar=bar,
                         budget=left, progress=progress, id_prefix=instance_prefix(kind), with_bound=False)
        except NotEnoughGpusError as exc:
            if kind.spec.count is None:
                raise
            raise _KindFull(j, exc) from None
        ch = new.changes
        restarts.update({i["instance_id"]: i["restart_because"] for i in ch["instances"] if i["restart"]})
        reasons.update({m["adapter_id"]: m["reason"] for m in ch["moves"]})
        held_back += ch.get("held_back", [])
        fresh += ch.get("fresh_plan_gpus") or 0
        left = _spent(left, len(ch["moved_adapters"]), len(ch["restarts"]))
        out_parts.append((kind, new.instances, new.inputs.get("confirmation")))
    placement = pool_placement(workload_path, planner, out_parts, [])
    placement.changes = changes(previous, placement, restarts, {**reasons, **spilled}, fresh)
    placement.changes["held_back"] = held_back
    return placement


def _gpus(count: int) -> str:
    return f"{count} GPU{'' if count == 1 else 's'}"


def _kind_order(previous: Placement, pool: Pool) -> list[int]:
    """The pool's kinds (indices), cheapest first: by the price of the tokens they served in ``previous``, then
    by the price of a GPU."""
    cost = [_price_per_token(previous, k) for k in pool.kinds]
    return sorted(range(len(pool.kinds)), key=lambda j: (cost[j], pool.kinds[j].price))


def _kinds_tonight(previous: Placement, workload: Workload, pool: Pool, planner: PoolPlanner,
                   order: list[int]) -> np.ndarray:
    """Per workload adapter, the index of the kind it is re-planned on (module docstring; ``order``:
    :func:`_kind_order`)."""
    index = {k.name: j for j, k in enumerate(pool.kinds)}
    was = {}
    for inst in previous.instances:
        for a in inst.adapters:
            was.setdefault(a, index[inst.kind])
    served = np.array([planner.servable[k.name] for k in pool.kinds])  # kinds x adapters
    out = np.empty(len(workload), np.int64)
    for i, a in enumerate(workload.adapters):
        j = was.get(a.adapter_id)
        out[i] = j if j is not None and served[j, i] else next(k for k in order if served[k, i])
    return out


def _price_per_token(previous: Placement, kind: Kind) -> float:
    """The price per hour of the kind's GPUs in ``previous`` over the tokens/s they serve (inf: it served none)."""
    insts = [i for i in previous.instances if i.kind == kind.name]
    tok = sum(i.arriving_tok_s for i in insts)
    return kind.price * len(insts) / tok if tok > 0 else math.inf


def _spent(budget: ChurnBudget, moves: int, restarts: int) -> ChurnBudget:
    return replace(budget, max_moves=None if budget.max_moves is None else max(0, budget.max_moves - moves),
                   max_restarts=None if budget.max_restarts is None else max(0, budget.max_restarts - restarts))
