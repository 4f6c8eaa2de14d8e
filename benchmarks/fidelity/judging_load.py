"""Which twin run should judge a planned GPU? Verdict rules set against other simulated hours.

Each case packs a random fleet workload of :mod:`twin.families` with the surrogate aimed at the planned
traffic (``--packing-load`` 1, a plan's first packing), so that many GPUs sit right at their knee, where
rules differ, and runs
every GPU in the slowed twin under each rule's runs, and under the ground truth: the planned traffic on
``--truth-seeds`` other arrival seeds. A rule is unsafe on a GPU it passes that misses the SLO in one of
those hours. Rules (one simulated hour each run):

* ``planned+loaded`` (the rule before): the planned traffic with seed 0, then 5 % more with seed 101;
* ``loaded``: 5 % more traffic with seed 0, one run;
* ``loaded_seed_101``: the same with seed 101 (how much the seed decides);
* ``loaded_halves``: 5 % more, two half hours (seeds 0 and 101);
* ``loaded_twice``: 5 % more with seeds 0 and 101 (twice the work): the rule of :mod:`planner.verdict`, whose
  runs are half hours where they hold 40,000 requests (``python -m benchmarks.fidelity.ttft_seed_spread``).

    python -m benchmarks.fidelity.judging_load [--families ...] [--seeds 0,1,2,3,4] [--adapters 2000]
        [--truth-seeds 1,2,3] [--packing-load 1.0]          # -> artifacts/benchmarks/judging_load.json
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np

from benchmarks.record import write_result
from models.predictor import default_predictor
from planner.confirm import scenarios_of
from planner.greedy import plan_greedy
from planner.plan import PlanOptions, pack_request
from planner.verdict import CONFIRM_DURATION_S, CONFIRM_LOAD, check_of
from twin import load_profile
from twin.families import FAMILIES, family_workload

#: Each run a rule makes: (traffic multiple, arrival seed, simulated seconds).
RULES = {
    "planned+loaded": [(1.0, 0, CONFIRM_DURATION_S), (CONFIRM_LOAD, 101, CONFIRM_DURATION_S)],
    "loaded": [(CONFIRM_LOAD, 0, CONFIRM_DURATION_S)],
    "loaded_seed_101": [(CONFIRM_LOAD, 101, CONFIRM_DURATION_S)],
    "loaded_halves": [(CONFIRM_LOAD, 0, CONFIRM_DURATION_S / 2), (CONFIRM_LOAD, 101, CONFIRM_DURATION_S / 2)],
    "loaded_twice": [(CONFIRM_LOAD, 0, CONFIRM_DURATION_S), (CONFIRM_LOAD, 101, CONFIRM_DURATION_S)],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--adapters", type=int, default=2000)
    ap.add_argument("--truth-seeds", default="1,2,3")
    ap.add_argument("--packing-load", type=float, default=1.0, help="the traffic multiple the surrogate packs for")
    ap.add_argument("--profile", default="h100-64gb-llama-3.1-8b")
    args = ap.parse_args()
    profile = load_profile(args.profile)
    opts = PlanOptions(jobs=2)
    bar = opts.bar(profile)
    truth_runs = [(1.0, int(s), CONFIRM_DURATION_S) for s in args.truth_seeds.split(",")]
    cache: dict[tuple, np.ndarray] = {}

    def meets(key: str, scenarios, load: float, seed: int, duration: float) -> np.ndarray:
        if (key, load, seed, duration) not in cache:
            loaded = [replace(sc, rates_rps=sc.rates_rps * load) for sc in scenarios]
            run = replace(opts.run, duration_s=duration, seed=seed, second_seed=None)
            pred = run.predictor(profile, None, bar).predict(loaded)
            cache[(key, load, seed, duration)] = check_of(pred, loaded, load).meets(bar)
        return cache[(key, load, seed, duration)]

    tally = {name: {"passed": 0, "unsafe": 0} for name in RULES}
    cases = []
    for family in args.families.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            wl = family_workload(family, args.adapters, seed, max_model_len=profile.engine.max_model_len)
            req = pack_request(wl, profile, default_predictor(profile), opts)
            req = replace(req, margin=bar.slowdown * args.packing_load - 1.0)
            scenarios = scenarios_of(req, plan_greedy(req))
            key = f"{family}/{seed}"
            truth = np.logical_and.reduce([meets(key, scenarios, *r) for r in truth_runs])
            row = {"family": family, "seed": seed, "gpus": len(scenarios), "truth_passes": int(truth.sum())}
            for name, runs in RULES.items():
                ok = np.logical_and.reduce([meets(key, scenarios, *r) for r in runs])
                row[name] = {"passed": int(ok.sum()), "unsafe": int((ok & ~truth).sum())}
                for k in ("passed", "unsafe"):
                    tally[name][k] += row[name][k]
            cases.append(row)
            print(row, flush=True)
            write_result("judging_load", {
                "benchmark": "judging_load", "profile": args.profile, "adapters": args.adapters,
                "packing_load": args.packing_load,
                "truth": "the planned traffic, seeds " + args.truth_seeds, "gpus": sum(c["gpus"] for c in cases),
                "truth_passes": sum(c["truth_passes"] for c in cases), "rules": tally, "cases": cases})


if __name__ == "__main__":
    main()
