"""The one rule a planned GPU is judged by, and the twin run that judges it.

``planner plan`` and ``planner replan`` (their confirmation) and ``planner evaluate`` all judge a GPU
with :func:`twin_check` and :meth:`TwinCheck.meets`: its adapters' traffic is simulated in the twin
(:data:`CONFIRM_DURATION_S` of Poisson arrivals, seed :data:`CONFIRM_SEED` unless told otherwise) on a
GPU ``bar.slowdown`` times slower than the profile says, and the GPU passes when it

* serves at least ``bar.min_served`` of its arriving tokens (the starvation rule, 0.9, plus room for the
  arrival seed: near its limit a GPU holds a standing queue whose size varies from seed to seed), and
* meets the latency SLO: p99 time to first token over every arrival within ``max_ttft_s`` (a request
  still waiting at the end counts with its wait so far, so a collapsed GPU cannot pass on the few
  requests it finished) and p99 time per output token within ``max_tpot_ms``; an adapter's own SLO
  (the workload's ``max_ttft_s`` / ``max_tpot_ms`` columns) tightens it for the GPU that serves it.

The run is made with :data:`CONFIRM_LOAD` times the GPU's traffic, and a GPU that passes is run again with
seed :data:`SECOND_SEED`; its figures are the worse of the two runs, and in neither may more than a tenth
of a percent of its requests wait :data:`TAIL_FACTOR` times its TTFT limit. Under a latency SLO each run
lasts as long as :data:`SLO_MIN_REQUESTS` arrivals take, between half an hour and an hour
(:meth:`TwinRun.for_bar`): a p99 is as good as the requests it is taken over. Half hours passed no GPU that missed the SLO in another
hour where they held 40,000 requests or more (random 2,000-adapter plans of log-uniform rates and hot
adapters, 0 of 1,404 GPU-hours), but with mixed request lengths (about 9,000 requests per half hour) 6 of
930 GPU-hours missed, against 1 of 942 with whole hours. By the served share alone the runs are whole
hours: a GPU past its capacity builds its queue for the whole run, so a shorter one serves a larger share
of it and passes GPUs that starve (docs/surrogates.md, "Duration"). Close to a GPU's capacity p99 TTFT
jumps from tenths of a second to many seconds from one arrival seed to the next (a GPU of 64 rank-32
adapters judged at 0.29 s and 133 ms TPOT took 6.4 s with another seed, and 14-35 s with 5 % more traffic
whatever the seed), and a run at the planned traffic does not always show it: on random 2,000-adapter
plans with mixed request lengths, GPUs judged at 0.2-0.5 s p99 TTFT missed the limit in 1 of 6 other
simulated hours, and with 5 % more traffic took 2-18 s (``python -m benchmarks.fidelity.ttft_seed_spread``).
A little more load shows where the knee is, and one hour of it is not enough with mixed lengths: a GPU
judged at 0.9 s with 5 % more traffic and seed 0 took 5-8 s with seeds 101-103 and 2.8 s with the planned
traffic and seed 1. Of the rules tried on 851 GPUs of packings aimed at the planned traffic (random
2,000-adapter fleets, six families x 5 seeds), this one passed 609 and none that then missed the SLO in
one of three other hours of the planned traffic; one run with 5 % more passed 625 and 1 of those missed
(``python -m benchmarks.fidelity.judging_load``).

Two runs still passed a GPU now and then that then missed the SLO in many other hours. Those GPUs leave
a few of their requests waiting minutes in every run: a re-planned GPU of 23 adapters on ``--max-loras``
16 passed at 1.8 and 1.1 s p99 TTFT with a p99.9 of 170 s and missed the SLO in 4 of 6 other hours; one
of 17 adapters on 15 passed at 0.74 s with 210 s, and missed with the nightly benchmark's new seed. An
adapter that finds no free LoRA slot waits until a running one drains, and when such waits reach one
request in a hundred the p99 is gone. So in each judging run the p99.9 TTFT must also stay within
:data:`TAIL_FACTOR` times the limit (``TwinRun.tail_factor``): a request left waiting 10 s has been given
up by an interactive user anyway (``python -m benchmarks.fidelity.knee_rules`` on nights
``benchmarks.placement.nightly --keep`` kept; docs/planning.md). At 10 times, 2 GPUs of 1,914 re-planned
GPU-nights of mixed request lengths passed with a p99.9 of 15 and 18 s and missed the SLO with a new
seed; at 5 times none did, at the same GPUs (``nightly --families mixed-lengths``). A GPU that passes both runs
but left a request in a thousand waiting past its TTFT limit in one (p99.9 TTFT over the limit, within the
bound) is run a third time, with :data:`THIRD_SEED`: on 30 re-planned nights of a log-uniform fleet whose GPUs
of at most 64 adapters were judged on the smaller margin (:func:`few_adapters`) by two runs, one GPU of 58
adapters passed at 1.66 s p99 TTFT (p99.9 2.8 s) and missed the SLO with the night's evaluation seed (2.7 s),
the only one of 916 GPU-nights to miss in six other hours; with the third run no GPU of the 917 of those
nights missed in six other hours (``python -m benchmarks.fidelity.knee_rules`` on ``nightly --keep``).
A GPU of few adapters is judged in that third run on the SLO margin, as every other GPU: a request past the
limit says it is at its knee, and the real runs the smaller margin rests on were all far from theirs. Judged
there on its own margin, of 30 nights of hot and of mixed-length fleets (seed 1) one GPU of 21 adapters passed
at 1.88 s p99 TTFT (p99.9 4.1 s) and missed with the night's evaluation seed (2.2 s), and 13 of 7,552
GPU-nights missed in one of six other hours: eleven single-adapter replicas of one new hot adapter, one GPU of
2 adapters and that one of 21, all with a p99.9 TTFT of 3.6-4.1 s in their judging runs.
Throughput is the served share times the planned arriving tokens.
A GPU whose request sizes vary more than the profile's default lengths is judged with a larger margin in
proportion (``TwinRun.size_scaled``, :func:`models.twin_predictor.size_factor`): with mixed request lengths
a GPU's hourly p99 wanders, and of 764 GPUs of random 10,000-adapter mixed-length plans that two runs at
1.05 x passed, 21 missed the SLO in another hour; of the 488 this margin passes, 1
(``python -m benchmarks.fidelity.knee_rules``, docs/planning.md).
p99 TPOT moves less from hour to hour than TTFT, but a packing holds it at its limit on nearly every GPU under a
tight TPOT limit (``--max-tpot 50``), so each judging run keeps it within :data:`TPOT_FACTOR` times the limit:
over 341 GPUs of random plans of that limit, the worst of six other hours of the planned traffic was at most 1.3 %
above the judged figure, and none of the 2,046 GPU-hours missed the limit with this room
(``python -m benchmarks.fidelity.ttft_seed_spread --plan-args '--max-tpot 50'``).
``planner evaluate --seed N`` with another seed judges the planned traffic itself, once, by the SLO: an
independent check of what the plan promised.

The default SLO, p99 TTFT <= 2 s and p99 TPOT <= 200 ms, is the interactive bound MLCommons sets for
its LLM server benchmarks (MLPerf Inference, Llama-2-70B server scenario): a user sees the first token
within two seconds and then reads at least five tokens a second. ``--objective throughput`` drops it,
leaving the paper's rule alone. ``slowdown`` is the profile's safety margin (``Profile.planning``):
how much slower than its twin a real engine of that profile was measured to run, so that a GPU the
twin passes holds on the real one too (benchmarks/fidelity/edge_margin.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from models.scenario import GpuScenario, Predictions
from models.twin_predictor import FewAdapters, TwinPredictor
from twin.errors import BadInputError
from twin.simulate import STARVATION_THRESHOLD

#: The twin run of each GPU (`planner evaluate`'s defaults, so a confirmed plan evaluates as it was confirmed).
CONFIRM_DURATION_S = 3600.0
CONFIRM_SEED = 0
#: The share of its arriving tokens a GPU must serve by default: the starvation threshold plus 0.05 for the
#: noise between one arrival seed and another (GPUs at 0.914 and 0.946 with seed 0 fell below 0.9 with seed
#: 1). Rounded: 0.9 + 0.05 is 0.9500000000000001 in floating point.
CONFIRM_RATIO = round(STARVATION_THRESHOLD + 0.05, 9)
#: A GPU is judged with this many times its planned traffic, with seed CONFIRM_SEED and, if it passes, again
#: with SECOND_SEED (module docstring).
CONFIRM_LOAD = 1.05
SECOND_SEED = 101
#: A GPU that passes both runs but left a request in a thousand waiting past its TTFT limit in one of them is
#: run a third time with this seed (module docstring).
THIRD_SEED = 202
#: In a judging run a GPU's p99.9 TTFT must stay within this many times its TTFT limit: requests left
#: waiting for a LoRA slot that long mark a GPU whose p99 jumps over the limit from one hour to the next
#: (module docstring). Only a judging run's rule: ``planner evaluate`` with another seed checks the SLO.
TAIL_FACTOR = 5.0
#: In a judging run a GPU's p99 TPOT must stay within this many times its TPOT limit: p99 TPOT moves about a per
#: cent from one simulated hour to the next, so a GPU packed to its TPOT limit exactly misses it in another hour
#: now and then (module docstring). Only a judging run's rule, as TAIL_FACTOR.
TPOT_FACTOR = 0.98
#: Under a latency SLO a judging run lasts as long as this many arrivals take, between SLO_SHORTEST_S and
#: CONFIRM_DURATION_S (module docstring).
SLO_MIN_REQUESTS = 40_000.0
SLO_SHORTEST_S = 1800.0
DEFAULT_MAX_TTFT_S = 2.0
DEFAULT_MAX_TPOT_MS = 200.0
OBJECTIVES = ("slo", "throughput")
#: Under the SLO, a GPU serving at most FEW_ADAPTERS adapters is judged on the profile's served-share margin,
#: not its larger SLO margin, with the twin's p99 TPOT taken FEW_TPOT_FACTOR times and its p99 TTFT
#: FEW_TTFT_MS_PER_ADAPTER ms per adapter served longer (:func:`few_adapters`). The SLO margin is sized by
#: the study's real runs of 128-192 adapters, where the real engine slowed with many distinct adapters in a
#: batch and collapsed at loads the twin serves; at 8-64 adapters (40 real runs) the twin with no margin at all
#: passes no run reality failed (``python -m benchmarks.fidelity.margin_rules``: ``flat_by_adapters``). What
#: the twin does miss there is measured by the same runs (``few_adapters`` in its output): over the runs that
#: met the SLO for real, real p99 TTFT exceeded the twin's (on the served-share margin) by at most 5.1 ms per
#: adapter, and over the runs not past their capacity real p99 TPOT was at most 1.54 times the twin's (both
#: rounded up here).
FEW_ADAPTERS = 64
FEW_TPOT_FACTOR = 1.6
FEW_TTFT_MS_PER_ADAPTER = 5.5


@dataclass(frozen=True)
class ServiceBar:
    """What the twin must show for a GPU to pass (before the adapters' own SLOs tighten it)."""

    min_served: float = CONFIRM_RATIO  # fraction of its arriving tokens served in the window
    max_ttft_s: float | None = DEFAULT_MAX_TTFT_S  # p99 time to first token over every arrival
    max_tpot_ms: float | None = DEFAULT_MAX_TPOT_MS  # p99 time per output token
    slowdown: float = 1.0  # the twin's GPU this many times slower than the profile's (the safety margin)
    few: FewAdapters | None = None  # how a GPU of few adapters is judged instead (None: as every other)

    def __post_init__(self) -> None:
        if not STARVATION_THRESHOLD <= self.min_served < 1.0:
            raise BadInputError(f"the share of its arriving tokens a GPU must serve must be in "
                                f"[{STARVATION_THRESHOLD:g}, 1): below {STARVATION_THRESHOLD:g} it starves; got "
                                f"{self.min_served:g} (--min-served, or min_ratio in the plan's confirmation)")
        for name, value in (("max_ttft_s", self.max_ttft_s), ("max_tpot_ms", self.max_tpot_ms)):
            if value is not None and not (np.isfinite(value) and value > 0):
                raise BadInputError(f"the SLO's {name} must be a positive number of "
                                    f"{'seconds' if name.endswith('_s') else 'milliseconds'}; got {value!r}")
        if not (np.isfinite(self.slowdown) and 1.0 <= self.slowdown <= 10.0):
            raise BadInputError(f"the safety slowdown must be in [1, 10]; got {self.slowdown!r}")

    @classmethod
    def for_objective(cls, objective: str, slowdown: float = 1.0, min_served: float | None = None,
                      max_ttft_s: float | None = None, max_tpot_ms: float | None = None) -> ServiceBar:
        """``slo``: the default SLO, with any limit given replacing its default; ``throughput``: the served
        share alone (a latency limit given anyway still applies)."""
        if objective not in OBJECTIVES:
            raise BadInputError(f"unknown objective '{objective}'; choose one of {', '.join(OBJECTIVES)}")
        slo = objective == "slo"
        return cls(CONFIRM_RATIO if min_served is None else min_served,
                   max_ttft_s if max_ttft_s is not None else DEFAULT_MAX_TTFT_S if slo else None,
                   max_tpot_ms if max_tpot_ms is not None else DEFAULT_MAX_TPOT_MS if slo else None, slowdown)

    @property
    def objective(self) -> str:
        return "throughput" if self.max_ttft_s is None and self.max_tpot_ms is None else "slo"

    def describe(self) -> str:
        """One line: what a GPU must show."""
        parts = [f"serves >= {self.min_served:.0%} of its tokens"]
        if self.max_ttft_s is not None:
            parts.append(f"p99 TTFT <= {self.max_ttft_s:g} s")
        if self.max_tpot_ms is not None:
            parts.append(f"p99 TPOT <= {self.max_tpot_ms:g} ms")
        text = ", ".join(parts)
        if self.few is not None:
            text += f", on a GPU slower than the profile by its safety margin: {margin_words(self.to_dict())}"
        elif self.slowdown > 1.0:
            text += f", on a GPU {self.slowdown - 1:.0%} slower than the profile (its safety margin)"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"objective": self.objective, "min_served": round(self.min_served, 4), "max_ttft_s": self.max_ttft_s,
                "max_tpot_ms": self.max_tpot_ms, "slowdown": self.slowdown,
                **({} if self.few is None else {"few_adapters": self.few.to_dict()})}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ServiceBar:
        few = d.get("few_adapters")
        return cls(d.get("min_served", CONFIRM_RATIO), d.get("max_ttft_s"), d.get("max_tpot_ms"),
                   d.get("slowdown", 1.0), None if few is None else FewAdapters(**few))

    def flat(self, slowdown: float) -> ServiceBar:
        """This bar with every GPU judged on a GPU ``slowdown`` times slower than the profile."""
        return replace(self, slowdown=slowdown, few=None)


