"""What the planner asks: given one GPU's adapters and ``--max-loras``, what throughput, and does it starve?

A :class:`Predictor` answers for a batch of :class:`GpuScenario`. Backends:

* ``twin`` — runs the digital twin on each scenario (slow, exact; for checks and as the fallback
  while no surrogate is trained for a profile and policy);
* ``surrogate`` — the compiled random forests of ``artifacts/surrogates/<profile-id>/``
  (:mod:`models.surrogate`; a non-stock serving policy has its own subdirectory);
* ``small-tree`` — the distilled trees of at most 32 rules from the same artifact.

Every predictor answers for one serving policy (``policy``: a :class:`twin.policies.PolicySpec`,
None for stock vLLM). :func:`default_predictor` gives the ``surrogate`` when a usable artifact
for that profile and policy exists, else the ``twin``.

Memory feasibility is not a prediction: callers check ``twin.policies.kv_capacity(profile,
policy).tokens_for`` first; a scenario the engine cannot start with raises
:class:`twin.errors.InfeasibleError`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import numpy as np

from twin.errors import BadInputError
from twin.policies.spec import PolicySpec
from twin.profile import Profile
from twin.simulate import MAX_SIM_REQUESTS, STARVATION_THRESHOLD, SimConfig, expected_requests, simulate
from twin.workload import Adapter, Workload


@dataclass(frozen=True)
class GpuScenario:
    """One GPU's load: per-adapter ranks, rates and mean lengths, and the A_max it runs with."""

    ranks: np.ndarray  # int64, one per adapter
    rates_rps: np.ndarray  # float64
    input_tokens: np.ndarray  # float64 mean prompt tokens per adapter
    output_tokens: np.ndarray  # float64 mean output tokens per adapter
    a_max: int
    max_lora_rank: int | None = None  # None: the smallest profiled rank holding every adapter
    # The latency SLO the GPU must meet (the strictest of its adapters'); inf: none.
    max_ttft_ms: float = float("inf")  # p99 time to first token over every arrival
    max_tpot_ms: float = float("inf")  # p99 time per output token over finished requests

    @property
    def arriving_tok_s(self) -> float:
        return float(np.dot(self.rates_rps, self.input_tokens + self.output_tokens))

    def __len__(self) -> int:
        return int(self.ranks.shape[0])


@dataclass(frozen=True)
class Predictions:
    throughput_tok_s: np.ndarray  # float64, one per scenario
    starved: np.ndarray  # bool
    arriving_tok_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # Latency, where the predictor gives it (None otherwise): p99 TTFT over every arrival
    # (``SimResult.ttft_ms_p99_all``) and p99 time per output token; from the twin, also mean ITL.
    ttft_ms_p99_all: np.ndarray | None = None
    tpot_ms_p99: np.ndarray | None = None
    itl_ms_mean: np.ndarray | None = None

    def meets_latency(self, scenarios: Sequence[GpuScenario]) -> np.ndarray:
        """Which scenarios are predicted within their latency SLO (true where a figure is not predicted)."""
        ok = np.ones(len(scenarios), bool)
        for figure, limit in ((self.ttft_ms_p99_all, "max_ttft_ms"), (self.tpot_ms_p99, "max_tpot_ms")):
            if figure is not None:
                ok &= ~(figure > np.array([getattr(s, limit) for s in scenarios]))  # NaN (no request): no miss
        return ok


class Predictor(Protocol):
    profile_id: str
    kind: str
    policy: PolicySpec | None

    def predict(self, scenarios: Sequence[GpuScenario]) -> Predictions: ...


