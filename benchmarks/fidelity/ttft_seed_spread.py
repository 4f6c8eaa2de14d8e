"""How much a planned GPU's p99 TTFT moves from one simulated hour to another: do plans hold in hours they
never saw?

A plan judges each GPU on one simulated hour (arrival seed 0) with 5 % more traffic than planned
(:mod:`planner.verdict`). This benchmark plans random fleet workloads (``planner plan`` as a fresh
process), then judges every planned GPU again in the twin on ``--hours`` other hours with the planned
traffic itself (``planner evaluate --seed 1..N``: the same slowed twin, other arrivals). Per family: GPUs
that miss the SLO in at least one other hour, and GPU-hours missed; and how far p99 TPOT moves: per GPU, the
worst other hour's p99 TPOT over the one the plan was judged at (quantiles over the GPUs, ``tpot_over_judged``),
which sizes :data:`planner.verdict.TPOT_FACTOR` where a tight TPOT limit binds (``--plan-args '--max-tpot 50'``).

    python -m benchmarks.fidelity.ttft_seed_spread [--families mixed-lengths,log-uniform] [--seeds 0,1,2]
        [--adapters 2000] [--hours 6] [--plan-args '--max-tpot 50'] [--out FILE]
                                                # -> artifacts/benchmarks/ttft_seed_spread.json
"""

from __future__ import annotations

import argparse
import json
import shlex
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


def other_hour(placement, wl, profile, bar, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per GPU: whether it misses the SLO in the hour of arrival ``seed``, and its p99 TPOT there."""
    ev = evaluate_placement(placement, wl, profile, bar, TwinRun(seed=seed, load=1.0, jobs=2, second_seed=None))
    return np.array([not i.ok for i in ev.instances]), figure(ev.instances, "figures", "tpot_ms_p99")


def figure(instances, record: str, key: str) -> np.ndarray:
    """Each instance's ``key`` of its ``record`` (``figures`` of an evaluation, ``twin`` of a plan); NaN where none."""
    values = [getattr(i, record) or {} for i in instances]
    return np.array([np.nan if v.get(key) is None else v[key] for v in values], float)


def case(family: str, n: int, seed: int, hours: int, profile_id: str, plan_args: list[str], work: Path) -> dict:
    profile = load_profile(profile_id)
    wl = family_workload(family, n, seed, max_model_len=profile.engine.max_model_len)
    csv, plan = work / "w.csv", work / "plan.json"
    write_workload_csv(wl, csv)
    proc = subprocess.run([sys.executable, "-m", "planner.cli", "plan", str(csv), "--profile", profile_id, "--out",
                           str(plan), *plan_args], cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          check=False)
    if proc.returncode != 0:
        return {"family": family, "seed": seed, "plan_exit": proc.returncode}
    placement = read_placement(plan)
    bar = plan_bar(placement, profile)
    hours_run = [other_hour(placement, wl, profile, bar, s) for s in range(1, hours + 1)]
    other = np.array([m for m, _ in hours_run])
    fails = other.any(axis=0)
    judged = figure(placement.instances, "twin", "tpot_ms_p99")
    ratio = np.nanmax([t for _, t in hours_run], axis=0) / judged
    ratio = ratio[np.isfinite(ratio)]
    limit = figure(placement.instances, "twin", "max_tpot_ms")
    return {"family": family, "seed": seed, "gpus": len(fails), "gpus_missing_some_hour": int(fails.sum()),
            "gpu_hours_missed": int(other.sum()), "gpu_hours": int(other.size),
            "judged_tpot_over_limit_max": round(float(np.nanmax(judged / limit)), 4),
            "tpot_over_judged": {q: round(float(np.quantile(ratio, v)), 4) for q, v in
                                 (("median", 0.5), ("p90", 0.9), ("max", 1.0))},
            "tpot_over_judged_all": [round(float(r), 4) for r in ratio]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="mixed-lengths,log-uniform,hot")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--adapters", type=int, default=2000)
    ap.add_argument("--hours", type=int, default=6, help="other simulated hours (evaluate seeds 1..N)")
    ap.add_argument("--profile", default="h100-64gb-llama-3.1-8b")
    ap.add_argument("--plan-args", default="", help="extra `planner plan` options, e.g. '--max-tpot 50'")
    ap.add_argument("--out", default=None, help="result file (default artifacts/benchmarks/ttft_seed_spread.json)")
    args = ap.parse_args()
    rows = []
    for family in args.families.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            with tempfile.TemporaryDirectory(prefix="ttft-spread-") as tmp:
                rows.append(case(family, args.adapters, seed, args.hours, args.profile, shlex.split(args.plan_args),
                                 Path(tmp)))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "tpot_over_judged_all"}), flush=True)
            ratios = [r for row in rows for r in row.get("tpot_over_judged_all", [])]
            write_result(args.out or "ttft_seed_spread", {
                "benchmark": "ttft_seed_spread", "profile": args.profile, "adapters": args.adapters,
                "hours": args.hours, "plan_args": args.plan_args, "cases": rows,
                "tpot_over_judged": {q: round(float(np.quantile(ratios, v)), 4) for q, v in
                                     (("median", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))} if ratios else None,
            })


if __name__ == "__main__":
    main()