def few_adapters(profile, objective: str) -> FewAdapters | None:
    """How a GPU of few adapters is judged under ``objective`` on ``profile`` where that differs from the rest
    (:data:`FEW_ADAPTERS`): under the SLO, on the profile's served-share margin where its SLO margin is larger."""
    small, slo = profile.planning_slowdown("throughput"), profile.planning_slowdown("slo")
    if objective != "slo" or small >= slo:
        return None
    return FewAdapters(FEW_ADAPTERS, small, FEW_TPOT_FACTOR, FEW_TTFT_MS_PER_ADAPTER)


def few_words(few: FewAdapters) -> tuple[str, str]:
    """The rule for GPUs of few adapters, in words: its margin, and what else it takes of the twin."""
    return (f"{few.slowdown - 1:.0%} where it serves at most {few.adapters} adapters",
            f"its p99 TPOT then taken {few.tpot_factor:g}x and its p99 TTFT {few.ttft_ms_per_adapter:g} ms per adapter longer")


def margin_words(c: dict[str, Any], kind: bool = False) -> str:
    """The safety margin a plan's confirmation (``Confirmation.to_dict``) records, in words: "30%", or with a rule
    for GPUs of few adapters "30%, 7% where it serves at most 64 adapters (its p99 TPOT ...)"; ``kind``: as one
    of a pool's list, "30% (7% where ...; its p99 TPOT ...)"."""
    flat = f"{c.get('slowdown', 1.0) - 1:.0%}"
    if not c.get("few_adapters"):
        return flat
    margin, rest = few_words(FewAdapters(**c["few_adapters"]))
    return f"{flat} ({margin}; {rest})" if kind else f"{flat}, {margin} ({rest})"


