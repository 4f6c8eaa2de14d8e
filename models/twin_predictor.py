"""The exact backend: a :class:`Predictor` that runs the digital twin on each scenario."""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, is_dataclass, replace
from functools import partial

import numba
import numpy as np

from models.scenario import GpuScenario, Predictions
from models.surrogate import simulation_hash
from models.twin_memo import MEMO, run_key, scenario_key
from twin.policies.spec import PolicySpec
from twin.profile import Profile
from twin.simulate import (
    MAX_SIM_REQUESTS,
    STARVATION_THRESHOLD,
    SimConfig,
    config_requests,
    draw_settings,
    expected_requests,
    simulate,
)
from twin.workload import Adapter, LengthModel, Requests, Workload


@dataclass(frozen=True)
class FewAdapters:
    """How a GPU serving at most ``adapters`` adapters is judged instead: on a GPU ``slowdown`` times slower than
    the profile, its p99 TPOT taken ``tpot_factor`` times the twin's and its TTFT ``ttft_ms_per_adapter`` ms per
    adapter it serves above the twin's (the twin's measured error there; planner.verdict.few_adapters)."""

    adapters: int
    slowdown: float
    tpot_factor: float = 1.0
    ttft_ms_per_adapter: float = 0.0

    def covers(self, sc: GpuScenario) -> bool:
        return len(sc) <= self.adapters

    def to_dict(self) -> dict[str, float]:
        return {"adapters": self.adapters, "slowdown": self.slowdown, "tpot_factor": self.tpot_factor,
                "ttft_ms_per_adapter": self.ttft_ms_per_adapter}


