"""Confirm a surrogate-made plan in the digital twin, and tighten it where the surrogate was optimistic.

A packer fills each GPU up to the edge the predictor draws, and a surrogate's throughput is a few
per cent off the twin's right at that edge (issue 4: 2.2 % SMAPE on held-out scenarios), so some GPUs
of a surrogate plan starve when simulated. After packing, every GPU is run in the twin — the very run
`planner evaluate` makes by default (3600 simulated s, seed 0, Poisson arrivals). The GPUs it confirms
are kept. A GPU that falls short is run in the twin at each other ``--max-loras`` its memory starts
with, and kept with the one that serves it best if that one meets the bar (:func:`retune`): a
predictor's error is not even over A_max. The small trees, for one, give large groups at A_max 8 one
leaf's served fraction whatever their load (96.6 % where the twin finds 91 % on 10,000 adapters) and
under-rate A_max 16 and 32 for them, so no load margin moves them off 8. The adapters of the GPUs
still short are packed again, each new GPU planned to keep up with (1 + margin) x its load
(:attr:`PackRequest.margin`), the margin grown from the worst such GPU's shortfall; only the GPUs
packed anew are simulated again. Every packing of a confirmed plan asks the surrogate for the
confirmation's bar (:attr:`PackRequest.min_ratio` = the bar's share of the load served, not only
"not starved"), so an accurate surrogate needs no second round. On the paper's 117 workloads this
packs the same GPUs as asking only "not starved" and repacking after the twin, with 82 packings
instead of 101 (before retuning existed).

What a GPU must show is a :class:`ServiceBar`: by default it serves :data:`CONFIRM_RATIO` of its
arriving tokens (``planner plan --min-served``). One seed decides at or above that ratio; a lower bar
(down to the starvation rule's 0.9, the density the paper's greedy packs to) is met only if it holds
with :data:`EXTRA_SEEDS` as well, because close to the rule a GPU's ratio varies between arrival seeds
and some GPUs collapse (one at 0.946 with seed 0 served 0.84 with seed 1: high/low/128 at a 0.92 bar).
The 90 % rule tolerates a standing queue: a GPU serving 95 % of its arrivals over an hour may hold
minutes of backlog. With a p99 TTFT limit (``planner plan --max-ttft``), a GPU is confirmed only if it
also meets that limit in the twin, and the same retuning and repacking apply (the surrogates predict
no latency). ``replan`` repacks only: a previous GPU that falls short gives up its adapters.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from models.predictor import TwinPredictor
from planner.greedy import Entry, plan_greedy
from planner.packing import GpuGroup, PackRequest, a_max_candidates, group_scenario
from planner.prefix_search import shares_of
from twin.errors import BadInputError, InfeasibleError
from twin.simulate import STARVATION_THRESHOLD

#: The twin run of each GPU: that of `planner evaluate`'s defaults, so a confirmed plan evaluates as ok.
CONFIRM_DURATION_S = 3600.0
CONFIRM_SEED = 0
#: By default a GPU is confirmed when its simulated throughput is at least this fraction of its arriving
#: tokens: the starvation threshold plus 0.05 for the noise between one seed and another. Near the limit a
#: GPU holds a standing queue whose size varies a lot with the arrivals: GPUs at 0.914 and 0.946 with seed
#: 0 fell below 0.9 with seed 1 (placement_comparison: mixed/high/384 and high/low/128). A lower bar
#: needs :data:`EXTRA_SEEDS` below this ratio. Rounded: 0.9 + 0.05 is 0.9500000000000001 in floating point.
CONFIRM_RATIO = round(STARVATION_THRESHOLD + 0.05, 9)
#: Below :data:`CONFIRM_RATIO` (a lower ``--min-served``), a GPU must also meet the bar with these seeds.
#: They differ from ``planner evaluate --seed`` 1, which benchmarks use as an independent check.
EXTRA_SEEDS = (101, 102, 103, 104)
#: With a p99 TTFT limit, a GPU must also finish this fraction of its arrivals within the window
#: (requests still queued at its end have no TTFT, so they would otherwise escape the percentile).
MIN_FINISHED = 0.99
#: Each new round raises the load factor (1 + margin) by at least this fraction; by this one when
#: the only shortfall is latency (a GPU that keeps up gives no throughput ratio to size the step).
MIN_STEP = 0.04
LATENCY_STEP = 0.05
MAX_ROUNDS = 8

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ServiceBar:
    """What the twin must show for a GPU to be confirmed."""

    min_served: float = CONFIRM_RATIO  # fraction of its arriving tokens served in the window
    max_ttft_s: float | None = None  # p99 time to first token, with MIN_FINISHED of the arrivals finished

    def __post_init__(self) -> None:
        if not STARVATION_THRESHOLD <= self.min_served < 1.0:
            raise BadInputError(f"the share of its arriving tokens a GPU must serve (--min-served) must be in "
                                f"[{STARVATION_THRESHOLD:g}, 1): below {STARVATION_THRESHOLD:g} it starves; got "
                                f"{self.min_served:g}")

    @property
    def seeds(self) -> tuple[int, ...]:
        """The arrival seeds a GPU is checked with (the extra ones only where the first leaves it below
        :data:`CONFIRM_RATIO`)."""
        return (CONFIRM_SEED,) if self.min_served >= CONFIRM_RATIO else (CONFIRM_SEED, *EXTRA_SEEDS)


DEFAULT_BAR = ServiceBar()


@dataclass(frozen=True)
class TwinCheck:
    """The twin's verdict on a list of GPU groups, one entry per group (the worst over the seeds run)."""

    ratio: np.ndarray  # throughput / arriving tokens
    ttft_ms_p99: np.ndarray  # of finished requests
    finished: np.ndarray  # fraction of arrivals finished in the window

    def keeps_up(self, bar: ServiceBar) -> np.ndarray:
        return self.ratio >= bar.min_served

    def meets(self, bar: ServiceBar) -> np.ndarray:
        ok = self.keeps_up(bar)
        if bar.max_ttft_s is not None:
            ok &= (self.ttft_ms_p99 <= bar.max_ttft_s * 1000.0) & (self.finished >= MIN_FINISHED)
        return ok

    def select(self, mask: np.ndarray) -> TwinCheck:
        """The verdicts of the groups where ``mask`` is true."""
        return TwinCheck(self.ratio[mask], self.ttft_ms_p99[mask], self.finished[mask])

    def worst(self, other: TwinCheck, mask: np.ndarray) -> TwinCheck:
        """This check with the groups where ``mask`` is true replaced by the worse of it and ``other``
        (one entry per such group)."""
        ratio, ttft, finished = self.ratio.copy(), self.ttft_ms_p99.copy(), self.finished.copy()
        ratio[mask] = np.minimum(ratio[mask], other.ratio)
        ttft[mask] = np.maximum(ttft[mask], other.ttft_ms_p99)
        finished[mask] = np.minimum(finished[mask], other.finished)
        return TwinCheck(ratio, ttft, finished)