def group_limits(bar: ServiceBar, ttft_s: np.ndarray, tpot_ms: np.ndarray) -> tuple[float, float]:
    """A GPU's latency limits (ms, inf: none): the strictest of the bar's and its adapters' own (``ttft_s``,
    ``tpot_ms``: per adapter, NaN where an adapter sets none)."""
    ttft = np.fmin.reduce(ttft_s, initial=np.inf if bar.max_ttft_s is None else bar.max_ttft_s)
    tpot = np.fmin.reduce(tpot_ms, initial=np.inf if bar.max_tpot_ms is None else bar.max_tpot_ms)
    return float(ttft) * 1000.0, float(tpot)


@dataclass(frozen=True)
class TwinCheck:
    """The twin's figures on a list of GPUs, one entry per GPU (the worst over the seeds run), and their
    latency limits."""

    ratio: np.ndarray  # throughput / arriving tokens
    ttft_ms_p99: np.ndarray  # over every arrival (SimResult.ttft_ms_p99_all)
    tpot_ms_p99: np.ndarray
    throughput_tok_s: np.ndarray
    arriving_tok_s: np.ndarray
    itl_ms_mean: np.ndarray
    max_ttft_ms: np.ndarray  # the GPU's limits (inf: none)
    max_tpot_ms: np.ndarray
    ttft_ms_p999: np.ndarray  # p99.9 TTFT over every arrival, and its bound in a judging run (inf: none)
    max_ttft_p999_ms: np.ndarray
    tpot_bound_ms: np.ndarray  # the p99 TPOT a judging run allows (TwinRun.tpot_factor times the limit)

    def keeps_up(self, bar: ServiceBar) -> np.ndarray:
        return self.ratio >= bar.min_served

    def meets(self, bar: ServiceBar) -> np.ndarray:
        return self.keeps_up(bar) & self.meets_latency()

    def meets_latency(self) -> np.ndarray:
        # NaN (no request arrived or finished) is no miss
        return (~(self.ttft_ms_p99 > self.max_ttft_ms) & ~(self.tpot_ms_p99 > self.max_tpot_ms)
                & ~(self.ttft_ms_p999 > self.max_ttft_p999_ms) & ~(self.tpot_ms_p99 > self.tpot_bound_ms))

    def misses(self, k: int, bar: ServiceBar) -> list[str]:
        """What GPU ``k`` misses, in words (empty when it passes), each figure with the digits that show it
        beyond its limit."""
        out = []
        if self.ratio[k] < bar.min_served:
            out.append(f"serves {beyond(self.ratio[k] * 100, bar.min_served * 100, '%', below=True)}")
        if self.ttft_ms_p99[k] > self.max_ttft_ms[k]:
            out.append(f"p99 TTFT {beyond(self.ttft_ms_p99[k] / 1000, self.max_ttft_ms[k] / 1000, ' s')}")
        if self.tpot_ms_p99[k] > self.max_tpot_ms[k]:
            out.append(f"p99 TPOT {beyond(self.tpot_ms_p99[k], self.max_tpot_ms[k], ' ms')}")
        elif self.tpot_ms_p99[k] > self.tpot_bound_ms[k]:
            out.append(f"p99 TPOT {beyond(self.tpot_ms_p99[k], self.tpot_bound_ms[k], ' ms')} (a judging run's "
                       f"room for the arrival seed under {self.max_tpot_ms[k]:g} ms)")
        if self.ttft_ms_p999[k] > self.max_ttft_p999_ms[k]:
            out.append(f"p99.9 TTFT {beyond(self.ttft_ms_p999[k] / 1000, self.max_ttft_p999_ms[k] / 1000, ' s')} "
                       "(requests left waiting for a LoRA slot)")
        return out

    def select(self, mask: np.ndarray) -> TwinCheck:
        """The figures of the GPUs where ``mask`` is true."""
        return TwinCheck(*(getattr(self, f)[mask] for f in _FIELDS))

    def row(self, k: int, bar: ServiceBar) -> dict[str, Any]:
        """GPU ``k``'s figures as the placement JSON records them."""
        return {
            "served": round(float(self.ratio[k]), 4), "throughput_tok_s": round(float(self.throughput_tok_s[k]), 1),
            "ttft_ms_p99": _ms(self.ttft_ms_p99[k]), "tpot_ms_p99": _ms(self.tpot_ms_p99[k]),
            "itl_ms_mean": _ms(self.itl_ms_mean[k]), "ttft_ms_p999": _ms(self.ttft_ms_p999[k]),
            "max_ttft_ms": None if np.isinf(self.max_ttft_ms[k]) else float(self.max_ttft_ms[k]),
            "max_tpot_ms": None if np.isinf(self.max_tpot_ms[k]) else float(self.max_tpot_ms[k]),
            "meets": bool(self.meets(bar)[k]),
        }


