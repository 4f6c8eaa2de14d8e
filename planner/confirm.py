"""Confirm a plan in the digital twin, and tighten it where its predictor was optimistic.

A packer fills each GPU up to the edge its predictor draws, and a surrogate is a few per cent off the
twin right at that edge, so some GPUs of a surrogate's plan fall short when simulated. Every GPU is
therefore judged by the twin (:mod:`planner.verdict`, the very run `planner evaluate` makes), and the
twin's figures are the plan's. The GPUs that pass are kept. The adapters of the GPUs that fall short are
packed again, each new GPU planned to keep up with (1 + margin) x its load (:attr:`PackRequest.margin`),
the margin grown from the worst shortfall; only the GPUs packed anew are simulated again. Every packing
asks its predictor for the confirmation's bar (:attr:`PackRequest.bar`), so an accurate predictor
needs one round.

After :data:`SURROGATE_ROUNDS` such rounds the adapters still short are packed by the twin itself
(the judging run as the predictor, exact and slow; its GPUs pass by construction), so the loop ends on
any workload: a predictor that is wrong in a corner of the space it never saw costs time there, never a
plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from planner.greedy import Entry, plan_greedy
from planner.packing import GpuGroup, NotEnoughGpusError, PackRequest, group_scenario
from planner.prefix_search import shares_of
from planner.verdict import (
    CONFIRM_RATIO,
    DEFAULT_BAR,
    DEFAULT_RUN,
    ServiceBar,
    TwinCheck,
    TwinRun,
    twin_check,
)
from twin.errors import InfeasibleError
from twin.progress import counter

#: Each new round raises the load factor (1 + margin) by at least this fraction; by this one when
#: the only shortfall is latency (a GPU that keeps up gives no throughput ratio to size the step).
MIN_STEP = 0.04
LATENCY_STEP = 0.05
#: Packings by the plan's own predictor; then the twin packs what is still short. Each round repacks only
#: the adapters of the GPUs short in the last, so rounds are cheap; the twin's packing is not.
SURROGATE_ROUNDS = 6
#: Packings in all (a bound: the twin's own packing passes by construction).
MAX_ROUNDS = 8

Progress = Callable[[str], None]


def scenarios_of(req: PackRequest, groups: list[GpuGroup]):
    return [group_scenario(req, g.shares, g.a_max, max_lora_rank=g.max_lora_rank) for g in groups]


def check_groups(req: PackRequest, groups: list[GpuGroup], run: TwinRun, bar: ServiceBar,
                 progress: Callable[[int, int], None] | None = None) -> TwinCheck:
    """The twin's verdict on ``groups`` (each at its planned A_max and max_lora_rank)."""
    return twin_check(req.profile, req.policy, scenarios_of(req, groups), bar, run, progress)


def repacking(req: PackRequest, margin: float, bar: ServiceBar) -> PackRequest:
    """A packing round's request: keep up with (1 + ``margin``) x the load, meeting the bar (a group of few
    adapters with its own margin grown as much)."""
    few_margin = (1.0 + req.few_margin) * (1.0 + margin) / (1.0 + req.margin) - 1.0
    return replace(req, margin=margin, bar=bar, few_margin=few_margin)


def next_margin(margin: float, check: TwinCheck, bar: ServiceBar) -> float:
    """The margin of the next round: enough to bring the worst starving GPU's load down to what it
    sustained, and at least :data:`LATENCY_STEP` more when a GPU that keeps up misses its latency SLO."""
    factor = 1.0 + MIN_STEP
    up = check.keeps_up(bar)
    if not up.all():
        factor = max(factor, bar.min_served / float(check.ratio.min()))
    if (up & ~check.meets(bar)).any():
        factor = max(factor, 1.0 + LATENCY_STEP)
    return (1.0 + margin) * factor - 1.0


@dataclass(frozen=True)
class Confirmation:
    bar: ServiceBar
    run: TwinRun
    margin: float  # the largest load margin a GPU of the final plan was packed with
    rounds: int  # packings run (1: the first plan was confirmed as it was)
    repacked: int  # GPUs of earlier packings that fell short and had their adapters packed again
    twin_packed: int  # GPUs packed by the twin itself after the predictor's rounds
    rows: list[dict | None]  # per GPU of the final plan: its figures (TwinCheck.row); None: did not start
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        def worst(key, fn):
            values = [r[key] for r in self.rows if r is not None and r[key] is not None]
            return fn(values) if values else None

        return {
            **self.run.to_dict(), **self.bar.to_dict(),
            "margin": round(self.margin, 4), "rounds": self.rounds, "repacked_gpus": self.repacked,
            "twin_packed_gpus": self.twin_packed,
            "failing_gpus": sum(r is None or not r["meets"] for r in self.rows),
            "worst_served": worst("served", min), "worst_ttft_ms_p99": worst("ttft_ms_p99", max),
            "worst_tpot_ms_p99": worst("tpot_ms_p99", max), "wall_s": round(self.wall_s, 3),
        }


def judged(req: PackRequest, groups: list[GpuGroup], run: TwinRun, bar: ServiceBar,
           progress: Progress | None = None) -> Confirmation:
    """The twin's verdict on a finished plan, as it is (other algorithms than greedy: nothing repacked;
    a GPU that would not start in memory is not run and gets no row)."""
    t0 = time.perf_counter()
    starts = [k for k, g in enumerate(groups) if req.kv.tokens_for(g.a_max, g.max_lora_rank or req.kv.rank_for(
        int(req.ranks[g.members].max()))) is not None]
    check = check_groups(req, [groups[k] for k in starts], run, bar, _counter(progress, "twin check"))
    rows: list[dict | None] = [None] * len(groups)
    for j, k in enumerate(starts):
        rows[k] = check.row(j, bar)
    return Confirmation(bar, run, req.margin, 1, 0, 0, rows, time.perf_counter() - t0)