def twin_check(req: PackRequest, groups: list[GpuGroup], jobs: int = 1, bar: ServiceBar = DEFAULT_BAR) -> TwinCheck:
    """Simulate each group at its planned A_max and max_lora_rank with the bar's first seed, and those
    that meet the bar below :data:`CONFIRM_RATIO` with its other seeds too."""
    scenarios = [group_scenario(req, g.shares, g.a_max, max_lora_rank=g.max_lora_rank) for g in groups]
    first, *more = bar.seeds
    check = _simulate(req, scenarios, first, jobs)
    for seed in more:
        again = check.meets(bar) & (check.ratio < CONFIRM_RATIO)
        if not again.any():
            break
        check = check.worst(_simulate(req, [sc for sc, a in zip(scenarios, again) if a], seed, jobs), again)
    return check


def _simulate(req: PackRequest, scenarios: list, seed: int, jobs: int) -> TwinCheck:
    twin = TwinPredictor(req.profile, CONFIRM_DURATION_S, seed, policy=req.policy, jobs=jobs)
    pred = twin.predict(scenarios)
    return TwinCheck(pred.throughput_tok_s / np.maximum(pred.arriving_tok_s, 1e-12), pred.ttft_ms_p99,
                     pred.finished_fraction)


def retune(req: PackRequest, groups: list[GpuGroup], jobs: int = 1,
           bar: ServiceBar = DEFAULT_BAR) -> list[tuple[GpuGroup, float, float] | None]:
    """Per group: the same adapters at the other A_max candidate (``a_max_candidates``) that meets the bar
    in the twin with the highest throughput ratio (ties: the larger A_max), with that ratio and p99 TTFT;
    None if no other candidate meets it."""
    trials = [(j, GpuGroup(dict(g.shares), a, g.max_lora_rank)) for j, g in enumerate(groups)
              for a in a_max_candidates(req.kv, req.ranks[g.members], len(g)) if a != g.a_max]
    out: list[tuple[GpuGroup, float, float] | None] = [None] * len(groups)
    if not trials:
        return out
    check = twin_check(req, [t for _, t in trials], jobs, bar)
    for (j, trial), ok, ratio, ttft in zip(trials, check.meets(bar), check.ratio, check.ttft_ms_p99):
        if ok and (out[j] is None or ratio >= out[j][1]):  # candidates ascend: a tie goes to the larger A_max
            out[j] = (trial, float(ratio), float(ttft))
    return out