_FIELDS = ("ratio", "ttft_ms_p99", "tpot_ms_p99", "throughput_tok_s", "arriving_tok_s", "itl_ms_mean", "max_ttft_ms",
           "max_tpot_ms", "ttft_ms_p999", "max_ttft_p999_ms", "tpot_bound_ms")


def _ms(x: float) -> float | None:
    return None if not np.isfinite(x) else round(float(x), 1)


def check_of(pred: Predictions, scenarios: list[GpuScenario], load: float = 1.0, tail_factor: float | None = None,
             tpot_factor: float | None = None) -> TwinCheck:
    """A twin run's :class:`Predictions` of ``scenarios`` (which carry each GPU's latency limits) as a check,
    the run made with ``load`` times their traffic: throughput and arriving tokens are the planned traffic's
    (the served share times it). ``tail_factor``, ``tpot_factor``: a judging run's bounds (:class:`TwinRun`)."""
    ratio = _served(pred)
    planned = pred.arriving_tok_s / load
    p999 = pred.ttft_ms_p999_all if pred.ttft_ms_p999_all is not None else np.full(len(scenarios), np.nan)
    ttft, tpot = limits_of(scenarios)
    return TwinCheck(ratio, pred.ttft_ms_p99_all, pred.tpot_ms_p99, ratio * planned, planned, pred.itl_ms_mean,
                     ttft, tpot, p999, *judging_bounds(ttft, tpot, tail_factor, tpot_factor))


