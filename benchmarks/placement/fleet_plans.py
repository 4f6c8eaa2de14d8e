"""`planner plan` on random fleet workloads nobody picked: exit code, wall time, memory, GPUs, and an
independent check of every plan.

Each case draws a workload of one family of :mod:`twin.families` (log-uniform rates, Zipf, hot adapters,
all rank 32, thousands near idle, mixed lengths) with one seed and size, writes it as workload.csv and runs
the README's command on it as a fresh process (``planner plan W.csv --out plan.json``), timing it as a
whole and reading its peak memory (the largest resident set of the planner and its workers). Then
``planner evaluate plan.json W.csv --seed 1`` judges every GPU again with arrivals the plan never saw, and
the GPUs used are set against the lower bound the plan states (planner.lower_bound: the workload's arriving
tokens over what one GPU serves within the SLO at best, in the twin without a safety margin).

Targets (issue "Plans that hold"): every case exits 0; wall time <= 3 s (2k adapters), <= 5 s (10k),
<= 60 s (100k); <= 1 GB peak at 100k; 0 GPUs failing the evaluation.

    python -m benchmarks.placement.fleet_plans [--sizes 2000,10000,100000] [--seeds 0,1,2] [--families ...]
        [--profile ID] [--no-evaluate] [--plan-args ARGS] [--keep DIR]   # -> artifacts/benchmarks/fleet_plans.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.fidelity.knee_rules import keep_night
from benchmarks.record import result_path, write_result
from twin import load_profile
from twin.families import FAMILIES, family_workload, write_workload_csv

ROOT = Path(__file__).resolve().parents[2]

TARGET_WALL_S = {2_000: 3.0, 10_000: 5.0, 100_000: 60.0}
TARGET_PEAK_MB = 1024
#: Runs a command and prints, last on stderr, the peak resident set of its largest process (MB).
PEAK_WRAPPER = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
                "sys.stderr.write('\\nPEAK_MB %.1f\\n' % (resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)); "
                "sys.exit(rc)")


def run_measured(cmd: list[str], cwd: Path, stdout=subprocess.DEVNULL) -> tuple[int, float, float, str]:
    """(exit code, wall s, peak MB, stderr) of ``cmd`` as a fresh process."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PEAK_WRAPPER, *cmd], check=False, cwd=cwd, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    lines = proc.stderr.strip().splitlines()
    peak = float(lines[-1].split()[1]) if lines and lines[-1].startswith("PEAK_MB") else float("nan")
    return proc.returncode, wall, peak, "\n".join(lines[:-1])


def case(family: str, n: int, seed: int, profile_id: str, work: Path, evaluate: bool, plan_args: list[str],
         keep: Path | None) -> dict:
    profile = load_profile(profile_id)
    wl = family_workload(family, n, seed, max_model_len=profile.engine.max_model_len)
    csv = work / f"{family}-{n}-{seed}.csv"
    plan = work / f"{family}-{n}-{seed}.json"
    write_workload_csv(wl, csv)
    planner = [sys.executable, "-m", "planner.cli"]
    rc, wall, peak, err = run_measured([*planner, "plan", str(csv), "--profile", profile_id, "--out", str(plan),
                                        *plan_args], ROOT)
    row = {"family": family, "adapters": n, "seed": seed, "exit": rc, "wall_s": round(wall, 3), "peak_mb": peak,
           "target_wall_s": TARGET_WALL_S.get(n)}
    if rc != 0:
        row["error"] = err.strip().splitlines()[-1] if err.strip() else ""
        return row
    if keep is not None:
        keep_night(keep / f"{n}-{family}", seed, csv, plan)
    doc = json.loads(plan.read_text())
    conf = doc["inputs"]["confirmation"]
    bound = doc["inputs"]["lower_bound"]["gpus"]
    row.update(gpus=doc["summary"]["gpus"], lower_bound_gpus=bound, gpus_over_bound=round(doc["summary"]["gpus"] / bound, 3),
        rounds=conf["rounds"], repacked=conf["repacked_gpus"],
        twin_packed=conf["twin_packed_gpus"], worst_served=conf["worst_served"],
        worst_ttft_ms=conf["worst_ttft_ms_p99"], worst_tpot_ms=conf["worst_tpot_ms_p99"])
    if evaluate:
        t0 = time.perf_counter()
        proc = subprocess.run([*planner, "evaluate", str(plan), str(csv), "--seed", "1", "--json"], check=False, cwd=ROOT,
                              capture_output=True, text=True, stdin=subprocess.DEVNULL)
        ev = json.loads(proc.stdout)
        row.update(evaluate_exit=proc.returncode, evaluate_failing=ev["failing"], evaluate_starving=ev["starving"],
                   evaluate_worst_ttft_ms=max((i["ttft_ms_p99"] or 0) for i in ev["instances"]),
                   evaluate_wall_s=round(time.perf_counter() - t0, 1))
    return row