def pack_confirmed(req: PackRequest, split_hot: bool = True, balance: bool = True, run: TwinRun = DEFAULT_RUN,
                   bar: ServiceBar = DEFAULT_BAR, progress: Progress | None = None, entries: list[Entry] | None = None,
                   max_gpus: int | None = None,
                   observe: Callable[[list[GpuGroup], TwinCheck], None] | None = None,
                   first: list[GpuGroup] | None = None) -> tuple[list[GpuGroup], Confirmation]:
    """Pack ``entries`` (default: every adapter) with :func:`plan_greedy` on at most ``max_gpus`` (default
    ``req.max_gpus``), keep the GPUs the twin passes (``bar``), and pack the adapters of the others again
    with a larger ``req.margin`` (after :data:`SURROGATE_ROUNDS`, with the twin as the predictor) until every
    GPU passes. ``observe`` is shown each round's GPUs and the twin's verdict on them; ``first`` is the first
    round's packing where the caller already made it (``plan_greedy`` of ``req``'s entries: judged all the same).

    Raises :class:`InfeasibleError` when a repacking needs more GPUs than allowed, or when
    :data:`MAX_ROUNDS` packings still leave a GPU short.
    """
    t0 = time.perf_counter()
    margin = req.margin
    twin_margin = run.load - 1.0  # the twin packer asks the judging run itself
    confirmed: list[GpuGroup] = []
    rows: list[dict] = []
    limit = req.max_gpus if max_gpus is None else max_gpus
    repacked = twin_packed = 0
    own_twin = req.predictor.kind == "twin"
    for rounds in range(1, MAX_ROUNDS + 1):
        by_twin = own_twin or rounds > SURROGATE_ROUNDS
        if by_twin:
            round_req = repacking(twin_packer(req, run, bar), twin_margin, bar)
            if progress and not own_twin and rounds == SURROGATE_ROUNDS + 1:
                progress(f"the twin packs the {len(entries or [])} adapter entries still short (exact, slower)")
        else:
            round_req = repacking(req, margin, bar)
        try:  # the twin's fallback packing is not rebalanced: refills ask the twin again, for a few GPUs
            groups = first if rounds == 1 and first is not None else plan_greedy(
                round_req, split_hot, balance and (own_twin or not by_twin), entries, limit - len(confirmed))
        except InfeasibleError as exc:
            raise exc if rounds == 1 else _repack_failed(exc, repacked, round_req.margin) from None
        twin_packed += len(groups) if by_twin and not own_twin else 0
        check = check_groups(req, groups, run, bar, _counter(progress, f"twin check, round {rounds}"))
        if observe:
            observe(groups, check)
        good = check.meets(bar)
        confirmed += [g for g, ok in zip(groups, good) if ok]
        rows += [check.row(k, bar) for k in np.flatnonzero(good)]
        still_short = ~good
        if not still_short.any():
            return confirmed, Confirmation(bar, run, round_req.margin, rounds, repacked, twin_packed, rows,
                                           time.perf_counter() - t0)
        short = [g for g, bad in zip(groups, still_short) if bad]
        repacked += len(short)
        if by_twin:
            twin_margin = next_margin(twin_margin, check.select(still_short), bar)
        else:
            margin = next_margin(margin, check.select(still_short), bar)
        entries = list(shares_of([e for g in short for e in g.shares.items()]).items())
        _report(progress, check, still_short, twin_margin if by_twin else margin, bar)
    raise _still_short(max(margin, twin_margin))


def twin_packer(req: PackRequest, run: TwinRun, bar: ServiceBar) -> PackRequest:
    """``req`` with the judging twin run as its predictor: asked about ``run.load`` x a group's traffic (the
    round's margin, from ``run.load - 1``; the run scales it with request sizes itself), its answers are the
    verdict's, so no edge classifier second-guesses them and its TPOT meets the limits as they are."""
    return replace(req, predictor=run.predictor(req.profile, req.policy, bar), size_margin=0.0, few=None,
                   edge=False, tpot_aim=0.0)


def _counter(progress: Progress | None, what: str) -> Callable[[int, int], None] | None:
    """A (done, of) callback showing the twin's way through the GPUs of one check, where ``progress`` reports."""
    return None if progress is None else counter(what, unit="GPU")


def _report(progress: Progress | None, check: TwinCheck, short: np.ndarray, margin: float, bar: ServiceBar) -> None:
    """``short``: the groups packed again."""
    if progress:
        slow = int((check.keeps_up(bar) & short).sum())
        progress(f"twin check: {int(short.sum())} of {len(short)} GPUs fall short (worst serves "
                 f"{check.ratio.min():.1%} of its load{f'; {slow} miss their latency SLO' if slow else ''}); "
                 f"packing their adapters again with a {margin:.1%} load margin")


def _repack_failed(exc: InfeasibleError, repacked: int, margin: float) -> InfeasibleError:
    message = (f"{exc} (the twin found {repacked} GPU(s) short, so adapters were packed again to keep up with "
               f"{1 + margin:.3g}x their load)")
    return NotEnoughGpusError(message, exc.adapter_ids) if isinstance(exc, NotEnoughGpusError) else InfeasibleError(
        message)


def _still_short(margin: float) -> InfeasibleError:
    return InfeasibleError(f"the twin still finds GPUs short after {MAX_ROUNDS} packings (load margin "
                           f"{margin:.1%}); plan with --predictor twin or allow a longer TTFT")


__all__ = ["CONFIRM_RATIO", "Confirmation", "judged", "pack_confirmed"]
