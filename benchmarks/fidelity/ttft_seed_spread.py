"""How much a planned GPU's p99 TTFT moves from one simulated hour to another: do plans hold in hours they
never saw?

A plan judges each GPU on one simulated hour (arrival seed 0) with 5 % more traffic than planned
(:mod:`planner.verdict`). This benchmark plans random fleet workloads (``planner plan`` as a fresh
process), then judges every planned GPU again in the twin on ``--hours`` other hours with the planned
traffic itself (``planner evaluate --seed 1..N``: the same slowed twin, other arrivals). Per family: GPUs
that miss the SLO in at least one other hour, and GPU-hours missed.

    python -m benchmarks.fidelity.ttft_seed_spread [--families mixed-lengths,log-uniform] [--seeds 0,1,2]
        [--adapters 2000] [--hours 6]          # -> artifacts/benchmarks/ttft_seed_spread.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.record import write_result
from planner.evaluate import evaluate_placement, plan_bar
from planner.placement import read_placement
from planner.verdict import TwinRun
from twin import load_profile
from twin.families import family_workload, write_workload_csv

ROOT = Path(__file__).resolve().parents[2]


def misses(placement, wl, profile, bar, seed: int) -> np.ndarray:
    ev = evaluate_placement(placement, wl, profile, bar, TwinRun(seed=seed, load=1.0, jobs=2, second_seed=None))
    return np.array([not i.ok for i in ev.instances])


def case(family: str, n: int, seed: int, hours: int, profile_id: str, work: Path) -> dict:
    profile = load_profile(profile_id)
    wl = family_workload(family, n, seed, max_model_len=profile.engine.max_model_len)
    csv, plan = work / "w.csv", work / "plan.json"
    write_workload_csv(wl, csv)
    proc = subprocess.run([sys.executable, "-m", "planner.cli", "plan", str(csv), "--profile", profile_id, "--out",
                           str(plan)], cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
    if proc.returncode != 0:
        return {"family": family, "seed": seed, "plan_exit": proc.returncode}
    placement = read_placement(plan)
    bar = plan_bar(placement, profile)
    other = np.array([misses(placement, wl, profile, bar, s) for s in range(1, hours + 1)])
    fails = other.any(axis=0)
    row = {"family": family, "seed": seed, "gpus": len(fails), "gpus_missing_some_hour": int(fails.sum()),
           "gpu_hours_missed": int(other.sum()), "gpu_hours": int(other.size)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="mixed-lengths,log-uniform,hot")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--adapters", type=int, default=2000)
    ap.add_argument("--hours", type=int, default=6, help="other simulated hours (evaluate seeds 1..N)")
    ap.add_argument("--profile", default="h100-64gb-llama-3.1-8b")
    args = ap.parse_args()
    rows = []
    for family in args.families.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            with tempfile.TemporaryDirectory(prefix="ttft-spread-") as tmp:
                rows.append(case(family, args.adapters, seed, args.hours, args.profile, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
            write_result("ttft_seed_spread", {"benchmark": "ttft_seed_spread", "profile": args.profile,
                                              "adapters": args.adapters, "hours": args.hours, "cases": rows})


if __name__ == "__main__":
    main()
