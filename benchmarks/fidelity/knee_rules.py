"""Which judging rule passes no GPU that then misses the SLO in other hours? Measured on re-planned nights.

Re-planned GPUs sit right at their knee: a re-plan fills a GPU until the twin rejects it. This benchmark
takes the nights ``python -m benchmarks.placement.nightly --keep DIR`` kept (each night's workload and
plan) and runs every planned GPU in the slowed twin with 5 % more traffic and seeds 0, 101 and 202, and on
``--hours`` other hours of its planned traffic (seeds 1000 + night + 10000 k; k = 0 is the nightly
benchmark's own ``planner evaluate --seed``). Per rule: the GPUs it passes, and of those the ones that
miss the SLO in some other hour. Rules:

* ``two_seeds``: p99 within the SLO with seeds 0 and 101 (the rule before the tail bound);
* ``tail_K``: the same, and p99.9 TTFT within K times the limit in both runs (:mod:`planner.verdict`:
  K = ``TAIL_FACTOR``);
* ``third_after_burst``: a third run (seed 202) only where p99.9 TTFT of one of the first two is over the
  limit;
* ``three_seeds``: seeds 0, 101 and 202 on every GPU;
* ``p99_within_half``: two seeds with p99 TTFT within half the limit (a margin on the p99 itself);
* ``size_margin``: the tail bound at :data:`planner.verdict.TAIL_FACTOR` with each GPU's margin scaled by how
  much its request sizes vary (``TwinRun.size_scaled``);
* ``size_margin_third``: that, and a third run (seed 202, size-scaled too) where p99.9 TTFT of one of the first
  two is over the limit, a GPU of few adapters (``planner.verdict.few_adapters``) judged in it on the SLO margin
  as every other GPU: the rule :mod:`planner.verdict` uses now;
* ``size_margin_third_few_margin``: the same with that GPU's third run on its own smaller margin (the rule
  before).

Nights kept by plans judged with a rule pass that rule on every GPU; compare rules on nights whose plans
were judged by the laxest (``nightly --tail-factor 0``: two seeds, no tail bound; fresh plans:
``fleet_plans --plan-args '--tail-factor 0 --no-size-margin' --keep DIR``).

    python -m benchmarks.fidelity.knee_rules KEPT_DIR [KEPT_DIR ...] [--hours 6] [--out NAME]
        # -> artifacts/benchmarks/knee_rules.json
"""

from __future__ import annotations

import argparse
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmarks.record import write_result
from planner.evaluate import evaluation_request, plan_bar
from planner.packing import group_scenario
from planner.placement import read_placement
from planner.verdict import CONFIRM_SEED, SECOND_SEED, TAIL_FACTOR, THIRD_SEED, TwinRun, twin_check
from planner.workload_csv import read_workload
from twin import load_profile
from twin.progress import Progress

TAIL_FACTORS = (5.0, 10.0, 20.0, 50.0)


