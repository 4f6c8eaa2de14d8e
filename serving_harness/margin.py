"""A profile's safety margin from real runs: how much slower than its twin a real engine may run.

A plan judges each GPU in the twin. Where the twin's engine is faster than the real one, a GPU the twin passes at
its edge starves for real. Every run that was starved in reality shows what the engine can do, so its real over
twin throughput says how fast the real engine ran against its twin. Taking the log of that ratio as normal, with
mean and spread estimated from the runs, the one-sided prediction bound at ``risk`` for one more run (Student's t
with n - 1 degrees of freedom, times sqrt(1 + 1/n), so few starved runs get the wider bound they warrant) says
how much slower than the twin a real engine may be; ``slowdown`` is 1 over that ratio, at least 1. A plan judges
every GPU on a twin that many times slower (``Profile.slowed``), so a planned GPU starves in reality with
probability about ``risk``.

Runs that kept up say nothing about the engine's limit; runs of the workloads a profile was calibrated on are
refused (:func:`serving_harness.validation.stored_rows`, ``refuse_calibration_workloads``): the margin rests on
held-apart runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from serving_harness.calibration import distinct_dirs, stored_seed
from serving_harness.validation import refuse_calibration_workloads, rescored
from twin.errors import BadInputError
from twin.profile import Profile

#: The default share of real engines allowed to be slower than the slowed twin.
RISK = 0.01


def margin(real_thr: np.ndarray, twin_thr: np.ndarray, real_starved: np.ndarray, risk: float = RISK) -> dict:
    """The slowdown from the real-starved runs' real/twin throughput ratios (module docstring)."""
    r = real_thr[real_starved] / twin_thr[real_starved]
    log_r = np.log(r)
    mean, sd = float(log_r.mean()), float(log_r.std(ddof=1))
    bound = stats.t.ppf(risk, len(r) - 1) * np.sqrt(1 + 1 / len(r))
    ratio = float(np.exp(mean + bound * sd))
    slowdown = max(1.0, 1.0 / ratio)
    return {"starved_runs": int(real_starved.sum()), "real_over_twin": {
                "mean_log": mean, "sd_log": sd, "min": float(r.min()), "median": float(np.median(r)),
                "prediction_bound": ratio},
            "slowdown": round(slowdown, 3),
            "runs_slower_than_the_slowed_twin": int((r < 1.0 / slowdown).sum())}


def measured_margin(profile: Profile, work_dirs: list[Path], risk: float = RISK) -> dict:
    """The margin from ``planner validate`` work dirs of ``profile`` (the twin on each run's own requests, in the
    window each set was measured in; a directory given twice counts once); refused with fewer than two runs starved
    in reality."""
    rows = []
    for d in distinct_dirs(work_dirs):
        refuse_calibration_workloads(profile, stored_seed(d), str(d), "a safety margin")
        rows += rescored(profile, d)[0]
    real = np.array([r["real"]["total_throughput_tok_s"] for r in rows])
    twin = np.array([r["twin"]["total_throughput_tok_s"] for r in rows])
    starved = np.array([bool(r["real"]["starved"]) for r in rows])
    if starved.sum() < 2:
        raise BadInputError(f"{len(rows)} real run(s), {int(starved.sum())} of them starved: the margin is sized from "
                            "runs the engine could not keep up with (at least 2; more give a tighter margin), so "
                            "validate workloads past the engine's capacity (more --cases, another --seed) and pass "
                            "their work dirs too")
    if np.any(twin[starved] <= 0):
        raise BadInputError("a starved real run has no twin throughput to compare with: rescore its work dir to see why")
    return {**margin(real, twin, starved, risk), "runs": len(rows), "risk": risk}


def planning_section(margins: dict, evidence: str, command: str, details: str = "") -> dict[str, Any]:
    """A profile's ``planning`` section from :func:`measured_margin`'s figures: runs without SLO evidence give the
    SLO the throughput margin (``slo_slowdown`` given in ``margins`` where they have it)."""
    return {"slowdown": margins["slowdown"], "slo_slowdown": margins.get("slo_slowdown", margins["slowdown"]),
            "risk": margins.get("risk", RISK), "real_runs": margins["runs"], "evidence": evidence, "command": command,
            **({"details": details} if details else {})}
