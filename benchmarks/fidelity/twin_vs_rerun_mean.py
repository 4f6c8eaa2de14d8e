"""The twin against the mean of several real runs of the same workloads: its own error, run noise averaged down.

Two real runs of the same requests differ by about 20 % in ITL on the 2-core VM (real_rerun_noise.py), so
a twin scored against one run carries that noise. Here each case's real figure is the geometric mean over
several ``planner validate`` work dirs that ran the same workloads, and the twin's is the geometric mean of
its replays of each run's own requests (as ``planner rescore`` scores them); starvation is the majority
of the runs (a tie is reported, not scored). Default: the five runs of the 32 CPU validation workloads on
a quiet VM (``validation-day4a``, ``-day4b``, ``-rerun``, ``-repeat-a``, ``-repeat-b``; ``validation`` ran
while other work loaded the VM, ``validation-niced`` and ``validation-probed`` on slow days). It also splits
the twin's ITL error into the runs' own noise and the twin's (:func:`itl_noise_split`), gives it per
engine size, and scores the best a predictor that does not know a run's own speed could do: each run
against the mean (and starvation majority) of the other runs of the same requests (:func:`leave_one_out_floor`).

    python -m benchmarks.fidelity.twin_vs_rerun_mean [--profile ID] [--runs DIR DIR ...]
        # -> artifacts/benchmarks/twin_vs_rerun_mean.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from benchmarks.record import result_path, write_result
from serving_harness.calibration import stored_workloads
from serving_harness.validation import METRICS, compare, stored_rows
from twin.atomic import recorded_path
from twin.metrics import geomean, smape
from twin.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]

MEASURED = ROOT / "datasets" / "measured" / "cpu-2core-tiny-llama"
DEFAULT_RUNS = [MEASURED / f"validation-{name}" for name in ("day4a", "day4b", "rerun", "repeat-a", "repeat-b")]


def scored(profile, work_dir: Path, duration_s: float, warmup_s: float) -> dict[str, dict]:
    """case id -> the compared row (real and twin figures) of one work dir."""
    return {r["case_id"]: r for r in compare(profile, work_dir, stored_rows(profile, work_dir), duration_s, warmup_s)}


def by_case(sets: list[dict[str, dict]], ids: list[str], side: str, key: str) -> np.ndarray:
    """One figure (``side`` "real" or "twin", ``key``) of every case (rows, ``ids`` order) in every run (columns)."""
    return np.array([[s[i][side][key] for s in sets] for i in ids], float)


def itl_by_a_max(sets: list[dict[str, dict]], ids: list[str]) -> dict[str, dict]:
    """Per engine size: the twin's ITL SMAPE against the runs' mean and its mean log ratio twin/real (below 0: the
    twin decodes faster than the runs did on average)."""
    out = {}
    for a_max in sorted({sets[0][i]["a_max"] for i in ids}):
        sel = [i for i in ids if sets[0][i]["a_max"] == a_max]
        real, twin = (geomean(by_case(sets, sel, side, "itl_ms_mean"), axis=1)
                      for side in ("real", "twin"))
        out[str(a_max)] = {"cases": len(sel), "itl_smape_pct_vs_mean": smape(twin, real),
                           "mean_log_ratio_twin_over_real": float(np.mean(np.log(twin / real)))}
    return out


def itl_noise_split(sets: list[dict[str, dict]], ids: list[str]) -> dict[str, float]:
    """How much of the twin's ITL error against the runs' mean is the runs' own noise.

    Per case, the runs scatter around their expectation with a log SD the runs themselves show; their mean keeps
    1/N of that variance. What is left of the twin's mean square log error once that is taken out is the twin's own.
    """
    real, twin = (np.log(by_case(sets, ids, side, "itl_ms_mean")) for side in ("real", "twin"))
    n = real.shape[1]
    mse = float(np.mean((twin.mean(1) - real.mean(1)) ** 2))
    noise_of_mean = float(np.mean(real.var(axis=1, ddof=1)) / n)
    return {"itl_rms_log_error_vs_mean": float(np.sqrt(mse)),
            "itl_rms_log_run_noise_single": float(np.sqrt(noise_of_mean * n)),
            "itl_rms_log_run_noise_of_mean": float(np.sqrt(noise_of_mean)),
            "itl_rms_log_error_twin_own": float(np.sqrt(max(0.0, mse - noise_of_mean)))}


def leave_one_out_floor(sets: list[dict[str, dict]], ids: list[str]) -> dict[str, list[float]]:
    """Each run scored against the geometric mean of the other runs of the same requests (starvation: their
    majority): an oracle that knows every case's usual outcome but not the speed the machine gave that run. No
    twin can be expected closer to a single run than this. Where the other runs tie, the oracle is a coin: half
    right. Leaving those cases out instead scores the floor on fewer, easier cases than the twin (the cases
    split 3-2 lose their three majority runs' comparisons, the ones a twin calling the majority gets right)."""
    out: dict[str, list[float]] = {}
    for name, key in METRICS:
        real = by_case(sets, ids, "real", key)
        out[f"{name}_smape_pct_others_mean_vs_each_run"] = [
            smape(geomean(np.delete(real, k, axis=1), axis=1), real[:, k]) for k in range(len(sets))]
    starved = by_case(sets, ids, "real", "starved")
    agreement = []
    for k in range(len(sets)):
        votes = np.delete(starved, k, axis=1).mean(1)
        right = np.where(votes == 0.5, 0.5, (votes > 0.5) == (starved[:, k] > 0.5))
        agreement.append(float(100.0 * np.mean(right)))
    out["starved_agreement_pct_others_majority_vs_each_run"] = agreement
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu-2core-tiny-llama", help="Profile id or JSON path.")
    ap.add_argument("--runs", type=Path, nargs="+", default=DEFAULT_RUNS, help="Work dirs of the same workloads.")
    ap.add_argument("--duration", type=float, default=30.0, help="Run length the work dirs ran with (s).")
    ap.add_argument("--warmup", type=float, default=5.0, help="Start of their measurement window (s).")
    ap.add_argument("--out", type=Path, default=result_path("twin_vs_rerun_mean"))
    args = ap.parse_args()
    if len(args.runs) < 2:
        sys.exit("--runs needs two work dirs or more")
    if any(stored_workloads(d) != stored_workloads(args.runs[0]) for d in args.runs[1:]):
        sys.exit("the --runs work dirs ran different workloads")
    profile = load_profile(args.profile)
    sets = [scored(profile, d, args.duration, args.warmup) for d in args.runs]
    ids = sorted(set.intersection(*(set(s) for s in sets)))
    result = {"benchmark": "twin_vs_rerun_mean", "profile_id": profile.profile_id,
              "runs": [recorded_path(d, ROOT) for d in args.runs],
              "cases": len(ids), "smape": "standard: 100*mean(2|twin-real|/(|twin|+|real|))"}
    for name, key in METRICS:
        real, twin = (by_case(sets, ids, side, key) for side in ("real", "twin"))
        result[f"{name}_smape_pct_single_runs"] = [smape(twin[:, k], real[:, k]) for k in range(len(sets))]
        result[f"{name}_smape_pct_vs_mean"] = smape(geomean(twin, axis=1), geomean(real, axis=1))
    result["itl_by_a_max"] = itl_by_a_max(sets, ids)
    result.update(itl_noise_split(sets, ids))
    result["floor_leave_one_out"] = leave_one_out_floor(sets, ids)
    real_votes, twin_votes = (by_case(sets, ids, side, "starved").mean(1) for side in ("real", "twin"))
    decided = (real_votes != 0.5) & (twin_votes != 0.5)
    result["starved_ties"] = int((~decided).sum())
    result["starved_agreement_pct_majority"] = float(100.0 * np.mean(
        (real_votes[decided] > 0.5) == (twin_votes[decided] > 0.5))) if decided.any() else float("nan")
    result["starved_agreement_pct_single_runs"] = [
        float(100.0 * np.mean([s[i]["real"]["starved"] == s[i]["twin"]["starved"] for i in ids])) for s in sets]
    write_result(args.out, result)
    for name, _ in METRICS:
        singles = ", ".join(f"{v:.1f}" for v in result[f"{name}_smape_pct_single_runs"])
        print(f"{name:10s} SMAPE against the mean of {len(sets)} runs {result[f'{name}_smape_pct_vs_mean']:5.1f} % "
              f"(against each run: {singles} %)")
    print(f"ITL RMS log error against the mean {result['itl_rms_log_error_vs_mean']:.3f}: the runs' own noise "
          f"{result['itl_rms_log_run_noise_single']:.3f} per run, {result['itl_rms_log_run_noise_of_mean']:.3f} in "
          f"their mean; left to the twin {result['itl_rms_log_error_twin_own']:.3f}")
    for a_max, v in result["itl_by_a_max"].items():
        print(f"  a_max {a_max:>2s}: {v['cases']:2d} cases, ITL SMAPE {v['itl_smape_pct_vs_mean']:5.1f} %, "
              f"mean log twin/real {v['mean_log_ratio_twin_over_real']:+.3f}")
    singles = result["starved_agreement_pct_single_runs"]
    print(f"starved agreement with the majority {result['starved_agreement_pct_majority']:.1f} % "
          f"({result['starved_ties']} ties); with each run {', '.join(f'{v:.1f}' for v in singles)} % "
          f"(mean {np.mean(singles):.1f} %)")
    floor = result["floor_leave_one_out"]
    print("the floor: each run against the mean of the others (an oracle of the usual outcome; a tie half right):")
    for name, _ in METRICS:
        values = floor[f"{name}_smape_pct_others_mean_vs_each_run"]
        print(f"  {name:10s} SMAPE {', '.join(f'{v:.1f}' for v in values)} % (mean {np.mean(values):.1f} %)")
    values = floor["starved_agreement_pct_others_majority_vs_each_run"]
    print(f"  starved agreement {', '.join(f'{v:.1f}' for v in values)} % (mean {np.mean(values):.1f} %)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
