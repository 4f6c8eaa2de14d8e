"""Thirty simulated nights of `planner replan`: does the nightly job converge?

A fleet of one family of :mod:`twin.families` evolves night by night (:func:`twin.families.fleet_nights`:
rates walk and follow a weekly cycle, adapters retire and join, a hot adapter appears on night 10 and
cools down). Night 0 is planned fresh (``planner plan``); every later night is re-planned from the plan
of the night before, as the README's crontab line does (``planner replan W.csv --previous plan.json
--out plan.json``), each a fresh process. Per night: the exit code; GPUs against what a fresh plan of
that night needs (the re-plan packs one to compare, in ``changes.fresh_plan_gpus``); adapters moved and
engines restarted; the adapters whose rate changed materially (by more than ``--material``, 25 %) since
the night before; and ``planner evaluate --seed`` (a seed of its own per night) of the new plan on the
night's workload.

Targets (issue "Nightly re-plan"): every night exits 0; GPUs <= fresh + 1 every night and = fresh on
>= 90 % of nights; moves <= materially changed adapters + 5 % of all; 0 GPUs failing the evaluation.

With ``--pool FILE`` night 0 is ``planner plan --pool FILE`` and the nights re-plan that pool plan; a night's row
adds its cost per hour, GPUs per kind, and the adapters moved off a kind at its ``count`` (``spilled``).

    python -m benchmarks.placement.nightly [--sizes 2000,10000] [--seeds 0,1,2] [--families log-uniform,zipf]
        [--nights 30] [--max-moves 5%] [--tail-factor F] [--keep DIR] [--pool FILE]  # as `planner replan`
        # takes them; --keep: each night's workload and plan, to study its GPUs afterwards
        # -> artifacts/benchmarks/nightly.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from benchmarks.fidelity.knee_rules import keep_night
from benchmarks.record import result_path, write_result
from planner.replan import MATERIAL_CHANGE, materially_changed
from twin.families import fleet_nights, write_workload_csv

ROOT = Path(__file__).resolve().parents[2]

PLANNER = [sys.executable, "-m", "planner.cli"]


def run(args: list[str]) -> tuple[int, float, str, str]:
    t0 = time.perf_counter()
    proc = subprocess.run([*PLANNER, *args], cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          check=False)
    return proc.returncode, time.perf_counter() - t0, proc.stdout, proc.stderr


def fleet(family: str, n: int, seed: int, nights: int, threshold: float, work: Path, profile: str,
          max_moves: str | None, keep: Path | None = None, tail_factor: str | None = None, pool: Path | None = None):
    """Each night's row, as the night ends; with ``keep``, each night's workload and plan are copied there; with
    ``pool``, night 0 is planned over that pool instead of ``profile``."""
    plan = work / "plan.json"
    tail = [] if tail_factor is None else ["--tail-factor", tail_factor]
    before: dict[str, float] = {}
    for night, wl in enumerate(fleet_nights(family, n, seed, nights)):
        csv = work / f"night-{night:02d}.csv"
        write_workload_csv(wl, csv)
        rates = {a.adapter_id: a.rate_rps for a in wl.adapters}
        if night == 0:
            on = ["--profile", profile] if pool is None else ["--pool", str(pool)]
            rc, wall, _, err = run(["plan", str(csv), *on, "--out", str(plan), *tail])
            row = {"night": 0, "exit": rc, "wall_s": round(wall, 2)}
        else:
            cap = [*tail, *([] if max_moves is None else ["--max-moves", max_moves])]
            rc, wall, out, err = run(["replan", str(csv), "--previous", str(plan), "--out", str(plan), *cap, "--json"])
            row = {"night": night, "exit": rc, "wall_s": round(wall, 2),
                   "materially_changed": materially_changed(before, rates, threshold)}
            if rc == 0:
                doc = json.loads(out)
                ch = doc["changes"]
                row.update(gpus=doc["summary"]["gpus"], fresh_gpus=ch["fresh_plan_gpus"], moved=len(ch["moved_adapters"]),
                           restarts=len(ch["restarts"]), added=len(ch["added_adapters"]),
                           dropped=len(ch["dropped_adapters"]))
                if pool is not None:
                    row.update(cost_per_hour=doc["summary"]["cost_per_hour"],
                               gpus_by_kind=doc["summary"]["gpus_by_kind"],
                               spilled=sum("is at its count" in m["reason"] for m in ch["moves"]))
        if rc != 0:
            row["error"] = err.strip().splitlines()[-1] if err.strip() else ""
        else:
            erc, ewall, eout, _ = run(["evaluate", str(plan), str(csv), "--seed", str(1000 + night), "--json"])
            ev = json.loads(eout)
            row.update(evaluate_exit=erc, evaluate_failing=ev["failing"], evaluate_wall_s=round(ewall, 1))
            if ev["failing"]:  # what they miss, beside the figures the plan was judged with
                judged = {i["instance_id"]: i.get("twin") for i in json.loads(plan.read_text())["instances"]}
                row["evaluate_misses"] = [{"instance_id": i["instance_id"], "misses": i["misses"],
                                           "judged": judged.get(i["instance_id"])}
                                          for i in ev["instances"] if not i["ok"]]
            if night == 0:
                row["gpus"] = ev["gpus"]
        row["adapters"] = len(wl)
        if keep is not None and rc == 0:
            keep_night(keep, night, csv, plan)
        print(json.dumps(row), flush=True)
        yield row
        before = rates


def summary(rows: list[dict], n: int) -> dict:
    later = [r for r in rows if r["night"] > 0]
    ok = [r for r in later if r["exit"] == 0]
    return {
        "nights": len(rows), "exit_0": sum(r["exit"] == 0 for r in rows),
        "gpus_over_fresh_max": max((r["gpus"] - r["fresh_gpus"] for r in ok), default=None),
        "nights_at_fresh_gpus_pct": 100.0 * np.mean([r["gpus"] <= r["fresh_gpus"] for r in ok]) if ok else None,
        "nights_moves_within_target": sum(r["moved"] <= r["materially_changed"] + 0.05 * n for r in ok),
        "moves_total": sum(r["moved"] for r in ok), "restarts_total": sum(r["restarts"] for r in ok),
        "evaluate_failing_gpus": sum(r.get("evaluate_failing", 0) for r in rows),
        "replan_wall_s_max": max((r["wall_s"] for r in later), default=None),
        **({"spilled_total": sum(r["spilled"] for r in ok), "nights_spilling": sum(r["spilled"] > 0 for r in ok)}
           if ok and "spilled" in ok[0] else {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2000,10000")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--families", default="log-uniform", help="comma-separated families of twin.families")
    ap.add_argument("--nights", type=int, default=30)
    ap.add_argument("--material", type=float, default=MATERIAL_CHANGE, help="a rate change above this share is material")
    ap.add_argument("--profile", default="h100-64gb-llama-3.1-8b")
    ap.add_argument("--max-moves", default=None, help="replan --max-moves (default: none, the README's crontab line)")
    ap.add_argument("--out", type=Path, default=result_path("nightly"))
    ap.add_argument("--tail-factor", default=None, help="plan and replan --tail-factor (0: judge without the bound)")
    ap.add_argument("--keep", type=Path, default=None,
                    help="copy each night's workload and plan under KEEP/<adapters>-<family>-<seed>/")
    ap.add_argument("--pool", type=Path, default=None, help="plan night 0 over this pool file instead of --profile")
    args = ap.parse_args()
    pool = None if args.pool is None else args.pool.resolve()
    pool_kinds = None if pool is None else yaml.safe_load(pool.read_text())["kinds"]
    fleets = []
    for n in (int(x) for x in args.sizes.split(",")):
        for family in args.families.split(","):
            for seed in (int(x) for x in args.seeds.split(",")):
                rows: list[dict] = []
                fleets.append({"adapters": n, "seed": seed, "family": family, "nights": rows})
                with tempfile.TemporaryDirectory(prefix="nightly-") as tmp:
                    keep = None if args.keep is None else args.keep / f"{n}-{family}-{seed}"
                    for row in fleet(family, n, seed, args.nights, args.material, Path(tmp), args.profile,
                                     args.max_moves, keep, args.tail_factor, pool):
                        rows.append(row)
                        fleets[-1]["summary"] = summary(rows, n)
                        # written after every night: an interrupted run keeps the nights done
                        write_result(args.out, {"benchmark": "nightly",
                                                **({"profile": args.profile} if pool is None else
                                                   {"pool": str(args.pool), "pool_kinds": pool_kinds}),
                                                "max_moves": args.max_moves, "material_change": args.material,
                                                "tail_factor": args.tail_factor,
                                                "fleets": fleets})
                print(json.dumps({"adapters": n, "family": family, "seed": seed, **fleets[-1]["summary"]}), flush=True)


if __name__ == "__main__":
    main()
