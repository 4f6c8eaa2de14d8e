"""`planner plan --pool` on random fleet workloads: does the cheapest fleet over several GPU kinds cost no more
than the best single kind, how much does it save, does every plan hold, and how long does it take?

Each case draws a workload of one family of :mod:`twin.families` with one seed and size (as
``fleet_plans``), writes it as workload.csv, and then, each as a fresh process timed as a whole:

1. **Single-kind plans**, once per workload (they depend on no price): for every kind of the pool,
   ``planner plan W.csv --profile P --input-tokens I --output-tokens O``, with I/O the pool's first kind's
   profile default lengths, so that every plan is asked about the same requests as the pool plan (which
   gives adapters without their own lengths the first kind's). A kind that cannot serve the workload
   (exit 2: the CPU kind and rank-32 adapters, or requests past its context) is recorded as such, not as a
   failure, and is timed again planning only the adapters it can serve (``share``).
2. **Pool plans**, one per price set: pool.yaml with the kinds at the set's prices (and counts), then
   ``planner plan W.csv --pool pool.yaml --out plan.json`` (wall, peak memory as ``fleet_plans`` measures
   it) and ``planner evaluate plan.json W.csv --seed 1 --json`` (another hour with arrivals the plan never
   saw: exit code, failing GPUs).

Per pool plan: cost = ``summary.cost_per_hour``; best single = the cheapest, at the set's prices, of the
single-kind plans that exited 0 and fit the kind's count in that set (GPUs x price); saving =
1 - cost / best single; holds = cost <= best single (+1e-9). Wall ratios: the pool plan's wall over
(a) **the sum over kinds of each kind's plan alone** (``wall_over_kinds_sum``) -- what a user would otherwise
run to price every kind: its plan of the workload, or of its share where it cannot serve all; the target uses
this one --, (b) the sum of the single-kind plans' walls as they ran, a kind that cannot serve all counting
its refusal only (``wall_over_singles_sum``), (c) the slowest single-kind plan's wall, (d) the cheapest one's.

Targets (issue "mixed pools"): every plan exits 0; ``evaluate --seed 1`` finds 0 failing GPUs; cost <= the
best single-kind plan's in every case, the saving reported; wall time <= 2x the kinds' plans alone (sum).

The prices in ``PRICE_SETS`` are illustrative per-hour figures chosen to exercise the planner, not quotes
for any cloud: ``list`` (where the CPU kind, about a tenth of an H100's throughput for 1/24 of its price,
makes a mix worthwhile for the ranks it serves), ``cpu-dear`` (the CPU kind dearer per token than an H100:
a mix only where slots matter), ``80gb-scarce`` (the 80 GB kind the cheapest per token but only
``count`` of them: the count rule), ``80gb-at-par`` (the 80 GB kind at twice the 64 GB kind's price, about
what its throughput is worth in the twin -- 70 GPUs against 138 for a 10,000-adapter log-uniform fleet --, so
neither H100 kind is clearly the cheaper: the near tie a mix must not lose). Without the CPU kind, ``list`` and
``cpu-dear`` price the H100 kinds alike.

    python -m benchmarks.placement.mixed_pools [--sizes 2000,10000] [--seeds 0,1,2] [--families ...]
        [--price-sets list,cpu-dear,80gb-scarce,80gb-at-par] [--kinds h100-64gb,h100-80gb,cpu] [--no-evaluate]
        [--keep DIR]   # -> artifacts/benchmarks/mixed_pools.json

Neither the h100-80gb nor the cpu kind ships a surrogate: the twin packs them (h100-80gb about 50 s for
2,000 adapters, minutes for 10,000), in the single-kind plan and again in every pool plan (the CPU kind's
share of a 2,000-adapter log-uniform fleet, ranks up to 16, about a minute). ``--kinds h100-64gb,h100-80gb``
leaves the CPU kind out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from benchmarks.placement.fleet_plans import ROOT, fleet_arguments, run_measured
from benchmarks.record import result_path, write_result
from planner.pool_plan import servable
from twin import load_profile
from twin.families import FAMILIES, family_workload, write_workload_csv
from twin.workload import Workload

#: The pool's kinds, by name, and their profiles, in pool order: the first selected is the pool's reference.
KINDS = {
    "h100-64gb": "h100-64gb-llama-3.1-8b",
    "h100-80gb": "h100-80gb-llama-3.1-8b",
    "cpu": "cpu-2core-tiny-llama",
}
#: Illustrative per-hour prices (not quotes), per kind; ``count``: at most this many GPUs of the kind.
PRICE_SETS: dict[str, dict[str, dict]] = {
    "list": {"h100-64gb": {"price_per_hour": 2.40}, "h100-80gb": {"price_per_hour": 3.00},
             "cpu": {"price_per_hour": 0.10}},
    "cpu-dear": {"h100-64gb": {"price_per_hour": 2.40}, "h100-80gb": {"price_per_hour": 3.00},
                 "cpu": {"price_per_hour": 0.60}},
    "80gb-scarce": {"h100-64gb": {"price_per_hour": 2.40}, "h100-80gb": {"price_per_hour": 2.40, "count": 8},
                    "cpu": {"price_per_hour": 0.60}},
    "80gb-at-par": {"h100-64gb": {"price_per_hour": 2.40}, "h100-80gb": {"price_per_hour": 4.80},
                    "cpu": {"price_per_hour": 0.60}},
}
TARGET_WALL_RATIO = 2.0  # pool plan wall / the sum of the kinds' walls alone (kind_wall)
PLANNER = [sys.executable, "-m", "planner.cli"]


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def pool_yaml(kinds: list[str], prices: dict[str, dict]) -> str:
    return yaml.safe_dump({"kinds": [{"name": k, "profile": KINDS[k], **prices[k]} for k in kinds]},
                          sort_keys=False)


def single_plan(kind: str, csv: Path, wl: Workload, lengths: tuple[float, float], work: Path) -> dict:
    """The kind alone: ``planner plan --profile`` with the pool's lengths, as a fresh process. A kind that cannot
    serve every adapter is also timed planning those it can (``share``): what a user runs to price that kind, and
    at most the share a pool plan packs on it."""
    row = {"kind": kind, **_alone(kind, csv, lengths, work / f"single-{kind}.json")}
    row["cannot_serve"] = row["exit"] == 2
    if row["cannot_serve"]:
        ins = np.array([a.input_tokens or lengths[0] for a in wl.adapters])
        outs = np.array([a.output_tokens or lengths[1] for a in wl.adapters])
        mask = servable(wl, ins, outs, load_profile(KINDS[kind]))
        if 0 < mask.sum() < len(wl):  # (a refusal for another reason leaves every adapter servable)
            share = work / f"share-{kind}.csv"
            write_workload_csv(Workload(tuple(a for a, m in zip(wl.adapters, mask) if m)), share)
            row["share"] = {"adapters": int(mask.sum()), **_alone(kind, share, lengths, work / f"share-{kind}.json")}
    return row


def kind_wall(single: dict) -> float:
    """What pricing the kind alone took: its plan of the workload, or of its share where it cannot serve all."""
    share = single.get("share")
    return share["wall_s"] if share and share["exit"] == 0 else single["wall_s"]


def _alone(kind: str, csv: Path, lengths: tuple[float, float], out: Path) -> dict:
    rc, wall, peak, err = run_measured([*PLANNER, "plan", str(csv), "--profile", KINDS[kind], "--input-tokens",
                                        f"{lengths[0]:g}", "--output-tokens", f"{lengths[1]:g}", "--out", str(out)],
                                       ROOT)
    row = {"exit": rc, "wall_s": round(wall, 3), "peak_mb": peak, "gpus": None}
    if rc != 0:
        row["error"] = last_line(err)
        return row
    doc = json.loads(out.read_text())
    row.update(gpus=doc["summary"]["gpus"], plan_wall_s=doc["inputs"].get("plan_wall_s"),
               lengths={k: doc["inputs"]["lengths"][k] for k in ("mean_input_tokens", "mean_output_tokens")})
    return row


def evaluate(plan: Path, csv: Path) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([*PLANNER, "evaluate", str(plan), str(csv), "--seed", "1", "--json"], check=False,
                          cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    row = {"evaluate_exit": proc.returncode, "evaluate_wall_s": round(time.perf_counter() - t0, 1)}
    try:
        ev = json.loads(proc.stdout)
    except json.JSONDecodeError:
        row.update(evaluate_failing=None, evaluate_error=last_line(proc.stderr))
        return row
    row.update(evaluate_failing=ev["failing"], evaluate_starving=ev["starving"], evaluate_gpus=ev["gpus"],
               evaluate_unplaced=len(ev["unplaced_adapters"]))
    by_kind: dict[str, int] = {}
    for inst in ev["instances"]:
        if not inst["ok"]:
            k = inst.get("kind") or inst["instance_id"].rsplit("-gpu-", 1)[0]
            by_kind[k] = by_kind.get(k, 0) + 1
    if by_kind:
        row["evaluate_failing_by_kind"] = by_kind
    return row


def pool_plan(set_name: str, kinds: list[str], csv: Path, singles: dict[str, dict], work: Path,
              do_evaluate: bool) -> dict:
    prices = PRICE_SETS[set_name]
    pool = work / f"pool-{set_name}.yaml"
    plan = work / f"plan-{set_name}.json"
    pool.write_text(pool_yaml(kinds, prices))
    rc, wall, peak, err = run_measured([*PLANNER, "plan", str(csv), "--pool", str(pool), "--out", str(plan)], ROOT)
    (work / f"plan-{set_name}.log").write_text(err + "\n")  # its progress lines: where the time went
    # what each kind alone costs at these prices, where it planned and fits the set's count
    single_costs = {}
    for k in kinds:
        s, count = singles[k], prices[k].get("count")
        if s["exit"] == 0 and (count is None or s["gpus"] <= count):
            single_costs[k] = round(s["gpus"] * prices[k]["price_per_hour"], 6)
    best = min(single_costs, key=single_costs.get, default=None)
    walls = [singles[k]["wall_s"] for k in kinds]
    row = {"price_set": set_name, "exit": rc, "wall_s": round(wall, 3), "peak_mb": peak,
           "single_cost_per_hour": single_costs, "best_single_kind": best,
           "best_single_cost_per_hour": single_costs.get(best),
           "wall_over_kinds_sum": round(wall / sum(kind_wall(singles[k]) for k in kinds), 3),
           "wall_over_singles_sum": round(wall / sum(walls), 3),
           "wall_over_slowest_single": round(wall / max(walls), 3),
           "wall_over_cheapest_single": round(wall / singles[best]["wall_s"], 3) if best else None}
    if rc != 0:
        row["error"] = last_line(err)
        return row
    doc = json.loads(plan.read_text())
    cost = doc["summary"]["cost_per_hour"]
    ln = doc["inputs"]["lengths"]
    row.update(cost_per_hour=cost, gpus=doc["summary"]["gpus"], gpus_by_kind=doc["summary"]["gpus_by_kind"],
               plan_wall_s=doc["inputs"].get("plan_wall_s"),
               lengths={k: ln[k] for k in ("mean_input_tokens", "mean_output_tokens")},
               planner_single_kind=[{k: s.get(k) for k in ("kind", "gpus", "cost_per_hour", "judged", "why_not")}
                                    for s in doc["inputs"]["pool"]["single_kind"]])
    ref = singles[kinds[0]].get("lengths")
    row["lengths_as_singles"] = ref is None or all(abs(ref[k] - row["lengths"][k]) < 0.05 for k in ref)
    if best is not None:
        row.update(saving=round(1 - cost / single_costs[best], 4), holds=cost <= single_costs[best] + 1e-9)
    else:
        row.update(saving=None, holds=None)
    if do_evaluate:
        row.update(evaluate(plan, csv))
    return row


def case(family: str, n: int, seed: int, kinds: list[str], set_names: list[str], work: Path, do_evaluate: bool,
         keep: Path | None) -> dict:
    ref = load_profile(KINDS[kinds[0]])
    lengths = (ref.default_input_tokens, ref.default_output_tokens)
    widest = max(load_profile(KINDS[k]).engine.max_model_len for k in kinds)  # every request fits some kind
    wl = family_workload(family, n, seed, max_model_len=widest)
    for old in work.iterdir():
        old.unlink()
    csv = work / "workload.csv"
    write_workload_csv(wl, csv)
    row: dict = {"family": family, "adapters": n, "seed": seed, "lengths": list(lengths), "singles": {},
                 "pools": []}
    for k in kinds:
        s = single_plan(k, csv, wl, lengths, work)
        row["singles"][k] = s
        say(f"  {family} {n} seed {seed}: single {k}: exit {s['exit']}, {s['gpus']} GPUs, {s['wall_s']:.1f} s"
            + (f" ({s['error']})" if s["exit"] != 0 else ""))
    for name in set_names:
        p = pool_plan(name, kinds, csv, row["singles"], work, do_evaluate)
        row["pools"].append(p)
        say(f"  {family} {n} seed {seed}: pool {name}: exit {p['exit']}, "
            + (f"{p['cost_per_hour']:.2f}/h {p['gpus_by_kind']} against {p['best_single_kind']} "
               f"{p['best_single_cost_per_hour']}/h (saving {p['saving']}), " if p["exit"] == 0 else
               f"({p.get('error')}), ")
            + f"{p['wall_s']:.1f} s ({p['wall_over_kinds_sum']}x the kinds' sum)"
            + (f", evaluate exit {p['evaluate_exit']} failing {p['evaluate_failing']}" if "evaluate_exit" in p else ""))
    if keep is not None:
        dest = keep / f"{n}-{family}-{seed}"
        dest.mkdir(parents=True, exist_ok=True)
        for f in work.iterdir():
            shutil.copy(f, dest / f.name)
    return row


def _stats(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": round(float(np.median(values)), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def summary(rows: list[dict]) -> dict:
    pools = [p for r in rows for p in r["pools"]]
    ok = [p for p in pools if p["exit"] == 0]
    singles = [s for r in rows for s in r["singles"].values()]
    kinds_sums = [p["wall_over_kinds_sum"] for p in pools if p.get("wall_over_kinds_sum") is not None]
    out = {
        "cases": len(rows), "pool_plans": len(pools), "pool_exit_0": len(ok), "all_exit_0": len(ok) == len(pools),
        "single_plans": len(singles), "single_exit_0": sum(s["exit"] == 0 for s in singles),
        "single_cannot_serve": sum(s["exit"] == 2 for s in singles),
        "single_failed": sum(s["exit"] not in (0, 2) for s in singles),
        "evaluated": sum("evaluate_exit" in p for p in ok),
        "evaluate_failing_gpus": sum(p.get("evaluate_failing") or 0 for p in ok),
        "evaluate_errors": sum(p.get("evaluate_failing") is None and "evaluate_exit" in p for p in ok),
        "cost_over_best_single": sum(p["holds"] is False for p in ok),
        "no_single_to_compare": sum(p["holds"] is None for p in ok),
        "lengths_differ_from_singles": sum(not p["lengths_as_singles"] for p in ok),
        "saving": _stats([p["saving"] for p in ok if p["saving"] is not None]),
        "mixed_plans": sum(sum(v > 0 for v in p["gpus_by_kind"].values()) > 1 for p in ok),
        "target_wall_ratio": TARGET_WALL_RATIO,
        "wall_over_kinds_sum": _stats(kinds_sums),
        "within_wall_target": sum(r <= TARGET_WALL_RATIO for r in kinds_sums),
        "wall_over_singles_sum": _stats([p["wall_over_singles_sum"] for p in pools]),
        "wall_over_slowest_single": _stats([p["wall_over_slowest_single"] for p in pools]),
        "wall_over_cheapest_single": _stats([p["wall_over_cheapest_single"] for p in pools
                                             if p["wall_over_cheapest_single"] is not None]),
        "pool_peak_mb_max": max((p["peak_mb"] for p in pools), default=None),
    }
    out["by_price_set"] = {
        name: {"plans": len(sel), "exit_0": sum(p["exit"] == 0 for p in sel),
               "cost_over_best_single": sum(p.get("holds") is False for p in sel),
               "saving": _stats([p["saving"] for p in sel if p.get("saving") is not None])}
        for name in dict.fromkeys(p["price_set"] for p in pools)
        for sel in [[p for p in pools if p["price_set"] == name]]
    }
    return out


def warm(kinds: list[str], work: Path) -> None:
    """Warm numba's cache and each kind's predictor first, as a user's second run finds them."""
    wl = family_workload("log-uniform", 200, 99)
    csv = work / "warm.csv"
    write_workload_csv(Workload(tuple(a for a in wl.adapters if a.rank <= 16)), csv)  # every kind serves these
    for k in kinds:
        run_measured([*PLANNER, "plan", str(csv), "--profile", KINDS[k]], ROOT)
    csv.unlink()


