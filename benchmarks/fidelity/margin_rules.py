"""Safety-margin rules judged on real runs held out by workload: right, dangerous and wasteful decisions.

A plan judges each GPU on the twin slowed by a margin. A rule says which margin: one factor for every GPU
(``--slowdown``, the profile's ``planning.slo_slowdown`` by default), or a margin that follows the GPU's
operating point. For each of the study's real one-hour Qwen H100 runs the twin's SLO verdict (p99 TTFT <= 2 s
and p99 TPOT <= 200 ms over finished requests, as the study's client measured; the twin replaying the run's
adapters, ``--max-loras`` and client as in ``benchmarks.fidelity.edge_margin``) at the rule's margin is set
against the real run's: *right* when they agree, *dangerous* when the twin passes a run reality failed,
*wasteful* when the twin fails a run reality passed.

Rules fitted to runs are judged on runs they were not fitted to: each workload (one scenario's adapter set,
i.e. scenario x served adapters, every ``--max-loras`` it was run with) is held out in turn and the rule is
fitted to the others (``--hold-out workload``), or each whole scenario is (``--hold-out scenario``, four
folds: a harder test, as each fold loses a quarter of the evidence). The rules:

* ``flat-F``: every GPU at margin F (no fitting).
* ``by-adapters-verdict``: the margin grows with the adapters a GPU serves; at A adapters it is the largest
  margin any held-in run of at most A adapters needed (the smallest factor of :data:`FACTORS` at which the
  twin fails a run reality failed), at least the profile's throughput margin.
* ``by-adapters-tpot``: at A adapters, the largest ratio of real to twin p99 TPOT (at margin 1) over the
  held-in runs of the nearest served-adapter count at or above A that were not past their capacity
  (real p99 TTFT within 10 s): the twin's step is taken to be that much too fast there.

* ``few-adapters``: the planner's rule (:func:`planner.verdict.few_adapters`): a run of at most
  :data:`~planner.verdict.FEW_ADAPTERS` adapters on the profile's served-share margin, the twin's p99 TPOT
  times a factor and its p99 TTFT plus an allowance per adapter; every other run on the profile's SLO margin.
  Held out, the factor and the allowance are the largest the held-in runs of at most that many adapters show
  (real over twin p99 TPOT over the runs not past their capacity; real less twin p99 TTFT per adapter over
  the runs that met the SLO for real); ``few_adapters`` records them fitted to all runs, beside the
  planner's constants (which must be at least those), and the rule with the planner's constants.

The flat margins need no held-out runs; they are listed as the bar the fitted ones must beat, and again per
served-adapter count (``flat_by_adapters``): where along the adapters a GPU serves the twin needs its margin.

    python -m benchmarks.fidelity.margin_rules [--jobs 2] [--hold-out workload|scenario]
        # -> artifacts/benchmarks/margin_rules.json
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.fidelity.edge_margin import SLO, slo_run
from benchmarks.fidelity.twin_fidelity import DEFAULT_DATA, load_runs
from benchmarks.record import result_path, write_result
from planner.verdict import FEW_ADAPTERS, FEW_TPOT_FACTOR, FEW_TTFT_MS_PER_ADAPTER
from twin import load_profile

#: The margins the twin is run at (every rule's margin is rounded up to one of these).
FACTORS = (1.0, 1.05, 1.1, 1.2, 1.3, 1.4, 1.5, 1.75, 2.0, 2.5)
#: A run whose real p99 TTFT exceeds this was past its capacity: its TPOT says little of the step time.
SATURATED_TTFT_MS = 10_000.0


def twin_figures(runs: list[dict], jobs: int) -> np.ndarray:
    """The twin's (p99 TTFT, p99 TPOT) of every run at every factor: shape (runs, factors, 2)."""
    with ProcessPoolExecutor(jobs) as ex:
        flat = list(ex.map(slo_run, [(r, f) for f in FACTORS for r in runs], chunksize=4))
    return np.array(flat, float).reshape(len(FACTORS), len(runs), 2).transpose(1, 0, 2)


def passes(figures: np.ndarray) -> np.ndarray:
    """The SLO verdict of (p99 TTFT, p99 TPOT) pairs."""
    return (figures[..., 0] <= SLO["ttft_ms"]) & (figures[..., 1] <= SLO["tpot_ms"])


def at_least(margin: float) -> int:
    """The index of the smallest factor of FACTORS at or above ``margin`` (the largest if none is)."""
    idx = np.searchsorted(FACTORS, margin - 1e-9)
    return int(min(idx, len(FACTORS) - 1))