def summary(rows: list[dict]) -> dict:
    out = {"cases": len(rows), "exit_0": sum(r["exit"] == 0 for r in rows)}
    for n in sorted({r["adapters"] for r in rows}):
        sel = [r for r in rows if r["adapters"] == n]
        ok = [r for r in sel if r["exit"] == 0]
        out[str(n)] = {
            "cases": len(sel), "exit_0": len(ok), "wall_s_max": max(r["wall_s"] for r in sel),
            "wall_s_median": float(np.median([r["wall_s"] for r in sel])), "target_wall_s": TARGET_WALL_S.get(n),
            "peak_mb_max": max(r["peak_mb"] for r in sel),
            "gpus_over_lower_bound_median": float(np.median([r["gpus_over_bound"] for r in ok])) if ok else None,
            "evaluated": sum("evaluate_exit" in r for r in ok),
            "evaluate_failing_gpus": sum(r.get("evaluate_failing", 0) for r in ok),
        }
    return out


def fleet_arguments(ap: argparse.ArgumentParser, sizes: str) -> None:
    """The options of a benchmark over random fleets: --sizes (default ``sizes``), --seeds, --families and
    --no-evaluate."""
    ap.add_argument("--sizes", default=sizes)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--no-evaluate", action="store_true", help="skip the independent `planner evaluate --seed 1`")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    fleet_arguments(ap, "2000,10000,100000")
    ap.add_argument("--profile", default="h100-64gb-llama-3.1-8b")
    ap.add_argument("--evaluate-seeds", default=None,
                    help="evaluate only the cases of these seeds (comma-separated; default: all). At 100,000 "
                         "adapters one evaluation simulates about 2,000 GPUs for an hour each")
    ap.add_argument("--plan-args", default="", help="more arguments for `planner plan`, e.g. '--no-size-margin'")
    ap.add_argument("--keep", type=Path, default=None,
                    help="keep each workload and plan in KEEP/<adapters>-<family>/ as night-<seed>.csv and "
                         "plan-<seed>.json (for python -m benchmarks.fidelity.knee_rules)")
    ap.add_argument("--out", type=Path, default=result_path("fleet_plans"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fleet-plans-") as tmp:
        # warm numba's cache and the packed surrogate first, as a user's second run finds them
        warm = family_workload("log-uniform", 200, 99)
        write_workload_csv(warm, Path(tmp) / "warm.csv")
        run_measured([sys.executable, "-m", "planner.cli", "plan", str(Path(tmp) / "warm.csv"), "--profile",
                      args.profile], ROOT)
        for n in (int(x) for x in args.sizes.split(",")):
            for family in args.families.split(","):
                for seed in (int(x) for x in args.seeds.split(",")):
                    evaluate = not args.no_evaluate and (args.evaluate_seeds is None
                                                         or str(seed) in args.evaluate_seeds.split(","))
                    row = case(family, n, seed, args.profile, Path(tmp), evaluate, shlex.split(args.plan_args),
                               args.keep)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    out = {"benchmark": "fleet_plans", "profile": args.profile, "summary": summary(rows), "cases": rows}
                    write_result(args.out, out)  # after every case: an interrupted run keeps what it measured
    print(json.dumps(out["summary"], indent=1))


if __name__ == "__main__":
    main()
