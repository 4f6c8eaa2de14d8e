"""Calibrate a profile's step-latency model on real Poisson workloads (not the validation ones).

The micro-benchmarks of serving_harness/profiling.py measure each term alone. Under real traffic the
engine also shares the machine with its API server (streaming every token) and the load generator,
and requests arrive and finish every step; on a small CPU box that changes the step time. This
module replays the calibration workloads' exact requests through the twin and fits three scale
factors — on the fixed per-step terms (k5, l0), the per-request terms (k4, l1) and the prompt-token
term (kp) — minimising the squared log errors of throughput and ITL (TTFT at a quarter weight) by a
coordinate search in log space. The micro-benchmark fit stays in the profile as a latency variant.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from serving_harness.loadgen import RunRecords
from twin.profile import Profile, StepLatency
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


def load_runs(work_dir: str | Path, case_ids: list[str] | None = None) -> list[RecordedRun]:
    """The runs a :class:`serving_harness.validation.Validator` saved under ``work_dir`` (all, or ``case_ids``)."""
    work = Path(work_dir)
    runs = []
    paths = (sorted((work / "cases").glob("*.json")) if case_ids is None
             else [work / "cases" / f"{c}.json" for c in case_ids])
    for case_path in paths:
        row = json.loads(case_path.read_text(encoding="utf-8"))
        records = RunRecords.from_parquet(work / "runs" / f"{row['case_id']}-requests.parquet")
        workload = Workload(tuple(Adapter(name, rank, rate) for name, rank, rate in
                                  zip(row["adapter_ids"], row["ranks"], row["rates_rps"])))
        requests = trace_requests(workload, records.arrival_s, records.adapter, records.input_tokens,
                                  records.output_tokens)
        runs.append(RecordedRun(row["case_id"], row["a_max"], row["max_lora_rank"], workload, requests, row["real"]))
    return runs


def scaled(latency: StepLatency, log_scales: np.ndarray, source: str = "") -> StepLatency:
    fixed, per_request, prefill = np.exp(log_scales)
    return replace(latency, k5=latency.k5 * fixed, l0=latency.l0 * fixed, k4=latency.k4 * per_request,
                   l1=latency.l1 * per_request, kp=latency.kp * prefill, source=source or latency.source)


def twin_result(profile: Profile, run: RecordedRun, duration_s: float, warmup_s: float) -> dict:
    """The twin's figures for the very requests of ``run`` (trace replay)."""
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


def calibrate(profile: Profile, runs: list[RecordedRun], duration_s: float, warmup_s: float,
              max_rounds: int = 40) -> tuple[np.ndarray, float, float]:
    """(log scales, loss before, loss after) of the coordinate search from scales 1."""
    base = profile.step_latency

    def f(theta: np.ndarray) -> float:
        return loss(twin_errors(replace(profile, step_latency=scaled(base, theta)), runs, duration_s, warmup_s))

    theta = np.zeros(3)
    best = before = f(theta)
    step = 0.4
    for _ in range(max_rounds):
        improved = False
        for k in range(3):
            for sign in (1.0, -1.0):
                trial = theta.copy()
                trial[k] += sign * step
                value = f(trial)
                if value < best:
                    theta, best, improved = trial, value, True
                    break
        if not improved:
            step /= 2
            if step < 0.01:
                break
    return theta, before, best
