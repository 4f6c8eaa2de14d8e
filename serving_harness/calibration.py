"""Calibrate a profile's step-latency model on real Poisson workloads (not the validation ones).

The micro-benchmarks of serving_harness/profiling.py measure each term alone. Under real traffic the
engine also shares the machine with its API server (streaming every token) and the load generator,
and requests arrive and finish every step; on a small CPU box that changes the step time. This
module replays the calibration workloads' exact requests through the twin and fits four parameters:
three scale factors — on the fixed per-step terms (k5, l0), the per-request terms (k4, l1) and the
prompt-token term (kp) — and the arrival delay of twin/profile.py, minimising the squared log errors
of throughput and ITL (TTFT at a quarter weight) by a coordinate search: the scales first (no delay),
then all four from there, so the delay is only non-zero where it lowers the loss. The
micro-benchmark fit stays in the profile as a latency variant; :func:`recalibrate` redoes the fit
from a profile's stored runs without vLLM.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from serving_harness.loadgen import RunRecords, summarise
from serving_harness.metrics import MetricsSeries
from serving_harness.window import UNRECORDED, run_window
from twin.errors import BadInputError
from twin.profile import Profile, StepLatency, profile_from_dict, step_latency_to_dict
from twin.simulate import SimConfig, simulate
from twin.workload import Adapter, Requests, Workload, trace_requests

#: Weights of the squared log errors (throughput, ITL, TTFT).
WEIGHTS = (1.0, 1.0, 0.25)


@dataclass(frozen=True)
class RecordedRun:
    """One real workload run: its settings, the requests sent and the real figures."""

    case_id: str
    a_max: int
    max_lora_rank: int
    workload: Workload
    requests: Requests
    real: dict
    kv_tokens: int | None = None  # the explicit KV cache its engine ran with (``workloads.json``'s ``kv_cache``)


def stored_workloads(work_dir: str | Path) -> dict:
    """The workload set a work dir ran (its ``workloads.json``: count, seed, cases)."""
    path = Path(work_dir) / "workloads.json"
    if not path.is_file():
        raise BadInputError(f"{work_dir}: no workloads.json (not a `planner validate` or calibration work dir)")
    return json.loads(path.read_text(encoding="utf-8"))


def stored_seed(work_dir: str | Path) -> int | None:
    """The seed a work dir's workloads were drawn with; None where it kept no ``workloads.json``."""
    return stored_workloads(work_dir)["seed"] if (Path(work_dir) / "workloads.json").is_file() else None


def calibration_run_dirs(calibration: dict) -> list[Path]:
    """The work dirs a profile's ``provenance.calibration`` was fitted to (one path, or a list when pooled)."""
    runs = calibration.get("runs")
    return [] if runs is None else [Path(r) for r in ([runs] if isinstance(runs, str) else runs)]


def distinct_dirs(dirs: Sequence[str | Path]) -> list[Path]:
    """``dirs`` as paths, a directory given twice (by another name too) counted once."""
    return list({Path(d).resolve(): Path(d) for d in dirs}.values())


def saved_cases(work_dir: str | Path) -> list[dict]:
    """The cases a :class:`serving_harness.validation.Validator` saved under ``work_dir`` (``cases/*.json``, in
    order; none where there is no such directory)."""
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted((Path(work_dir) / "cases").glob("*.json"))]


def recorded_run(work_dir: Path, row: dict, duration_s: float, warmup_s: float) -> RecordedRun:
    """The run of one saved case (``row``: its cases/*.json), with its requests from runs/*.parquet.

    Each request arrives at the time the load generator sent it, not the time it was drawn for: the
    engine only saw what was sent, and a load generator short of CPU sends late (a gap in the
    arrivals can let the dominant adapter's running set empty, and the engine switch adapters). A
    request never sent (cut at the window's end) keeps its drawn time. The real figures are computed
    afresh from the stored requests (not taken from ``row``, which has those of the day it ran), plus
    the engine-timed ITL from the stored metrics."""
    runs = work_dir / "runs"
    stored = runs / f"{row['case_id']}-requests.parquet"
    if not stored.is_file():
        raise BadInputError(f"{work_dir}: case {row['case_id']} has no {stored.name} in runs/ (a copy without its "
                            "requests?); restore it, or remove the case's cases/*.json")
    records = RunRecords.from_parquet(stored)
    workload = Workload(tuple(Adapter(name, rank, rate) for name, rank, rate in
                              zip(row["adapter_ids"], row["ranks"], row["rates_rps"])))
    arrival = records.engine_arrival_s
    order = np.argsort(arrival, kind="stable")
    requests = trace_requests(workload, arrival[order], records.adapter[order], records.input_tokens[order],
                              records.output_tokens[order])
    metrics = runs / f"{row['case_id']}-metrics.parquet"
    engine_itl = MetricsSeries.from_parquet(metrics).engine_itl_ms(warmup_s, duration_s) if metrics.is_file() \
        else float("nan")
    real = {**asdict(summarise(records, duration_s, warmup_s)), "itl_ms_engine": engine_itl}
    kv = stored_workloads(work_dir).get("kv_cache") if (work_dir / "workloads.json").is_file() else None
    return RecordedRun(row["case_id"], row["a_max"], row["max_lora_rank"], workload, requests, real,
                       kv["tokens"] if kv else None)


