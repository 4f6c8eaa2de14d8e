"""Where should the surrogate aim a GPU's fill? GPUs and time of whole confirmed plans per aim.

The packer fills a GPU until its model predicts the GPU keeps up, within its latency SLO, with ``aim`` x
the slowed twin's load (the profile's slowdown x the planned traffic; :func:`planner.plan.pack_request`
uses 1); the twin then judges every GPU with 1.05 x its traffic and the adapters of the ones that fall
short are packed again with a growing margin (:func:`planner.confirm.pack_confirmed`). Aiming low costs
load on every GPU; aiming high puts more GPUs past the edge, and the rounds cost time and, packed with a
growing margin, GPUs too. Per aim: GPUs of the confirmed plan, GPUs short at the first check, rounds and
wall time (this process, the twin on ``--jobs`` processes).

    python -m benchmarks.studies.packing_aim [--aims 1,1.05] [--families ...] [--seeds 1,2] [--adapters 2000]
        # -> artifacts/benchmarks/packing_aim.json (packing_aim_<N>.json for another --adapters N)
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from benchmarks.record import write_result
from models.predictor import default_predictor
from models.twin_memo import MEMO
from planner.confirm import pack_confirmed
from planner.plan import PlanOptions, pack_request
from twin import load_profile
from twin.families import FAMILIES, family_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--aims", default="1,1.05", help="load multiples of the slowed twin's load")
    ap.add_argument("--families", default=",".join(f for f in FAMILIES if f != "near-idle"))
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--adapters", type=int, default=2000)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--profile", default="h100-64gb-llama-3.1-8b")
    args = ap.parse_args()
    profile = load_profile(args.profile)
    opts = PlanOptions(jobs=args.jobs)
    bar = opts.bar(profile)
    aims = {a: float(a) for a in args.aims.split(",")}
    cases, totals = [], {a: {"gpus": 0, "wall_s": 0.0} for a in aims}
    for family in args.families.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            wl = family_workload(family, args.adapters, seed, max_model_len=profile.engine.max_model_len)
            req = pack_request(wl, profile, default_predictor(profile), opts)
            row = {"family": family, "seed": seed}
            for aim, load in aims.items():
                messages: list[str] = []
                MEMO.clear()  # each aim asks the twin afresh
                t0 = time.perf_counter()
                aimed = replace(req, margin=bar.slowdown * load - 1.0)
                groups, conf = pack_confirmed(aimed, run=opts.run, bar=bar, progress=messages.append)
                wall = time.perf_counter() - t0
                first = next((m for m in messages if m.startswith("twin check")), "")
                row[aim] = {"gpus": len(groups), "rounds": conf.rounds, "wall_s": round(wall, 2),
                                 "first_check": first.split(" (")[0]}
                totals[aim]["gpus"] += len(groups)
                totals[aim]["wall_s"] = round(totals[aim]["wall_s"] + wall, 2)
            cases.append(row)
            print(row, flush=True)
            name = "packing_aim" if args.adapters == 2000 else f"packing_aim_{args.adapters}"
            write_result(name, {"benchmark": "packing_aim", "profile": args.profile, "adapters": args.adapters,
                                "totals": totals, "cases": cases})


if __name__ == "__main__":
    main()
