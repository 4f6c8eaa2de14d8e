"""Speed of the serving-policy loop (``twin/policies/engine.py``): one server, 300 adapters (ranks 8/16/32,
rates log-uniform in 0.01-0.05 req/s, seed 0), A_max 32, 600 simulated s, on the Qwen H100 profile.

    python -m benchmarks.speed.policy_speed [--repeats 3]     # -> artifacts/benchmarks/policy_speed.json

Per policy: the first call (compiling, or loading numba's on-disk cache) and the best of ``--repeats``
warm calls. To compare two commits, run it in a worktree of each (``git worktree add``) on the same
machine, one after the other.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.record import write_result
from twin import Adapter, SimConfig, Workload, load_profile, simulate
from twin.policies import policy_from_name

POLICIES = ("slora", "chameleon", "toppings", "elora")


def workload(n: int = 300, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    ranks = rng.choice([8, 16, 32], n)
    rates = np.exp(rng.uniform(np.log(0.01), np.log(0.05), n))
    return Workload(tuple(Adapter(f"a{i}", int(r), float(x)) for i, (r, x) in enumerate(zip(ranks, rates))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    profile, wl = load_profile("h100-64gb-qwen2.5-7b"), workload()
    rows = []
    for name in POLICIES:
        cfg = SimConfig(a_max=32, duration_s=600, seed=1, policy=policy_from_name(name))
        t0 = time.perf_counter()
        res = simulate(wl, profile, cfg)
        first = time.perf_counter() - t0
        warm = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            simulate(wl, profile, cfg)
            warm.append(time.perf_counter() - t0)
        rows.append({"policy": name, "first_call_s": round(first, 3), "warm_s_best": round(min(warm), 4),
                     "requests": int(res.arrived_requests)})
        print(rows[-1], flush=True)
    write_result("policy_speed", {"benchmark": "policy_speed", "adapters": len(wl), "duration_s": 600,
                                  "a_max": 32, "policies": rows})


if __name__ == "__main__":
    main()