@dataclass
class TwinPredictor:
    """Answers by simulating each scenario (the ``arrivals`` process, Poisson by default; the profile's length
    model; a fixed seed); ``jobs`` > 1 simulates the scenarios of one call in that many forked processes.
    ``slowdown`` runs the twin on a GPU that many times slower than the profile (``Profile.slowed``), or as
    ``few`` says for a GPU of few adapters."""

    profile: Profile
    duration_s: float = 3600.0
    seed: int = 0
    kind: str = "twin"
    policy: PolicySpec | None = None
    jobs: int = 1
    slowdown: float = 1.0
    arrivals: object = None  # a twin arrival process; None: Poisson
    progress: Callable[[int, int], None] | None = None  # (scenarios done, of) after each one
    # A scenario expected to see fewer than ``min_requests`` arrivals in ``duration_s`` runs longer, up to
    # ``max_duration_s``: its p99 figures come from enough requests (0: every scenario runs ``duration_s``).
    min_requests: float = 0.0
    max_duration_s: float = 3600.0
    # A judging run's load margin (its load - 1): a scenario whose request sizes vary more than the profile's
    # default lengths do is simulated with that margin scaled up (:func:`size_factor`; 0: as asked).
    size_margin: float = 0.0
    few: FewAdapters | None = None

    @property
    def profile_id(self) -> str:
        return self.profile.profile_id

    def predict(self, scenarios: Sequence[GpuScenario]) -> Predictions:
        n = len(scenarios)
        extra = np.ones(n)
        if self.size_margin > 0:
            extra = np.array([size_factor(sc, self.profile, self.size_margin) for sc in scenarios])
            scenarios = [sc if e == 1.0 else replace(sc, rates_rps=sc.rates_rps * e) for sc, e in zip(scenarios, extra)]
        few = np.zeros(n, bool) if self.few is None else np.array([self.few.covers(sc) for sc in scenarios], bool)
        profiles = (self.profile.slowed(self.slowdown),
                    self.profile.slowed(self.few.slowdown) if few.any() else None)
        one = partial(_simulate_on, profiles, self.duration_s, self.seed, self.policy, self.arrivals,
                      self.min_requests, self.max_duration_s)
        items = [(sc, bool(f)) for sc, f in zip(scenarios, few)]
        keys = self._memo_keys(items)
        out = [None if k is None else MEMO.get(k) for k in keys]
        ask = [i for i, row in enumerate(out) if row is None]
        if len(ask) < n:
            self._advance(n - len(ask), n)
        if self.jobs > 1 and len(ask) > 1:
            rows = self._in_workers(one, [items[i] for i in ask], n - len(ask), n)
        else:
            rows = []
            for i in ask:
                rows.append(one(items[i]))
                self._advance(n - len(ask) + len(rows), n)
        for i, row in zip(ask, rows):
            out[i] = row
            if keys[i] is not None:
                MEMO.put(keys[i], row)
        res = np.array(out, float).reshape(n, 6)
        if few.any():  # the twin's measured error at few adapters (FewAdapters)
            served = np.array([len(sc) for sc in scenarios], float)[few]
            res[few, 2] += self.few.ttft_ms_per_adapter * served
            res[few, 5] += self.few.ttft_ms_per_adapter * served
            res[few, 3] *= self.few.tpot_factor
        thr, arriving = res[:, 0] / extra, res[:, 1] / extra  # per the traffic asked about
        return Predictions(thr, thr < STARVATION_THRESHOLD * arriving, arriving, res[:, 2].copy(), res[:, 3].copy(),
                           res[:, 4].copy(), res[:, 5].copy())

    def _memo_keys(self, items: Sequence[tuple[GpuScenario, bool]]) -> list[bytes | None]:
        """Each item's key in :data:`MEMO`; None where the run cannot be keyed by value (an arrival process that is
        not a dataclass: its ``repr`` may be an address)."""
        if self.arrivals is not None and not is_dataclass(self.arrivals):
            return [None] * len(items)
        run = run_key(simulation_hash(self.profile, self.policy), self.slowdown, self.few, self.duration_s, self.seed,
                      self.policy, self.arrivals, self.min_requests, self.max_duration_s)
        return [scenario_key(run, sc, f) for sc, f in items]

    def _in_workers(self, one: Callable, items: Sequence[tuple[GpuScenario, bool]], before: int, total: int) -> list:
        """``one`` of each (scenario, few) item, in the worker pool: the costliest first (by expected requests), in
        chunks that shrink as the work left does, so no worker waits long for another at the end (progress counts
        ``before`` answers done of ``total``)."""
        n = len(items)
        cost = np.array([float(np.sum(sc.rates_rps)) * scenario_duration_s(sc, self.duration_s, self.min_requests,
                                                                             self.max_duration_s) for sc, _ in items])
        order = np.argsort(-cost, kind="stable")
        pool = worker_pool(self.jobs)
        out: list = [None] * n
        try:
            pending = {pool.submit(_simulate_each, one, [items[i] for i in chunk]): chunk
                       for chunk in guided_chunks(order, self.jobs)}
            done = 0
            for fut in as_completed(pending):
                for i, row in zip(pending[fut], fut.result()):
                    out[i] = row
                done += len(pending[fut])
                self._advance(before + done, total)
        except BaseException:  # Ctrl-C or an error: drop the queued scenarios instead of finishing them
            close_worker_pool(kill=True)
            raise
        return out

    def _advance(self, done: int, n: int) -> None:
        if self.progress:
            self.progress(done, n)