def repacking(req: PackRequest, margin: float, bar: ServiceBar) -> PackRequest:
    """A packing round's request: keep up with (1 + ``margin``) x the load, serving the bar's share of it."""
    return replace(req, margin=margin, min_ratio=bar.min_served)


def next_margin(margin: float, check: TwinCheck, bar: ServiceBar) -> float:
    """The margin of the next round: enough to bring the worst starving GPU's load down to what it
    sustained, and at least :data:`LATENCY_STEP` more when a GPU that keeps up misses the TTFT limit."""
    factor = 1.0 + MIN_STEP
    up = check.keeps_up(bar)
    if not up.all():
        factor = max(factor, bar.min_served / float(check.ratio.min()))
    if (up & ~check.meets(bar)).any():
        factor = max(factor, 1.0 + LATENCY_STEP)
    return (1.0 + margin) * factor - 1.0


@dataclass(frozen=True)
class Confirmation:
    margin: float  # the largest load margin a GPU of the final plan was packed with
    rounds: int  # packings run (1: the first plan was confirmed as it was)
    repacked: int  # GPUs of earlier packings that fell short and had their adapters packed again
    retuned: int  # GPUs that fell short and were kept with another A_max the twin confirmed
    ratios: list[float]  # per GPU of the final plan: twin throughput / arriving tokens
    ttft_ms_p99: list[float]  # per GPU of the final plan
    bar: ServiceBar
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "by": "twin", "duration_s": CONFIRM_DURATION_S, "seed": CONFIRM_SEED,
            "seeds_below_default_ratio": list(self.bar.seeds[1:]), "min_ratio": round(self.bar.min_served, 4),
            "max_ttft_s": self.bar.max_ttft_s, "margin": round(self.margin, 4), "rounds": self.rounds,
            "repacked_gpus": self.repacked, "retuned_gpus": self.retuned,
            "worst_ratio": round(min(self.ratios), 4) if self.ratios else None,
            "worst_ttft_ms_p99": round(max(self.ttft_ms_p99), 1) if self.ttft_ms_p99 else None,
            "wall_s": round(self.wall_s, 3),
        }


