"""How much a planned GPU's p99 TTFT moves from one simulated hour to another, and what would catch it.

A plan judges each GPU on one simulated hour (arrival seed 0) and, near the edge, once more with 5 % more
traffic (seed 101): :mod:`planner.verdict`. This benchmark plans random fleet workloads (``planner plan`` as
a fresh process), then judges every planned GPU again in the twin on ``--hours`` other hours (``planner
evaluate --seed 1..N``: the same slowed twin, other arrivals) and, for every GPU whether the plan checked
it near the edge or not, with 5 % more traffic at seeds 101 and 102. Per family: GPUs that miss the SLO
in at least one other hour, and how many of those the 5 %-more runs flag (and how many they flag in all:
what judging every GPU that way would cost).

    python -m benchmarks.fidelity.ttft_seed_spread [--families mixed-lengths,log-uniform] [--seeds 0,1,2]
        [--adapters 2000] [--hours 6]          # -> artifacts/benchmarks/ttft_seed_spread.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmarks.record import write_result
from planner.evaluate import evaluate_placement, plan_bar
from planner.placement import read_placement
from planner.verdict import EDGE_LOAD, TwinRun
from twin import Workload, load_profile
from twin.families import family_workload, write_workload_csv

ROOT = Path(__file__).resolve().parents[2]
LOADED_SEEDS = (101, 102)


def misses(placement, wl, profile, bar, seed: int) -> np.ndarray:
    ev = evaluate_placement(placement, wl, profile, bar, TwinRun(seed=seed, jobs=2))
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
    loaded_wl = Workload(tuple(replace(a, rate_rps=a.rate_rps * EDGE_LOAD) for a in wl.adapters))
    loaded = np.array([misses(placement, loaded_wl, profile, bar, s) for s in LOADED_SEEDS])
    fails = other.any(axis=0)
    edge_checked = np.array([bool((inst.twin or {}).get("edge_checked")) for inst in placement.instances])
    row = {"family": family, "seed": seed, "gpus": len(fails), "gpus_missing_some_hour": int(fails.sum()),
           "gpu_hours_missed": int(other.sum()), "gpu_hours": int(other.size),
           "missing_ones_the_plan_edge_checked": int((fails & edge_checked).sum())}
    for k, s in enumerate(LOADED_SEEDS):
        row[f"flagged_at_{EDGE_LOAD}x_seed_{s}"] = int(loaded[k].sum())
        row[f"missing_ones_flagged_at_{EDGE_LOAD}x_seed_{s}"] = int((fails & loaded[k]).sum())
    either = loaded.any(axis=0)
    row["flagged_at_either_seed"], row["missing_ones_flagged_at_either"] = int(either.sum()), int((fails & either).sum())
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