#: Parameters: log scales of (k5, l0), (k4, l1) and kp, then the arrival delay in ms.
PARAMETERS = ("fixed", "per_request", "prefill", "arrival_delay_ms")
#: Coordinate-search units per parameter and stage (the first step, 0.4, moves the delay by 10 ms)
#: and lower bounds.
STAGES = ((1.0, 1.0, 1.0, 0.0), (1.0, 1.0, 1.0, 25.0))
LOWER = np.array([-np.inf, -np.inf, -np.inf, 0.0])


def calibrated(latency: StepLatency, theta: np.ndarray, source: str = "") -> StepLatency:
    """``latency`` with the parameters ``theta`` (``PARAMETERS`` order) applied."""
    fixed, per_request, prefill = np.exp(theta[:3])
    return replace(latency, k5=latency.k5 * fixed, l0=latency.l0 * fixed, k4=latency.k4 * per_request,
                   l1=latency.l1 * per_request, kp=latency.kp * prefill, arrival_delay=float(theta[3]),
                   source=source or latency.source)


def twin_result(profile: Profile, run: RecordedRun, duration_s: float, warmup_s: float) -> dict:
    """The twin's figures for the very requests of ``run`` (trace replay), with its engine's KV cache where that
    was set explicitly."""
    if run.kv_tokens:
        profile = profile.with_kv_tokens(run.kv_tokens)
    sim = simulate(run.workload, profile, SimConfig(a_max=run.a_max, duration_s=duration_s, warmup_s=warmup_s,
                                                    max_lora_rank=run.max_lora_rank), requests=run.requests)
    return {k: v for k, v in sim.to_dict().items() if not isinstance(v, (dict, list))}


def twin_errors(profile: Profile, runs: list[RecordedRun], duration_s: float, warmup_s: float) -> np.ndarray:
    """Per run: log(twin / real) of throughput, ITL, TTFT (0 where a figure is missing)."""
    out = np.zeros((len(runs), 3))
    for i, run in enumerate(runs):
        sim = twin_result(profile, run, duration_s, warmup_s)
        for j, key in enumerate(("total_throughput_tok_s", "itl_ms_mean", "ttft_ms_mean")):
            pred, real = sim[key], run.real[key]
            if pred and real and np.isfinite(pred) and np.isfinite(real) and pred > 0 and real > 0:
                out[i, j] = np.log(pred / real)
    return out


def loss(errors: np.ndarray) -> float:
    return float(np.mean(errors ** 2 @ np.array(WEIGHTS)))


def _coordinate_search(f, theta: np.ndarray, units: tuple[float, ...], best: float,
                       max_rounds: int) -> tuple[np.ndarray, float]:
    """Greedy coordinate search from ``theta`` (loss ``best``) moving the parameters with a unit > 0."""
    step = 0.4
    for _ in range(max_rounds):
        improved = False
        for k, unit in enumerate(units):
            for sign in (1.0, -1.0) if unit else ():
                trial = theta.copy()
                trial[k] = max(LOWER[k], trial[k] + sign * step * unit)
                if trial[k] == theta[k]:
                    continue
                value = f(trial)
                if value < best:
                    theta, best, improved = trial, value, True
                    break
        if not improved:
            step /= 2
            if step < 0.01:
                break
    return theta, best


@dataclass(frozen=True)
class Calibration:
    """A fit's parameters (``PARAMETERS`` order) and its loss before, with the scales only and after
    (scales and arrival delay)."""

    theta: np.ndarray
    loss_before: float
    loss_scales_only: float
    loss_after: float


def calibrate(profile: Profile, runs: list[RecordedRun], duration_s: float, warmup_s: float,
              max_rounds: int = 40) -> Calibration:
    """Fit ``PARAMETERS`` to ``runs`` from the profile's own step latency (scales 1, no arrival delay)."""
    base = profile.step_latency
    seen: dict[tuple[float, ...], float] = {}  # a search often steps back onto a point it has scored

    def f(theta: np.ndarray) -> float:
        key = tuple(theta.tolist())
        if key not in seen:
            seen[key] = loss(twin_errors(replace(profile, step_latency=calibrated(base, theta)), runs, duration_s,
                                         warmup_s))
        return seen[key]

    scales, with_delay = STAGES
    theta = np.zeros(len(PARAMETERS))
    before = f(theta)
    theta, scales_only = _coordinate_search(f, theta, scales, before, max_rounds)
    theta, best = _coordinate_search(f, theta, with_delay, scales_only, max_rounds)
    return Calibration(theta, before, scales_only, best)