def csv_list(text: str, allowed, what: str) -> list[str]:
    items = [x for x in text.split(",") if x]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise SystemExit(f"--{what}: {', '.join(bad) or '(none)'} not among {', '.join(allowed)}")
    return items


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    fleet_arguments(ap, "2000,10000")
    ap.add_argument("--price-sets", default=",".join(PRICE_SETS))
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help="the pool's kinds (a subset of %(default)s, kept in that order: the first is the reference)")
    ap.add_argument("--keep", type=Path, default=None,
                    help="keep each case's workload.csv, single-<kind>.json, pool-<set>.yaml, plan-<set>.json and "
                         "plan-<set>.log (the pool plan's progress lines) in KEEP/<adapters>-<family>-<seed>/")
    ap.add_argument("--out", type=Path, default=result_path("mixed_pools"))
    args = ap.parse_args()
    chosen = set(csv_list(args.kinds, KINDS, "kinds"))
    kinds = [k for k in KINDS if k in chosen]
    families = csv_list(args.families, FAMILIES, "families")
    set_names = csv_list(args.price_sets, PRICE_SETS, "price-sets")
    rows: list[dict] = []
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="mixed-pools-") as tmp:
        warm(kinds, Path(tmp))
        work = Path(tmp) / "case"
        work.mkdir()
        for n in (int(x) for x in args.sizes.split(",")):
            for family in families:
                for seed in (int(x) for x in args.seeds.split(",")):
                    say(f"{family}, {n:,} adapters, seed {seed}")
                    rows.append(case(family, n, seed, kinds, set_names, work, not args.no_evaluate, args.keep))
                    out = {"benchmark": "mixed_pools", "kinds": {k: KINDS[k] for k in kinds},
                           "price_sets": {s: PRICE_SETS[s] for s in set_names}, "summary": summary(rows),
                           "cases": rows}
                    write_result(args.out, out)  # after every case: an interrupted run keeps what it measured
    print(json.dumps(out["summary"], indent=1))


if __name__ == "__main__":
    main()