def needed(twin_ok: np.ndarray, real_ok: bool, base: int) -> int:
    """The smallest factor index (at least ``base``) at which the twin passes no run that reality failed."""
    if real_ok:
        return base
    fails = np.flatnonzero(~twin_ok[base:])
    return base + int(fails[0]) if fails.size else len(FACTORS) - 1


def fit_verdict(adapters: np.ndarray, need: np.ndarray, base: int):
    """by-adapters-verdict fitted to these runs: A -> factor index."""
    def rule(a: int) -> int:
        held = need[adapters <= a]
        return int(held.max()) if held.size else base
    return rule


def fit_tpot(adapters: np.ndarray, ratio: np.ndarray, usable: np.ndarray, base: int):
    """by-adapters-tpot fitted to these runs: A -> factor index."""
    counts = np.unique(adapters[usable])

    def rule(a: int) -> int:
        above = counts[counts >= a]
        if not above.size:
            return len(FACTORS) - 1  # beyond every held-in run: the largest margin
        sel = usable & (adapters == above[0])
        return max(base, at_least(float(ratio[sel].max())))
    return rule


def few_errors(adapters: np.ndarray, real: np.ndarray, few: np.ndarray, real_ok: np.ndarray,
               usable: np.ndarray) -> tuple[float, float]:
    """(the largest real over twin p99 TPOT, the largest real less twin p99 TTFT per adapter, ms) over runs of at
    most FEW_ADAPTERS adapters, ``few`` being the twin's figures on the served-share margin: the TPOT one over
    the runs not past their capacity, the TTFT one over the runs that met the SLO for real."""
    small = adapters <= FEW_ADAPTERS
    tpot = real[small & usable, 1] / few[small & usable, 1]
    ttft = (real[small & real_ok, 0] - few[small & real_ok, 0]) / adapters[small & real_ok]
    return float(tpot.max(initial=1.0)), float(max(ttft.max(initial=0.0), 0.0))


def few_decisions(adapters: np.ndarray, few: np.ndarray, slo_ok: np.ndarray, tpot_factor: float,
                  ttft_ms: float) -> np.ndarray:
    """The few-adapters rule's verdicts: ``few`` corrected by the factor and allowance where a run serves at most
    FEW_ADAPTERS adapters, ``slo_ok`` (the twin's verdict on the SLO margin) elsewhere."""
    corrected = np.stack([few[:, 0] + ttft_ms * adapters, few[:, 1] * tpot_factor], axis=1)
    return np.where(adapters <= FEW_ADAPTERS, passes(corrected), slo_ok)