def pack_confirmed(req: PackRequest, split_hot: bool = True, balance: bool = True, jobs: int = 1,
                   bar: ServiceBar = DEFAULT_BAR,
                   progress: Progress | None = None) -> tuple[list[GpuGroup], Confirmation]:
    """Pack with :func:`plan_greedy`, keep the GPUs the twin confirms (meeting ``bar``), and pack the
    adapters of the others again with a larger ``req.margin`` until every GPU is confirmed (``jobs``:
    processes simulating).

    Raises :class:`InfeasibleError` when a repacking needs more GPUs than allowed, or when
    :data:`MAX_ROUNDS` packings still leave a GPU short.
    """
    t0 = time.perf_counter()
    margin = req.margin
    confirmed: list[GpuGroup] = []
    ratios: list[float] = []
    ttfts: list[float] = []
    entries: list[Entry] | None = None  # None: every adapter
    repacked = retuned = 0
    for rounds in range(1, MAX_ROUNDS + 1):
        try:
            groups = plan_greedy(repacking(req, margin, bar), split_hot, balance, entries,
                                 req.max_gpus - len(confirmed))
        except InfeasibleError as exc:
            raise exc if rounds == 1 else _repack_failed(exc, repacked, margin) from None
        check = twin_check(req, groups, jobs, bar)
        good = check.meets(bar)
        confirmed += [g for g, ok in zip(groups, good) if ok]
        ratios += check.ratio[good].tolist()
        ttfts += check.ttft_ms_p99[good].tolist()
        fixes = retune(req, [g for g, ok in zip(groups, good) if not ok], jobs, bar)
        kept = [fix for fix in fixes if fix is not None]
        confirmed += [g for g, _, _ in kept]
        ratios += [ratio for _, ratio, _ in kept]
        ttfts += [ttft for _, _, ttft in kept]
        retuned += len(kept)
        still_short = ~good
        still_short[still_short] = [fix is None for fix in fixes]
        if not still_short.any():
            return confirmed, Confirmation(margin, rounds, repacked, retuned, ratios, ttfts, bar,
                                           time.perf_counter() - t0)
        short = [g for g, bad in zip(groups, still_short) if bad]
        repacked += len(short)
        margin = next_margin(margin, check.select(still_short), bar)
        entries = list(shares_of([e for g in short for e in g.shares.items()]).items())
        _report(progress, check, still_short, len(kept), margin, bar)
    raise _still_short(margin)


#: A re-plan's group: the previous instance it keeps (None: a new GPU), and its adapters.
Labelled = tuple[str | None, GpuGroup]


def replan_confirmed(req: PackRequest, assign: Callable[[PackRequest, set[str]], list[Labelled]], jobs: int = 1,
                     bar: ServiceBar = DEFAULT_BAR,
                     progress: Progress | None = None) -> tuple[list[Labelled], Confirmation]:
    """The nightly re-plan's variant. ``assign(req, dropped)`` re-plans keeping adapters in place on
    every previous instance except those in ``dropped``. While the twin finds GPUs short, the previous
    instances among them are dropped (their adapters are placed anew) and the margin grows."""
    t0 = time.perf_counter()
    margin = req.margin
    dropped: set[str] = set()
    repacked = 0
    for rounds in range(1, MAX_ROUNDS + 1):
        try:
            labelled = assign(repacking(req, margin, bar), dropped)
        except InfeasibleError as exc:
            raise exc if rounds == 1 else _repack_failed(exc, repacked, margin) from None
        check = twin_check(req, [g for _, g in labelled], jobs, bar)
        good = check.meets(bar)
        if good.all():
            return labelled, Confirmation(margin, rounds, repacked, 0, check.ratio.tolist(),
                                          check.ttft_ms_p99.tolist(), bar, time.perf_counter() - t0)
        repacked += int((~good).sum())
        dropped |= {prev for (prev, _), ok in zip(labelled, good) if prev is not None and not ok}
        margin = next_margin(margin, check, bar)
        _report(progress, check, ~good, 0, margin, bar)
    raise _still_short(margin)


def _report(progress: Progress | None, check: TwinCheck, short: np.ndarray, kept: int, margin: float,
            bar: ServiceBar) -> None:
    """``short``: the groups packed again; ``kept``: groups that fell short but were kept with another A_max."""
    if progress:
        slow = int((check.keeps_up(bar) & short).sum())
        progress(f"twin check: {int(short.sum()) + kept} of {len(short)} GPUs fall short (worst serves "
                 f"{check.ratio.min():.1%} of its load{f'; {slow} miss the TTFT limit' if slow else ''})"
                 f"{f', {kept} kept with another A_max' if kept else ''}; packing {int(short.sum())} again with "
                 f"a {margin:.1%} load margin")


def _repack_failed(exc: InfeasibleError, repacked: int, margin: float) -> InfeasibleError:
    return InfeasibleError(f"{exc} (the twin found {repacked} GPU(s) short, so adapters were packed again "
                           f"to keep up with {1 + margin:.3g}x their load)")


def _still_short(margin: float) -> InfeasibleError:
    return InfeasibleError(f"the twin still finds GPUs short after {MAX_ROUNDS} packings (load margin "
                           f"{margin:.1%}); plan with --predictor twin or allow a longer TTFT")
