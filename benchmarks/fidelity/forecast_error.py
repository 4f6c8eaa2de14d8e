"""How close the forecast of `planner workload` comes to the busiest hour of the day to come.

Synthetic traffic with a known shape (tests/synthetic_traffic.py: a daily cycle, quieter weekends) is counted
in hourly windows for 9 to 15 days (so the next day is a weekday or a weekend day), for adapters of 0.05 to
4 req/s and several seeds; each method's planned rate is set against the true peak of the next day.

    python -m benchmarks.fidelity.forecast_error      # -> artifacts/benchmarks/forecast_error.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from benchmarks.record import result_path, write_result
from planner.forecast import DAY, HOUR, Series, forecast
from tests.synthetic_traffic import hourly_counts, true_peak

BASE = np.array([0.05, 0.2, 0.5, 1.0, 4.0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--out", type=Path, default=result_path("forecast_error"))
    args = ap.parse_args()
    errors: dict[str, list] = {"seasonal": [], "quantile_0.95": [], "quantile_1": []}
    for seed in range(args.seeds):
        for days in range(9, 16):
            counts, start = hourly_counts(BASE, days, seed)
            series = Series([f"a{k}" for k in range(len(BASE))], counts / HOUR, start, HOUR)
            truth = true_peak(BASE, start + days * DAY, 24)
            for name, (method, q) in {"seasonal": ("seasonal", 0.95), "quantile_0.95": ("quantile", 0.95),
                                      "quantile_1": ("quantile", 1.0)}.items():
                rates, _ = forecast(series, "next-day", method, q)
                errors[name].append(rates / truth - 1.0)
    out = {"benchmark": "forecast_error", "adapters_rps": BASE.tolist(),
           "cases": args.seeds * 7, "relative_error_of_the_planned_rate": {}}
    for name, errs in errors.items():
        e = np.array(errs)  # (cases, adapters)
        out["relative_error_of_the_planned_rate"][name] = {
            f"{rate:g} req/s": {"mean": float(e[:, k].mean()), "mean_abs": float(np.abs(e[:, k]).mean()),
                                "under_by_more_than_10pct": float(np.mean(e[:, k] < -0.1))}
            for k, rate in enumerate(BASE)}
    write_result(args.out, out)
    print(json.dumps(out["relative_error_of_the_planned_rate"], indent=1))


if __name__ == "__main__":
    main()