def limits_of(scenarios: list[GpuScenario]) -> tuple[np.ndarray, np.ndarray]:
    """Each scenario's p99 TTFT and p99 TPOT limits (ms; inf: none)."""
    return (np.array([s.max_ttft_ms for s in scenarios], float), np.array([s.max_tpot_ms for s in scenarios], float))


def judging_bounds(ttft_ms: np.ndarray, tpot_ms: np.ndarray, tail_factor: float | None,
                   tpot_factor: float | None) -> tuple[np.ndarray, np.ndarray]:
    """A judging run's bounds (ms; inf: none) for these limits: on p99.9 TTFT, and on p99 TPOT."""
    return (ttft_ms * (np.inf if tail_factor is None else tail_factor),
            tpot_ms * (1.0 if tpot_factor is None else tpot_factor))


def within_bounds(pred: Predictions, scenarios: list[GpuScenario], tail_factor: float | None,
                  tpot_factor: float | None) -> np.ndarray:
    """Which predicted scenarios keep a judging run's bounds (:func:`judging_bounds`; NaN is no miss)."""
    p999_bound, tpot_bound = judging_bounds(*limits_of(scenarios), tail_factor, tpot_factor)
    return ~(pred.ttft_ms_p999_all > p999_bound) & ~(pred.tpot_ms_p99 > tpot_bound)