@dataclass
class TwinPredictor:
    """Answers by simulating each scenario (the ``arrivals`` process, Poisson by default; the profile's length
    model; a fixed seed); ``jobs`` > 1 simulates the scenarios of one call in that many forked processes.
    ``slowdown`` runs the twin on a GPU that many times slower than the profile (``Profile.slowed``)."""

    profile: Profile
    duration_s: float = 3600.0
    seed: int = 0
    kind: str = "twin"
    policy: PolicySpec | None = None
    jobs: int = 1
    slowdown: float = 1.0
    arrivals: object = None  # a twin arrival process; None: Poisson
    progress: Callable[[int, int], None] | None = None  # (scenarios done, of) after each one

    @property
    def profile_id(self) -> str:
        return self.profile.profile_id

    def predict(self, scenarios: Sequence[GpuScenario]) -> Predictions:
        n = len(scenarios)
        one = partial(_simulate, self.profile.slowed(self.slowdown), self.duration_s, self.seed, self.policy,
                      self.arrivals)
        if self.jobs > 1 and n > 1:
            ctx = multiprocessing.get_context("fork")  # workers inherit the compiled twin: no start-up compile
            pool = ProcessPoolExecutor(min(self.jobs, n), mp_context=ctx, initializer=die_with_parent)
            try:
                out = self._collect(pool.map(one, scenarios, chunksize=max(1, n // (8 * self.jobs))), n)
            except BaseException:  # Ctrl-C or an error: drop the queued scenarios instead of finishing them
                pool.shutdown(wait=False, cancel_futures=True)
                for proc in list(getattr(pool, "_processes", {}).values()):
                    proc.kill()
                raise
            pool.shutdown()
        else:
            out = self._collect(map(one, scenarios), n)
        res = np.array(out, float).reshape(n, 5)
        thr, arriving = res[:, 0].copy(), res[:, 1].copy()
        return Predictions(thr, thr < STARVATION_THRESHOLD * arriving, arriving, res[:, 2].copy(), res[:, 3].copy(),
                           res[:, 4].copy())

    def _collect(self, results, n: int) -> list:
        out = []
        for row in results:
            out.append(row)
            if self.progress:
                self.progress(len(out), n)
        return out


def die_with_parent() -> None:
    """In a worker process: have the kernel kill it when its parent dies (Linux ``PR_SET_PDEATHSIG``), so no
    worker outlives a planner command stopped by SIGTERM, SIGKILL or a crash."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the pool's own shutdown has to do
        return
    if os.getppid() == 1:  # the parent died before the call: nothing would signal this worker
        os._exit(1)


def _simulate(profile: Profile, duration_s: float, seed: int, policy: PolicySpec | None, arrivals,
              sc: GpuScenario) -> tuple[float, ...]:
    """(throughput, arriving) tokens/s, p99 TTFT over every arrival, p99 TPOT and mean ITL (ms) of one scenario
    in the twin (a module function: it goes to worker processes)."""
    workload = Workload(tuple(
        Adapter(f"a{j}", int(sc.ranks[j]), float(sc.rates_rps[j]), float(sc.input_tokens[j]), float(sc.output_tokens[j]))
        for j in range(len(sc))
    ))
    if expected_requests(workload, duration_s) > MAX_SIM_REQUESTS:  # far beyond any GPU: starved, not drawn
        return 0.0, sc.arriving_tok_s, float("inf"), float("inf"), float("inf")
    config = SimConfig(a_max=sc.a_max, duration_s=duration_s, seed=seed, max_lora_rank=sc.max_lora_rank, policy=policy,
                       **({} if arrivals is None else {"arrivals": arrivals}))
    res = simulate(workload, profile, config)
    return res.total_throughput_tok_s, res.arriving_tok_s, res.ttft_ms_p99_all, res.tpot_ms_p99, res.itl_ms_mean


PredictorFactory = Callable[[Profile, PolicySpec | None], Predictor]


def _surrogate(kind: str) -> PredictorFactory:
    def factory(profile: Profile, policy: PolicySpec | None) -> Predictor:
        from models.surrogate import SurrogatePredictor

        return SurrogatePredictor(profile, kind, policy=policy)

    return factory


def _twin(profile: Profile, policy: PolicySpec | None) -> Predictor:
    return TwinPredictor(profile, policy=policy)


_BACKENDS: dict[str, PredictorFactory] = {
    "twin": _twin, "surrogate": _surrogate("surrogate"), "small-tree": _surrogate("small-tree"),
}


def predictor_names() -> list[str]:
    return sorted(_BACKENDS)


def load_predictor(profile: Profile, kind: str = "twin", policy: PolicySpec | None = None) -> Predictor:
    try:
        factory = _BACKENDS[kind]
    except KeyError:
        raise BadInputError(f"unknown predictor '{kind}'; choose one of {', '.join(predictor_names())}") from None
    return factory(profile, policy)


def default_predictor(profile: Profile, policy: PolicySpec | None = None) -> Predictor:
    """The ``surrogate`` when an artifact for this profile and policy ships, else the ``twin``. An artifact
    that is there but damaged, or made for another version of the profile, is an error (ProfileError naming
    the file and the command that rebuilds it), never a silent fall back to the slower twin."""
    from models.surrogate import artifact_dir, has_artifact

    if not has_artifact(profile, artifact_dir(profile, None, policy)):
        return load_predictor(profile, "twin", policy)
    return load_predictor(profile, "surrogate", policy)