def score(decided: np.ndarray, real_ok: np.ndarray) -> dict:
    n = len(real_ok)
    dangerous = int(np.sum(decided & ~real_ok))
    wasteful = int(np.sum(~decided & real_ok))
    return {"runs": n, "right": n - dangerous - wasteful, "dangerous": dangerous, "wasteful": wasteful,
            "wasteful_share": round(wasteful / n, 4), "twin_passes": int(decided.sum()), "real_meet": int(real_ok.sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--hold-out", choices=("workload", "scenario"), default="workload")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    runs = load_runs(DEFAULT_DATA)
    figures = twin_figures(runs, args.jobs)
    twin_ok = passes(figures)  # (runs, factors)
    real = np.array([[float(r["p99_ttft_ms"]), float(r["p99_tpot_ms"])] for r in runs])
    real_ok = passes(real)
    adapters = np.array([int(r["served_adapters"]) for r in runs])
    groups = np.array([r["scenario"] + (f"/A={r['served_adapters']}" if args.hold_out == "workload" else "")
                       for r in runs])
    base = at_least(load_profile("h100-64gb-qwen2.5-7b").planning_slowdown("throughput"))
    need = np.array([needed(twin_ok[i], bool(real_ok[i]), base) for i in range(len(runs))])
    ratio = real[:, 1] / figures[:, 0, 1]
    usable = real[:, 0] <= SATURATED_TTFT_MS

    profile = load_profile("h100-64gb-qwen2.5-7b")
    with ProcessPoolExecutor(args.jobs) as ex:  # the twin on the served-share margin itself
        few = np.array(list(ex.map(slo_run, [(r, profile.planning_slowdown("throughput")) for r in runs],
                                   chunksize=4)), float)
    slo_ok = twin_ok[:, at_least(profile.planning_slowdown("slo"))]

    rules: dict[str, dict] = {}
    for k, f in enumerate(FACTORS):
        rules[f"flat-{f:g}"] = {**score(twin_ok[:, k], real_ok), "margin_by_run": f}
    fitters = {"by-adapters-verdict": lambda held: fit_verdict(adapters[held], need[held], base),
               "by-adapters-tpot": lambda held: fit_tpot(adapters[held], ratio[held], usable[held], base)}
    for name, fitted_to in fitters.items():
        chosen = np.empty(len(runs), int)
        for g in np.unique(groups):
            out = groups == g
            fit = fitted_to(~out)
            chosen[out] = [fit(int(a)) for a in adapters[out]]
        decided = twin_ok[np.arange(len(runs)), chosen]
        full = fitted_to(np.ones(len(runs), bool))
        rules[name] = {**score(decided, real_ok),
                       "dangerous_runs": [f"{runs[i]['scenario']} A={adapters[i]} A_max={runs[i]['A_max']} at "
                                          f"{FACTORS[chosen[i]]:g}" for i in np.flatnonzero(decided & ~real_ok)],
                       "fitted_to_all": {str(a): FACTORS[full(int(a))] for a in np.unique(adapters)}}
    held_out = np.empty(len(runs), bool)
    for g in np.unique(groups):
        out = groups == g
        tpot_factor, ttft_ms = few_errors(adapters[~out], real[~out], few[~out], real_ok[~out], usable[~out])
        held_out[out] = few_decisions(adapters[out], few[out], slo_ok[out], tpot_factor, ttft_ms)
    tpot_all, ttft_all = few_errors(adapters, real, few, real_ok, usable)
    shipped = few_decisions(adapters, few, slo_ok, FEW_TPOT_FACTOR, FEW_TTFT_MS_PER_ADAPTER)
    rules["few-adapters"] = {**score(held_out, real_ok), "dangerous_runs": [
        f"{runs[i]['scenario']} A={adapters[i]} A_max={runs[i]['A_max']}" for i in np.flatnonzero(held_out & ~real_ok)]}
    few_record = {"adapters": FEW_ADAPTERS, "served_share_slowdown": profile.planning_slowdown("throughput"),
                  "slo_slowdown": profile.planning_slowdown("slo"),
                  "fitted_to_all": {"tpot_factor": round(tpot_all, 3), "ttft_ms_per_adapter": round(ttft_all, 2)},
                  "planner": {"tpot_factor": FEW_TPOT_FACTOR, "ttft_ms_per_adapter": FEW_TTFT_MS_PER_ADAPTER,
                              **score(shipped, real_ok)}}
    by_adapters = {str(a): {f"{f:g}": score(twin_ok[adapters == a, k], real_ok[adapters == a])
                            for k, f in enumerate(FACTORS)} for a in np.unique(adapters)}
    out = {"benchmark": "margin_rules", "profile": "h100-64gb-qwen2.5-7b", "hold_out": args.hold_out,
           "slo": SLO, "factors": list(FACTORS), "runs": len(runs), "real_meet": int(real_ok.sum()),
           "throughput_margin": FACTORS[base], "rules": rules, "few_adapters": few_record,
           "flat_by_adapters": by_adapters,
           "per_run": [{"scenario": r["scenario"], "A": int(a), "A_max": int(r["A_max"]), "real_ok": bool(ok),
                        "needed": FACTORS[n], "tpot_ratio": round(float(q), 3)}
                       for r, a, ok, n, q in zip(runs, adapters, real_ok, need, ratio)]}
    path = args.out or result_path("margin_rules" + ("" if args.hold_out == "workload" else "_by_scenario"))
    write_result(path, out)
    for name, r in rules.items():
        print(f"{name:22s} right {r['right']:3d}  dangerous {r['dangerous']:2d}  wasteful {r['wasteful']:2d} "
              f"({r['wasteful_share']:.1%})")
    print(json.dumps({k: v.get("fitted_to_all") for k, v in rules.items() if "fitted_to_all" in v}))
    print(f"few-adapters, fitted to all runs: {few_record['fitted_to_all']}; the planner's constants: "
          + json.dumps(few_record["planner"]))
    for a, by in by_adapters.items():
        print(f"{a:>4s} adapters ({by['1']['runs']:2d} runs, {by['1']['real_meet']:2d} meet the SLO): dangerous at flat " + ", ".join(
            f"{f}: {v['dangerous']}" for f, v in by.items() if float(f) <= 1.3)
              + f"; wasteful at 1: {by['1']['wasteful']}, at 1.3: {by['1.3']['wasteful']}")


if __name__ == "__main__":
    main()