def keep_night(folder: Path, number: int, workload_csv: Path, plan: Path) -> None:
    """Copy one night's workload and plan into ``folder`` as this benchmark reads them (``--keep`` of
    ``nightly`` and ``fleet_plans``)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(workload_csv, folder / f"night-{number:02d}.csv")
    shutil.copyfile(plan, folder / f"plan-{number:02d}.json")


def night(plan_path: Path, hours: int, jobs: int) -> dict:
    """One kept night: per GPU, its judging runs' verdicts and the other hours it misses."""
    placement = read_placement(plan_path)
    number = int(plan_path.stem.split("-")[1])
    workload = read_workload(plan_path.parent / f"night-{number:02d}.csv")
    profile = load_profile(placement.inputs["profile_id"])
    bar = plan_bar(placement, profile)
    req = evaluation_request(placement, workload, profile, bar, None)
    index = {a.adapter_id: i for i, a in enumerate(req.workload.adapters)}
    scenarios = [group_scenario(req, {index[a]: s for a, s in inst.adapters.items()}, inst.a_max,
                                max_lora_rank=inst.max_lora_rank) for inst in placement.instances if inst.adapters]
    judging = replace(TwinRun.for_bar(bar, jobs), second_seed=None, tail_factor=None, size_scaled=False)
    runs, scaled = {}, {}
    for seed in (CONFIRM_SEED, SECOND_SEED, THIRD_SEED):
        check = twin_check(profile, None, scenarios, bar, replace(judging, seed=seed))
        runs[seed] = (~check.meets(bar), check.ttft_ms_p999 / check.max_ttft_ms, check.ttft_ms_p99 / check.max_ttft_ms)
    for seed in (CONFIRM_SEED, SECOND_SEED, THIRD_SEED):
        check = twin_check(profile, None, scenarios, bar, replace(judging, seed=seed, size_scaled=True,
                                                                   tail_factor=TAIL_FACTOR))
        scaled[seed] = (check.meets(bar), check.ttft_ms_p999 / check.max_ttft_ms)
    other = [~twin_check(profile, None, scenarios, bar, replace(judging, seed=1000 + number + 10_000 * k, load=1.0,
                                                                duration_s=3600.0, min_requests=0.0)).meets(bar)
             for k in range(hours)]
    two = ~runs[CONFIRM_SEED][0] & ~runs[SECOND_SEED][0]
    tail = np.fmax(runs[CONFIRM_SEED][1], runs[SECOND_SEED][1])  # worst p99.9 over the limit
    rules = {"two_seeds": two, **{f"tail_{k:g}": two & ~(tail > k) for k in TAIL_FACTORS},
             "third_after_burst": two & (~(tail > 1.0) | ~runs[THIRD_SEED][0]),
             "three_seeds": two & ~runs[THIRD_SEED][0],
             "p99_within_half": two & ~(np.fmax(runs[CONFIRM_SEED][2], runs[SECOND_SEED][2]) > 0.5),
             "size_margin": scaled[CONFIRM_SEED][0] & scaled[SECOND_SEED][0]}
    scaled_tail = np.fmax(scaled[CONFIRM_SEED][1], scaled[SECOND_SEED][1])
    flat_third = twin_check(profile, None, scenarios, replace(bar, few=None),  # few adapters as every other
                            replace(judging, seed=THIRD_SEED, size_scaled=True, tail_factor=TAIL_FACTOR)).meets(bar)
    rules["size_margin_third"] = rules["size_margin"] & (~(scaled_tail > 1.0) | flat_third)
    rules["size_margin_third_few_margin"] = rules["size_margin"] & (~(scaled_tail > 1.0) | scaled[THIRD_SEED][0])
    missed = np.any(other, axis=0)
    return {"plan": f"{plan_path.parent.name}/{plan_path.name}", "gpus": len(scenarios),
            "bursts": int((two & (tail > 1.0)).sum()),
            **{name: {"passed": int(ok.sum()), "missing_another_hour": int((ok & missed).sum()),
                      "gpu_hours_missed": int((np.array(other) & ok).sum())} for name, ok in rules.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kept", nargs="+", type=Path, help="folders of `nightly --keep` (night-NN.csv, plan-NN.json)")
    ap.add_argument("--hours", type=int, default=6, help="other simulated hours per GPU")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="knee_rules")
    args = ap.parse_args()
    plans = sorted(p for d in args.kept for p in d.glob("plan-*.json"))
    rows = []
    progress = Progress(len(plans), "nights", every_s=10.0)
    for path in plans:
        rows.append(night(path, args.hours, args.jobs))
        totals = {"gpu_nights": sum(r["gpus"] for r in rows), "bursts": sum(r["bursts"] for r in rows),
                  **{name: {k: sum(r[name][k] for r in rows) for k in rows[0][name]}
                     for name in rows[0] if isinstance(rows[0][name], dict)}}
        write_result(args.out, {"benchmark": "knee_rules", "kept": [d.name for d in args.kept],
                                "hours": args.hours, "totals": totals, "nights": rows})
        progress.advance()
    progress.close()
    print(totals)


if __name__ == "__main__":
    main()
