"""How late the load generator sent its requests in stored real runs (send time minus drawn arrival).

A late send is a gap in the arrivals the engine sees (the twin replays the send times for that
reason, serving_harness/calibration.py). On the 2-core VM the load generator waits for a CPU behind
the engine it measures; this reads every stored run set of a profile and gives, per set, the share
of requests sent more than 50 ms late, the p99 and largest lag, and how many runs had a lag > 250 ms.

    python -m benchmarks.fidelity.send_lag [--measured DIR]   # -> artifacts/benchmarks/send_lag.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from benchmarks.record import result_path, write_result
from serving_harness.loadgen import RunRecords
from twin.atomic import recorded_path

ROOT = Path(__file__).resolve().parents[2]

LATE_S = 0.05


def run_set_lag(work_dir: Path) -> dict:
    """Send-lag figures over every request a work dir's runs sent."""
    lags = []
    for path in sorted((work_dir / "runs").glob("*-requests.parquet")):
        rec = RunRecords.from_parquet(path)
        lags.append((rec.sent_s - rec.arrival_s)[np.isfinite(rec.sent_s)])
    lag = np.concatenate(lags) if lags else np.zeros(0)
    return {
        "runs": len(lags), "requests_sent": int(lag.size),
        f"late_over_{int(LATE_S * 1000)}ms_pct": 100.0 * float(np.mean(lag > LATE_S)) if lag.size else None,
        "lag_ms_p99": 1000.0 * float(np.percentile(lag, 99)) if lag.size else None,
        "lag_ms_max": 1000.0 * float(lag.max()) if lag.size else None,
        "runs_with_a_lag_over_250ms": sum(1 for run in lags if run.size and run.max() > 0.25),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", type=Path, default=ROOT / "datasets" / "measured" / "cpu-2core-tiny-llama")
    ap.add_argument("--out", type=Path, default=result_path("send_lag"))
    args = ap.parse_args()
    sets = sorted(p.parent for p in args.measured.glob("*/runs") if p.is_dir())
    if not sets:
        sys.exit(f"{args.measured}: no stored run sets (*/runs of `planner validate`)")
    result = {"benchmark": "send_lag", "measured": recorded_path(args.measured, ROOT),
              "late_threshold_ms": LATE_S * 1000,
              "sets": {p.name: run_set_lag(p) for p in sets}}
    write_result(args.out, result)
    for name, s in result["sets"].items():
        print(f"{name:22s} {s['late_over_50ms_pct']:5.2f} % sent > 50 ms late, "
              f"p99 {s['lag_ms_p99']:6.1f} ms, max {s['lag_ms_max']:7.1f} ms, "
              f"{s['runs_with_a_lag_over_250ms']}/{s['runs']} runs with a lag > 250 ms")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
