"""Wall time of the README's first command's plan: ``planner plan datasets/workloads/mixed-ranks-128-adapters.csv``.

    python -m benchmarks.speed.readme_plan [--runs 7] [--workload FILE]

Runs the command as a fresh process (interpreter start, imports, numba's cache loads, surrogate
packing, twin confirmation, output) once to warm the caches (numba, the packed surrogate), then
``--runs`` times, and reports the median, min and max wall time (issue 5: under a second). Run it
with the Python of the environment to measure: with SciPy installed (the test and training extras)
numba's first compiled call also imports it, about 0.2 s more than the README's plain install.
Writes artifacts/benchmarks/readme_plan.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.record import result_path, write_result

ROOT = Path(__file__).resolve().parents[2]

WORKLOAD = "datasets/workloads/mixed-ranks-128-adapters.csv"


def run_once(workload: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "planner.cli", "plan", workload], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--workload", default=WORKLOAD)
    ap.add_argument("--out", type=Path, default=result_path("readme_plan"))
    args = ap.parse_args()
    warm = run_once(args.workload)
    walls = [run_once(args.workload) for _ in range(args.runs)]
    result = {
        "benchmark": "readme_plan", "workload": args.workload,
        "target_s": 1.0, "first_run_s": round(warm, 3), "median_s": round(statistics.median(walls), 3),
        "min_s": round(min(walls), 3), "max_s": round(max(walls), 3), "walls_s": [round(w, 3) for w in walls],
        "scipy_installed": importlib.util.find_spec("scipy") is not None,
    }
    write_result(args.out, result)
    print(f"median {result['median_s']} s (min {result['min_s']}, max {result['max_s']}) over {args.runs} runs; "
          f"wrote {args.out}")


if __name__ == "__main__":
    main()