def calibrated_profile(profile: dict, runs: list[RecordedRun], duration_s: float, warmup_s: float,
                       meta: dict) -> dict:
    """The profile JSON ``profile`` (whose ``step_latency_ms`` is the micro-benchmark fit) calibrated to
    ``runs``; the fit and ``meta`` (seed, runs directory, ...) go into ``provenance.calibration``."""
    micro = profile_from_dict(profile, where=f"profile {profile.get('profile_id')}")
    fit = calibrate(micro, runs, duration_s, warmup_s)
    fixed, per_request, prefill = np.exp(fit.theta[:3])
    delay = float(fit.theta[3])
    latency = calibrated(micro.step_latency, fit.theta, source=(
        f"micro-benchmark fit ({micro.step_latency.source}) scaled by {fixed:.3f} (k5, l0), {per_request:.3f} "
        f"(k4, l1), {prefill:.3f} (kp), plus an arrival delay of {delay:.1f} ms, fitted to {len(runs)} "
        f"calibration workloads (serving_harness/calibration.py)"))
    return {
        **profile,
        "step_latency_ms": step_latency_to_dict(latency),
        "step_latency_variants": {**profile.get("step_latency_variants", {}),
                                  "microbenchmarks": profile["step_latency_ms"]},
        "provenance": {**profile["provenance"], "calibration": {
            "workloads": len(runs), **meta, "duration_s": duration_s, "warmup_s": warmup_s,
            "scales": {"fixed": fixed, "per_request": per_request, "prefill": prefill},
            "arrival_delay_ms": delay,
            "loss_before": fit.loss_before, "loss_scales_only": fit.loss_scales_only, "loss_after": fit.loss_after}},
    }


def recalibrate(path: str | Path, command: str, runs_dirs: Sequence[str | Path] = (),
                duration_s: float | None = None, warmup_s: float | None = None) -> dict:
    """The profile JSON at ``path`` with its calibration refitted to its stored calibration runs (or
    those under ``runs_dirs``, pooled), no engine needed. A profile measured without calibration cases is
    calibrated for the first time (its step latency is the micro-benchmark fit; ``runs_dirs`` is then
    needed). Its ``validation`` figures belonged to the previous step latency and are dropped:
    re-score the validation runs to restore them. ``duration_s``/``warmup_s``: how the runs were made, for runs
    that do not record it (default: as the previous calibration's, else 30 / 5 s: :func:`run_window`).

    Several work dirs — the same calibration workloads run on different days, say — are fitted as one
    set, so that the fit describes the machine's usual speed rather than one day's; they must share a
    workload seed, which `planner validate --record` then refuses."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise BadInputError(f"{path}: cannot read profile JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadInputError(f"{path}: a profile JSON is an object, not {type(data).__name__}")
    previous = data.get("provenance", {}).get("calibration")
    micro = (data.get("step_latency_variants") or {}).get("microbenchmarks")
    if previous is None:
        if data.get("provenance", {}).get("kind") != "measured":
            raise BadInputError(f"{path} was not measured by `planner profile`: only a measured profile's "
                                "micro-benchmark fit can be calibrated")
        if not runs_dirs:
            raise BadInputError(f"{path} has not been calibrated: pass --runs (a `planner validate` work dir "
                                "of workloads it will not be validated on)")
        previous, micro = {}, data["step_latency_ms"]
    elif micro is None:
        raise BadInputError(f"{path}: calibrated, but its 'microbenchmarks' latency variant is missing; "
                            "measure it again with `planner profile`")
    before = calibration_run_dirs(previous)
    dirs = distinct_dirs(runs_dirs) or before
    if not dirs:
        raise BadInputError(f"{path}: its calibration records no runs; pass --runs")
    same_runs = {d.resolve() for d in dirs} == {d.resolve() for d in before}
    cases = {d: saved_cases(d) for d in dirs}
    for d, rows in cases.items():
        if not rows:
            raise BadInputError(f"{d}: no stored calibration runs (cases/*.json and runs/ of `planner profile` or "
                                "`planner validate`)")
    seeds = {stored_seed(d) for d in dirs}  # the runs fitted may be another set than before
    if len(seeds) > 1:
        raise BadInputError("--runs: pool runs of one workload set; these were drawn with seeds "
                            + ", ".join(str(x) for x in sorted(seeds, key=str)))
    seed = seeds.pop()
    if seed is None and same_runs:
        seed = previous.get("seed")
    meta = {"seed": seed, "runs": str(dirs[0]) if len(dirs) == 1 else [str(d) for d in dirs], "command": command,
            "date": time.strftime("%Y-%m-%d")}
    duration, warmup = run_window([row for rows in cases.values() for row in rows], duration_s, warmup_s,
                                  ", ".join(map(str, dirs)),
                                  (previous.get("duration_s", UNRECORDED[0]), previous.get("warmup_s", UNRECORDED[1])))
    runs = [recorded_run(d, row, duration, warmup) for d, rows in cases.items() for row in rows]
    data = calibrated_profile({**data, "step_latency_ms": micro}, runs, duration, warmup, meta)
    data.pop("validation", None)
    return data
