"""Twin speed and memory: one server, 384 adapters (ranks 8/16), A_max 64, 3600 simulated s.

    python -m benchmarks.speed.twin_speed [--repeats 3] [--profile ID]

Two loads, rates drawn round-robin: {0.1, 0.05, 0.025} req/s (light) and {1.6, 0.8, 0.4} req/s
(deep overload, no client cap: the waiting queue grows past a million requests). Each case runs
in a fresh process pinned to one core; the first call compiles (numba caches it on disk), then
``--repeats`` warm calls are timed. Peak memory is the process's max RSS. The study's twin takes
~39 s per simulated hour (paper Table 2). Writes artifacts/benchmarks/twin_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.record import result_path, write_result

ROOT = Path(__file__).resolve().parents[2]
STUDY_S_PER_SIM_HOUR = 39.0
CASES = {"light": [0.1, 0.05, 0.025], "deep_overload": [1.6, 0.8, 0.4]}


def run_case(name: str, repeats: int, profile: str) -> dict:
    """Child process: time one case and report its peak memory."""
    import resource
    import time

    from twin import Adapter, SimConfig, Workload, load_profile, simulate

    rates = CASES[name]
    wl = Workload(tuple(Adapter(f"a{i}", (8, 16)[i % 2], rates[i % 3]) for i in range(384)))
    prof = load_profile(profile)
    cfg = SimConfig(a_max=64, duration_s=3600.0, seed=0)
    t0 = time.perf_counter()
    first = simulate(wl, prof, cfg)
    first_s = time.perf_counter() - t0
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = simulate(wl, prof, cfg)
        walls.append(time.perf_counter() - t0)
    return {
        "case": name, "rates": rates, "adapters": 384, "a_max": 64, "simulated_s": 3600,
        "profile": profile, "first_call_s": first_s, "warm_wall_s": min(walls), "warm_walls_s": walls,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "arrived_requests": res.arrived_requests, "finished_requests": res.finished_requests,
        "engine_steps": res.engine_steps, "starved": res.starved,
        "speedup_vs_study": STUDY_S_PER_SIM_HOUR / min(walls),
        "same_result_first_and_warm": first.total_throughput_tok_s == res.total_throughput_tok_s,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", default="h100-64gb-llama-3.1-8b")
    ap.add_argument("--child", choices=list(CASES), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=result_path("twin_speed"))
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_case(args.child, args.repeats, args.profile)))
        return
    results = []
    for name in CASES:
        cmd = [sys.executable, "-m", __spec__.name, "--child", name, "--repeats", str(args.repeats), "--profile",
               args.profile]
        if hasattr(os, "sched_setaffinity"):
            cmd = ["taskset", "-c", "0", *cmd]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT,
                             env={**os.environ, "NUMBA_NUM_THREADS": "1"})
        r = json.loads(out.stdout.strip().splitlines()[-1])
        results.append(r)
        print(f"{name:14} warm {r['warm_wall_s']:.3f} s (first call {r['first_call_s']:.1f} s), peak {r['peak_rss_mb']:.0f} MB, "
              f"{r['arrived_requests']} arrivals, {r['speedup_vs_study']:.0f}x the study's ~39 s")
    write_result(args.out, {"benchmark": "twin_speed",
                            "targets": {"light_s": 0.5, "deep_overload_s": 2.0, "peak_rss_mb": 300},
                            "results": results}, argv)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