@dataclass(frozen=True)
class TwinRun:
    """How the twin runs each GPU: the judging run by default; ``planner evaluate`` may change seed,
    duration, load or arrivals, and judge with one seed only (``second_seed`` None)."""

    duration_s: float = CONFIRM_DURATION_S
    seed: int = CONFIRM_SEED
    load: float = CONFIRM_LOAD  # the traffic simulated, as a multiple of the planned traffic
    arrivals: object = None  # a twin arrival process; None: Poisson
    jobs: int = 1
    second_seed: int | None = SECOND_SEED  # a GPU that passes with ``seed`` is run again with this one
    # and a GPU that passes both but whose p99.9 TTFT was over its limit in one, a third time with this one
    third_seed: int | None = None
    tail_factor: float | None = TAIL_FACTOR  # p99.9 TTFT within this many times the limit (None: no bound)
    tpot_factor: float | None = TPOT_FACTOR  # p99 TPOT within this many times the limit (None: the limit)
    # a GPU expected to see fewer than ``min_requests`` arrivals in ``duration_s`` runs longer, up to
    # ``max_duration_s`` (0: every GPU runs ``duration_s``)
    min_requests: float = 0.0
    max_duration_s: float = CONFIRM_DURATION_S
    # a GPU whose request sizes vary more than the profile's default lengths runs with a margin (load - 1)
    # scaled up by how much more (models.twin_predictor.size_factor)
    size_scaled: bool = True

    @classmethod
    def for_bar(cls, bar: ServiceBar, jobs: int = 1, tail_factor: float | None = TAIL_FACTOR,
                size_scaled: bool = True) -> TwinRun:
        """The judging runs for ``bar``: as long as SLO_MIN_REQUESTS arrivals take (half an hour to an hour)
        under a latency SLO, whole hours by the served share alone (module docstring)."""
        if bar.objective == "slo":
            return cls(SLO_SHORTEST_S, jobs=jobs, min_requests=SLO_MIN_REQUESTS, max_duration_s=CONFIRM_DURATION_S,
                       tail_factor=tail_factor, size_scaled=size_scaled, third_seed=THIRD_SEED)
        return cls(CONFIRM_DURATION_S, jobs=jobs, tail_factor=tail_factor, size_scaled=size_scaled,
                   third_seed=THIRD_SEED)

    @property
    def size_margin(self) -> float:
        """The load margin a run scales with a GPU's request-size variation (0: none)."""
        return self.load - 1.0 if self.size_scaled else 0.0

    def predictor(self, profile, policy, bar: ServiceBar,
                  progress: Callable[[int, int], None] | None = None) -> TwinPredictor | WorstOfSeeds:
        """The twin as a predictor of the traffic it is given (``load`` is applied by :func:`twin_check`) on the
        GPU ``bar`` judges on: its figures, or with a second seed the worse of the two runs
        (:class:`WorstOfSeeds`)."""
        first = TwinPredictor(profile, self.duration_s, self.seed, policy=policy, jobs=self.jobs,
                              slowdown=bar.slowdown, arrivals=self.arrivals, progress=progress,
                              min_requests=self.min_requests, max_duration_s=self.max_duration_s,
                              size_margin=self.size_margin, few=bar.few)
        if self.second_seed is None:
            return first
        # the third run judges a GPU of few adapters as every other: it is at its knee (module docstring)
        third = None if self.third_seed is None else replace(first, seed=self.third_seed, progress=None, few=None)
        return WorstOfSeeds(first, replace(first, seed=self.second_seed, progress=None), bar.min_served,
                            self.tail_factor, self.tpot_factor, third)

    def describe_length(self) -> str:
        """How long each run is, in words."""
        return run_length_words(self.duration_s, self.min_requests, self.max_duration_s)

    def to_dict(self) -> dict[str, Any]:
        """What a plan records of how its GPUs were judged (``inputs.confirmation``)."""
        return {"by": "twin", "duration_s": self.duration_s, "seed": self.seed, "load": self.load,
                "second_seed": self.second_seed, "tail_factor": self.tail_factor, "tpot_factor": self.tpot_factor,
                "size_scaled": self.size_scaled, **({} if self.third_seed is None else {"third_seed": self.third_seed}),
                **({"min_requests": self.min_requests, "max_duration_s": self.max_duration_s} if self.min_requests
                   else {})}


