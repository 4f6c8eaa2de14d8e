"""How much does the simulated duration of a training scenario change its targets, and what does it cost?

    python -m benchmarks.studies.dataset_duration [--profile ID] [--scenarios 60] [--durations 3600 900 600]

Samples scenarios of the paper grid (seeded, memory errors skipped), runs each at every duration
and, for the noise floor, at the first duration with other arrival draws (same scenario). Reports per duration the
standard SMAPE (100·mean(2|a−b|/(|a|+|b|))) of throughput and of the served fraction
(throughput / arriving) against the first duration, the starvation agreement, and the mean twin
wall time per scenario. Writes artifacts/benchmarks/dataset_duration.json.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from joblib import Parallel, delayed

from benchmarks.record import result_path, write_result
from models.dataset import GridSpec, run_scenario
from models.metrics import smape
from twin import load_profile


def run_one(profile_id: str, grid: GridSpec, sid: int, point, seed_offset: int) -> dict:
    return run_scenario(grid, load_profile(profile_id), sid, point, sim_seed_offset=seed_offset)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="h100-64gb-llama-3.1-8b")
    ap.add_argument("--scenarios", type=int, default=60)
    ap.add_argument("--durations", type=float, nargs="+", default=[3600.0, 900.0, 600.0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=result_path("dataset_duration"))
    args = ap.parse_args(argv)
    profile = load_profile(args.profile)
    grid = GridSpec.paper()
    pts = grid.points()
    rng = np.random.default_rng(args.seed)
    feasible = [i for i in rng.permutation(len(pts))
                if profile.kv.tokens_for(pts[i][1], profile.kv.rank_for(max(pts[i][3]))) is not None]
    ids = [int(i) for i in feasible[:args.scenarios]]
    runs = [(d, 0) for d in args.durations] + [(args.durations[0], 1)]
    t0 = time.time()
    out = Parallel(n_jobs=args.jobs)(delayed(run_one)(args.profile, replace(grid, duration_s=d), i, pts[i], off)
                                     for d, off in runs for i in ids)
    n = len(ids)
    by_run = {run: out[k * n:(k + 1) * n] for k, run in enumerate(runs)}
    ref = by_run[runs[0]]

    def arr(rows, key):
        return np.array([r[key] for r in rows], float)

    detail = [{"scenario_id": i, "served": pts[i][0], "a_max": pts[i][1],
               **{f"frac_{d:.0f}_{off}": r["throughput_tok_s"] / r["arriving_tok_s"] for (d, off), rows in by_run.items()
                  for r in rows if r["scenario_id"] == i}} for i in ids]
    ref_thr, ref_frac = arr(ref, "throughput_tok_s"), arr(ref, "throughput_tok_s") / arr(ref, "arriving_tok_s")
    table = []
    for (d, off), rows in by_run.items():
        thr = arr(rows, "throughput_tok_s")
        frac = thr / arr(rows, "arriving_tok_s")
        table.append({
            "duration_s": d, "seed_offset": off,
            "throughput_smape_vs_ref": smape(thr, ref_thr), "served_fraction_smape_vs_ref": smape(frac, ref_frac),
            "starved_agreement_vs_ref": float(np.mean(arr(rows, "starved") == arr(ref, "starved"))),
            "starved_fraction": float(np.mean(arr(rows, "starved"))),
            "mean_sim_wall_s": float(np.mean(arr(rows, "sim_wall_s"))),
            "max_sim_wall_s": float(np.max(arr(rows, "sim_wall_s"))),
        })
        print(f"{d:6.0f} s seed+{off}: thr SMAPE {table[-1]['throughput_smape_vs_ref']:5.2f}% "
              f"fraction SMAPE {table[-1]['served_fraction_smape_vs_ref']:5.2f}% "
              f"starved agree {table[-1]['starved_agreement_vs_ref']:.3f} "
              f"wall {table[-1]['mean_sim_wall_s']:.3f} s/scenario")
    write_result(args.out, {
        "benchmark": "dataset_duration", "profile": args.profile,
        "scenarios": n, "smape": "standard: 100*mean(2|a-b|/(|a|+|b|))", "reference": f"{args.durations[0]:.0f} s, seed+0",
        "results": table, "per_scenario": detail, "bench_wall_s": time.time() - t0,
    }, argv)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
