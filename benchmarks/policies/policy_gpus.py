"""GPUs needed for the same workloads under each serving policy (issue 6: a comparison only a planner
with a twin of each policy can make).

    python -m benchmarks.policies.policy_gpus [--duration 600]

For each workload, ``planner plan``'s greedy packer plans with the twin predictor simulating every
candidate GPU under the policy (vllm = stock, slora, chameleon, toppings, elora; their default
parameters), then every planned GPU is run again in the twin under the same policy with another
arrival seed (``planner evaluate``) to count the GPUs that starve and read each GPU's TTFT. Both use
``--duration`` simulated seconds (600 s instead of the CLI's 3600 s, so the whole benchmark runs in
about five minutes on one core).
Writes artifacts/benchmarks/policy_gpus.json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.placement.paper_workloads import paper_workload
from benchmarks.record import write_result
from models.twin_predictor import TwinPredictor
from planner.evaluate import evaluate_placement
from planner.placement import Placement, adapter_rows, build_instances, engine_settings
from planner.plan import PlanOptions, pack_request, run_algorithm
from planner.workload_csv import read_workload
from twin import SimConfig, load_profile
from twin.policies import POLICY_NAMES, policy_from_name

ROOT = Path(__file__).resolve().parents[2]

#: Two shipped example workloads (CSV) and the study's evaluation shape with rank-32 adapters only
#: (benchmarks/placement/paper_workloads.py: rates, ranks, adapters), where stock vLLM's KV table caps A_max.
CSV_WORKLOADS = ("high-rate-64-adapters", "mixed-ranks-128-adapters")
PAPER_WORKLOADS = (("mixed", "high", 192),)


def workloads(profile):
    """(name, where it comes from, Workload) of every benchmarked workload."""
    for name in CSV_WORKLOADS:
        path = f"datasets/workloads/{name}.csv"
        yield name, path, read_workload(ROOT / path, profile)
    for rates, ranks, n in PAPER_WORKLOADS:
        yield (f"paper-{rates}-rates-{ranks}-ranks-{n}", f"paper_workload({rates!r}, {ranks!r}, {n})",
               paper_workload(rates, ranks, n))


def plan_and_evaluate(wl, profile, policy_name: str, duration_s: float) -> dict:
    """Greedy plan with the twin under the policy, then every GPU in the twin under it (another seed)."""
    policy = policy_from_name(policy_name)
    predictor = TwinPredictor(profile, duration_s=duration_s, policy=policy)
    t0 = time.perf_counter()
    req = pack_request(wl, profile, predictor, PlanOptions())
    instances = build_instances(req, run_algorithm(req, PlanOptions()))
    plan_s = time.perf_counter() - t0
    placement = Placement({}, instances, adapter_rows(req), engine_settings(profile))
    ev = evaluate_placement(placement, wl, profile, SimConfig(a_max=1, duration_s=duration_s, seed=1, policy=policy))
    return {
        "policy": policy_name, "arriving_tok_s": round(float(req.arriving_tok_s.sum()), 1),
        "gpus": len(instances), "plan_wall_s": round(plan_s, 2),
        "a_max": [i.a_max for i in instances], "adapters_per_gpu": [len(i.adapters) for i in instances],
        "predicted_ok": all(i.ok for i in instances),
        "evaluation": {
            "starving_gpus": sum(bool(i.starved) for i in ev.instances),
            "memory_errors": sum(not i.memory_ok for i in ev.instances), "holds": ev.ok,
            "throughput_over_arriving": [None if i.result is None else
                                         round(i.result.total_throughput_tok_s / i.result.arriving_tok_s, 4)
                                         for i in ev.instances],
            "ttft_ms_p99": [None if i.result is None else round(i.result.ttft_ms_p99, 1) for i in ev.instances],
            "ttft_ms_mean": [None if i.result is None else round(i.result.ttft_ms_mean, 1) for i in ev.instances]},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="simulated seconds per twin run")
    args = ap.parse_args()
    profile = load_profile()
    t0 = time.perf_counter()
    rows = []
    for name, source, wl in workloads(profile):
        for policy_name in POLICY_NAMES:
            r = plan_and_evaluate(wl, profile, policy_name, args.duration)
            rows.append({"workload": name, "source": source, "adapters": len(wl), **r})
            print(f"{name:34} {policy_name:10} {r['gpus']} GPUs (A_max {r['a_max']}), "
                  f"starving {r['evaluation']['starving_gpus']}, TTFT p99 {r['evaluation']['ttft_ms_p99']} ms, "
                  f"plan {r['plan_wall_s']:.0f} s", flush=True)
    path = write_result("policy_gpus", {
        "benchmark": "policy_gpus", "profile": profile.profile_id,
        "algorithm": "greedy", "predictor": "twin", "simulated_duration_s": args.duration,
        "note": f"plans and evaluations simulate {args.duration:.0f} s per GPU (the CLI's twin predictor and "
                "evaluate use 3600 s); evaluation uses arrival seed 1, planning seed 0",
        "wall_s": round(time.perf_counter() - t0, 1), "rows": rows,
    })
    print(path)


if __name__ == "__main__":
    main()