def beyond(value: float, limit: float, unit: str, below: bool = False) -> str:
    """``value`` against the ``limit`` it misses ("0.2004 s > 0.2 s"): rounded to at least the limit's decimals
    (one at least), and to more until the digits show the miss; ``below``: a floor ("94.96% < 95%")."""
    bound = f"{limit:g}" if float(f"{limit:g}") == limit else repr(float(limit))
    decimals = max(1, len(bound.split(".")[1]) if "." in bound and "e" not in bound else 1)
    text = repr(float(value))
    for d in range(decimals, 18):
        shown = f"{value:,.{d}f}"
        number = float(shown.replace(",", ""))
        if (number < limit) if below else (number > limit):
            text = shown
            break
    return f"{text}{unit} {'<' if below else '>'} {bound}{unit}"


def tightened_words(limits: list[tuple[str, float | None, float | None]], max_ttft_s: float | None,
                    max_tpot_ms: float | None, shown: int = 5) -> str | None:
    """The GPUs whose adapters' own limits (the workload's ``max_ttft_s`` / ``max_tpot_ms``) tighten the SLO,
    in words; ``limits``: per GPU its id and the p99 TTFT (ms) and TPOT (ms) limits it was judged by. None when
    no GPU is tightened."""
    tight = []
    for instance_id, ttft_ms, tpot_ms in limits:
        parts = []
        if ttft_ms is not None and (max_ttft_s is None or ttft_ms < max_ttft_s * 1000):
            parts.append(f"p99 TTFT <= {ttft_ms / 1000:g} s")
        if tpot_ms is not None and (max_tpot_ms is None or tpot_ms < max_tpot_ms):
            parts.append(f"p99 TPOT <= {tpot_ms:g} ms")
        if parts:
            tight.append(f"{instance_id} {' and '.join(parts)}")
    if not tight:
        return None
    more = f" and {len(tight) - shown} more" if len(tight) > shown else ""
    return (f"tighter on {len(tight)} GPU(s) by their adapters' own limits: {', '.join(tight[:shown])}{more}")