def guided_chunks(order: np.ndarray, jobs: int) -> list[np.ndarray]:
    """``order`` cut into consecutive chunks of a quarter of the work left per worker (at least one item):
    few chunks to send, and small ones last."""
    chunks, start, n = [], 0, len(order)
    while start < n:
        size = max(1, (n - start) // (4 * jobs))
        chunks.append(order[start:start + size])
        start += size
    return chunks


def _simulate_each(one: Callable, items: list) -> list[tuple[float, ...]]:
    """``one`` of each item (a module function: it goes to worker processes)."""
    return [one(item) for item in items]


_POOL: dict[int, ProcessPoolExecutor] = {}


def worker_pool(jobs: int) -> ProcessPoolExecutor:
    """This process's pool of ``jobs`` forked twin workers, started on first use and kept: a plan asks the
    twin hundreds of times (a twin-packed GPU alone asks it dozens of times), and forking a pool per call
    cost a second of a 10,000-adapter plan."""
    if jobs not in _POOL:
        close_worker_pool()
        ctx = multiprocessing.get_context("fork")  # workers inherit the compiled twin: no start-up compile
        _POOL[jobs] = ProcessPoolExecutor(jobs, mp_context=ctx, initializer=die_with_parent)
    return _POOL[jobs]


def close_worker_pool(kill: bool = False) -> None:
    """Shut the workers down (``kill``: at once, dropping queued work)."""
    for pool in _POOL.values():
        pool.shutdown(wait=not kill, cancel_futures=True)
        if kill:
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                proc.kill()
    _POOL.clear()


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


def size_variability(sc: GpuScenario, lengths: LengthModel) -> float:
    """Squared coefficient of variation of a request's tokens (prompt + output) on this GPU: its adapters' mean
    lengths mixed by their request rates, each request's lengths drawn around them by ``lengths``."""
    cv_in2, cv_out2 = length_cv2(lengths)
    return size_cv2(np.asarray(sc.rates_rps, float), np.asarray(sc.input_tokens, float),
                    np.asarray(sc.output_tokens, float), cv_in2, cv_out2)


def length_cv2(lengths: LengthModel) -> tuple[float, float]:
    """Squared coefficients of variation of one adapter's prompt and output lengths around their means."""
    return (lengths.input_cv ** 2, lengths.output_cv ** 2) if lengths.kind != "constant" else (0.0, 0.0)


@numba.njit(cache=True)
def size_cv2(rates, input_tokens, output_tokens, cv_in2, cv_out2):
    """:func:`size_variability` of adapters given as arrays (the packer asks it of every window it tries)."""
    n = rates.shape[0]
    total = rates.sum()
    mean = 0.0
    second = 0.0
    for i in range(n):
        w = rates[i] / total if total > 0 else 1.0 / n
        d_in, d_out = input_tokens[i], output_tokens[i]
        mean += w * (d_in + d_out)
        second += w * (d_in * d_in * (1.0 + cv_in2) + d_out * d_out * (1.0 + cv_out2) + 2.0 * d_in * d_out)
    return max(0.0, second / (mean * mean) - 1.0) if mean > 0 else 0.0


@numba.njit(cache=True)
def size_scale(cs2, one_cs2, margin):
    """:func:`size_factor` from the squared size variation ``cs2`` of a GPU and ``one_cs2`` of one adapter at
    the profile's default lengths."""
    k = (1.0 + cs2) / (1.0 + one_cs2)
    return 1.0 if k <= 1.0 + 1e-9 else (1.0 + margin * k) / (1.0 + margin)


def default_size_cv2(profile: Profile) -> float:
    """:func:`size_variability` of one adapter at the profile's default lengths (where k = 1)."""
    one = GpuScenario(np.ones(1, np.int64), np.ones(1), np.array([profile.default_input_tokens]),
                      np.array([profile.default_output_tokens]), 1)
    return size_variability(one, profile.default_lengths())


def size_factor(sc: GpuScenario, profile: Profile, margin: float) -> float:
    """How much more traffic than asked a judging run of load ``1 + margin`` simulates on ``sc``: its margin
    times k, k = (1 + cs^2) / (1 + cs0^2) for the squared variation cs^2 of the GPU's request sizes and cs0^2 of
    one adapter at the profile's default lengths, when k > 1. A queue's wait grows with (1 + cs^2) (Kingman's
    approximation), so a GPU of mixed request sizes is held to a proportionally larger margin below its knee
    (docs/planning.md, "A larger margin for mixed request sizes")."""
    return size_scale(size_variability(sc, profile.default_lengths()), default_size_cv2(profile), margin)


def scenario_duration_s(sc: GpuScenario, duration_s: float, min_requests: float, max_duration_s: float) -> float:
    """How long ``sc`` is simulated: ``duration_s``, or as long as ``min_requests`` arrivals take, up to
    ``max_duration_s``."""
    if min_requests <= 0:
        return duration_s
    rate = float(np.sum(sc.rates_rps))
    return duration_s if rate <= 0 else float(np.clip(min_requests / rate, duration_s, max(duration_s, max_duration_s)))


def _simulate_on(profiles: tuple[Profile, Profile | None], duration_s: float, seed: int, policy: PolicySpec | None,
                 arrivals, min_requests: float, max_duration_s: float, item: tuple[GpuScenario, bool]) -> tuple[float, ...]:
    """:func:`_simulate` of a (scenario, few) ``item`` on the first of ``profiles``, or with few on the second."""
    sc, few = item
    return _simulate(profiles[1] if few else profiles[0], duration_s, seed, policy, arrivals, min_requests,
                     max_duration_s, sc)


def _simulate(profile: Profile, duration_s: float, seed: int, policy: PolicySpec | None, arrivals,
              min_requests: float, max_duration_s: float, sc: GpuScenario) -> tuple[float, ...]:
    """(throughput, arriving) tokens/s, p99 TTFT over every arrival, p99 TPOT, mean ITL and p99.9 TTFT (ms) of
    one scenario in the twin (a module function: it goes to worker processes)."""
    duration_s = scenario_duration_s(sc, duration_s, min_requests, max_duration_s)
    workload = Workload(tuple(
        Adapter(f"a{j}", int(sc.ranks[j]), float(sc.rates_rps[j]), float(sc.input_tokens[j]), float(sc.output_tokens[j]))
        for j in range(len(sc))
    ))
    if expected_requests(workload, duration_s) > MAX_SIM_REQUESTS:  # far beyond any GPU: starved, not drawn
        return 0.0, sc.arriving_tok_s, float("inf"), float("inf"), float("inf"), float("inf")
    config = SimConfig(a_max=sc.a_max, duration_s=duration_s, seed=seed, max_lora_rank=sc.max_lora_rank, policy=policy,
                       **({} if arrivals is None else {"arrivals": arrivals}))
    res = simulate(workload, profile, config, _shared_requests(workload, profile, config, sc))
    return (res.total_throughput_tok_s, res.arriving_tok_s, res.ttft_ms_p99_all, res.tpot_ms_p99, res.itl_ms_mean,
            res.ttft_ms_p999_all)


#: The last requests :func:`_shared_requests` drew in this process, by what they were drawn from.
_LAST_DRAWN: dict[tuple, Requests] = {}


def _shared_requests(workload: Workload, profile: Profile, config: SimConfig, sc: GpuScenario) -> Requests | None:
    """The requests of ``config`` for ``sc``, drawn once for consecutive runs that differ only in ``--max-loras``
    (keyed on the scenario's rates and lengths and :func:`~twin.simulate.draw_settings`):
    a GPU's group is asked at every A_max candidate on the very same requests (``best_a_max``), and drawing an
    hour of them took a third of a twin-packed plan (once in each process: workers draw their own). None where the
    draw cannot be keyed (an arrival process that is not hashable): :func:`simulate` draws them itself."""
    key = (*(np.ascontiguousarray(a, np.float64).tobytes() for a in (sc.rates_rps, sc.input_tokens, sc.output_tokens)),
           *draw_settings(profile, config))
    try:
        hash(key)
    except TypeError:
        return None
    if key not in _LAST_DRAWN:
        _LAST_DRAWN.clear()
        _LAST_DRAWN[key] = config_requests(workload, profile, config)
    return _LAST_DRAWN[key]
