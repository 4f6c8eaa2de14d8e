"""The fewest GPUs a plan of a workload could use: the yardstick printed beside every plan.

No GPU of a profile serves more tokens per second within the SLO than one that holds a single adapter of
the workload's smallest rank: no request ever waits for a LoRA slot and the LoRA kernels cost least. That
GPU's capacity is bisected in the profile's twin as it is (no safety margin, one arrival seed, the traffic
itself, no judging-run bounds) under the plan's SLO and served share, at the workload's mean request
(weighted by rate). The workload's arriving tokens over it, rounded up, is the bound: a plan judged on the
same twin needs at least that many GPUs, whatever its margin or packing, and a plan's GPUs over it say how
much its margin and its packing cost. With request lengths that vary a lot between adapters the mean request
is not every adapter's best case, so the bound is an estimate there rather than a proof.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from models.scenario import GpuScenario
from models.twin_predictor import worker_pool
from planner.packing import PackRequest
from planner.verdict import SLO_SHORTEST_S, ServiceBar, TwinRun, twin_check
from twin.policies.spec import PolicySpec
from twin.profile import Profile
from twin.simulate import STARVATION_THRESHOLD

#: The twin run a capacity is bisected with: half an hour of Poisson arrivals, judged once as it is.
BOUND_RUN = TwinRun(duration_s=SLO_SHORTEST_S, load=1.0, second_seed=None, tail_factor=None, tpot_factor=None,
                    size_scaled=False)
#: The runs that bracket it first: a rate far past the GPU's capacity misses the SLO within minutes.
BRACKET_RUN = replace(BOUND_RUN, duration_s=300.0)
#: Bisection stops when the bracket is this narrow (relative): the bound's rate is known to 1 %.
TOLERANCE = 1.01
#: ... or, below one request a second, this narrow (absolute, requests/s).
MIN_RATE_RPS = 1.0 / 4096


@dataclass(frozen=True)
class LowerBound:
    gpus: int
    arriving_tok_s: float
    gpu_tok_s: float  # the most tokens/s one GPU serves within the SLO (module docstring)
    rank: int
    mean_input_tokens: float
    mean_output_tokens: float

    def to_dict(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "arriving_tok_s": round(self.arriving_tok_s, 3),
                "gpu_tok_s": round(self.gpu_tok_s, 1), "rank": self.rank,
                "mean_input_tokens": round(self.mean_input_tokens, 1),
                "mean_output_tokens": round(self.mean_output_tokens, 1)}


def lower_bound(req: PackRequest, bar: ServiceBar, jobs: int = 1) -> Callable[[], LowerBound]:
    """The bound for ``req``'s workload (its planned rates, lengths and policy) under ``bar``'s SLO, as a call
    that returns it: with ``jobs`` > 1 it is worked out in the twin's worker pool meanwhile, beside the packing."""
    arriving = float(req.arriving_tok_s.sum())
    mean_in, mean_out = req.mean_request
    rank = int(req.ranks.min())
    if arriving <= 0:
        return lambda: LowerBound(1, arriving, math.inf, rank, mean_in, mean_out)

    def bound(capacity: float) -> LowerBound:
        gpus = max(1, math.ceil(arriving / capacity)) if capacity > 0 else 1
        return LowerBound(gpus, arriving, capacity, rank, mean_in, mean_out)

    args = (req.profile, req.policy, bar.flat(1.0), rank, mean_in, mean_out)
    if jobs <= 1:
        return lambda: bound(best_gpu_tok_s(*args))
    future = worker_pool(jobs).submit(best_gpu_tok_s, *args)
    return lambda: bound(future.result())


def best_gpu_tok_s(profile: Profile, policy: PolicySpec | None, bar: ServiceBar, rank: int, mean_in: float,
                   mean_out: float) -> float:
    """Tokens/s of the highest rate one adapter of ``rank`` at these mean lengths keeps within ``bar`` on one
    GPU (doubling in short runs, then bisection to :data:`TOLERANCE`); 0 when even a trickle misses it."""
    ttft = np.inf if bar.max_ttft_s is None else bar.max_ttft_s * 1000.0
    tpot = np.inf if bar.max_tpot_ms is None else bar.max_tpot_ms

    def meets(rate: float, run: TwinRun = BOUND_RUN, judged: ServiceBar = bar) -> bool:
        sc = GpuScenario(np.array([rank]), np.array([rate]), np.array([mean_in]), np.array([mean_out]), 1,
                         max_ttft_ms=ttft, max_tpot_ms=tpot)
        return bool(twin_check(profile, policy, [sc], judged, run).meets(judged)[0])

    lo, hi = 0.0, 1.0
    # a short run serves a smaller share of its tokens (the requests in flight at its end): only starving counts
    while meets(hi, BRACKET_RUN, replace(bar, min_served=STARVATION_THRESHOLD)):
        lo, hi = hi, hi * 2
    while True:
        verified = False
        while hi - lo > max(lo * (TOLERANCE - 1.0), MIN_RATE_RPS):
            mid = (lo + hi) / 2
            if meets(mid):
                lo, verified = mid, True
            else:
                hi = mid
        if verified or lo == 0.0 or meets(lo):
            return lo * (mean_in + mean_out)
        lo, hi = lo / 2, lo  # the short runs passed a rate the full ones do not: the bracket is lower


def bound_words(record: dict[str, Any], gpus: int) -> str:
    """The bound beside a plan of ``gpus`` GPUs, in words."""
    if record.get("gpu_tok_s") is None:  # nothing arrives
        return f"lower bound: {record['gpus']} GPU(s): no traffic arrives"
    line = (f"lower bound: {record['gpus']} GPU(s): {record['arriving_tok_s']:,.0f} tok/s arriving over "
            f"{record['gpu_tok_s']:,.0f} tok/s, the most one GPU serves within the SLO in the twin without a margin "
            f"(one rank-{record['rank']} adapter at the mean request)")
    if record["gpus"]:
        line += f"; this plan is {gpus / record['gpus']:.2f}x it"
    return line