def bounds_words(tail_factor: float | None, tpot_factor: float | None, max_ttft_s: float | None,
                 max_tpot_ms: float | None) -> str:
    """A judging run's bounds in words (", p99.9 TTFT within 5x the limit, ..."), for the limits the SLO has."""
    words = ""
    if tail_factor is not None and max_ttft_s is not None:
        words += f", p99.9 TTFT within {tail_factor:g}x the limit"
    if tpot_factor is not None and max_tpot_ms is not None:
        words += f", p99 TPOT within {tpot_factor:.0%} of the limit"
    return words


def run_length_words(duration_s: float, min_requests: float = 0.0, max_duration_s: float | None = None,
                     unit: str = "s") -> str:
    """How long a judging run lasts, in words (``unit`` follows the first duration: "s of Poisson arrivals")."""
    text = f"{duration_s:g} {unit}"
    if min_requests:
        text += f", up to {max_duration_s or duration_s:g} s until {min_requests:,.0f} have arrived"
    return text


@dataclass
class WorstOfSeeds:
    """The twin run with one seed and, for the scenarios that pass there (serving ``min_served`` of their
    tokens within their latency limits), with another, and with ``third`` for those that pass both but left
    requests waiting past their TTFT limit in one (p99.9 TTFT over it): per scenario the worse of each figure."""

    first: TwinPredictor
    second: TwinPredictor
    min_served: float
    tail_factor: float | None = None
    tpot_factor: float | None = None
    third: TwinPredictor | None = None
    kind: str = "twin"

    @property
    def profile_id(self) -> str:
        return self.first.profile_id

    @property
    def policy(self):
        return self.first.policy

    def predict(self, scenarios: list[GpuScenario]) -> Predictions:
        """The worse figures of the runs; ``within_bounds`` tells the packer which kept the judging run's bounds."""
        pred = self.first.predict(scenarios)
        pred = replace(pred, within_bounds=within_bounds(pred, scenarios, self.tail_factor, self.tpot_factor))
        again = self._passing(pred, scenarios)
        if not again.any():
            return pred
        pred = _worse(pred, self.second, again, scenarios)
        if self.third is not None:
            burst = again & (pred.ttft_ms_p999_all > limits_of(scenarios)[0]) & self._passing(pred, scenarios)
            if burst.any():
                pred = _worse(pred, self.third, burst, scenarios)
        return replace(pred, within_bounds=within_bounds(pred, scenarios, self.tail_factor, self.tpot_factor))

    def _passing(self, pred: Predictions, scenarios: list[GpuScenario]) -> np.ndarray:
        return (_served(pred) >= self.min_served) & pred.meets_latency(scenarios)


def _worse(pred: Predictions, run: TwinPredictor, which: np.ndarray, scenarios: list[GpuScenario]) -> Predictions:
    """``pred`` with each figure of the scenarios ``which`` selects the worse of its own and ``run``'s."""
    other = run.predict([sc for sc, a in zip(scenarios, which) if a])
    ratio = _served(pred)
    ratio[which] = np.fmin(ratio[which], _served(other))
    worst = {f: getattr(pred, f).copy() for f in ("ttft_ms_p99_all", "tpot_ms_p99", "itl_ms_mean", "ttft_ms_p999_all")}
    for f, values in worst.items():
        values[which] = np.fmax(values[which], getattr(other, f))
    starved = pred.starved.copy()
    starved[which] |= other.starved
    return Predictions(ratio * pred.arriving_tok_s, starved, pred.arriving_tok_s, **worst)


def _served(pred: Predictions) -> np.ndarray:
    """Share of its arriving tokens each scenario served (1 where nothing arrived)."""
    arriving = pred.arriving_tok_s
    return np.divide(pred.throughput_tok_s, arriving, out=np.ones_like(arriving), where=arriving > 0)


DEFAULT_BAR = ServiceBar()
DEFAULT_RUN = TwinRun()


def twin_check(profile, policy, scenarios: list[GpuScenario], bar: ServiceBar, run: TwinRun = DEFAULT_RUN,
               progress: Callable[[int, int], None] | None = None) -> TwinCheck:
    """Simulate each GPU with ``run.load`` times its traffic (module docstring)."""
    loaded = scenarios if run.load == 1.0 else [replace(sc, rates_rps=sc.rates_rps * run.load) for sc in scenarios]
    pred = run.predictor(profile, policy, bar, progress).predict(loaded)
    return check_of(pred, loaded, run.load, run.tail_factor, run.tpot_factor)
