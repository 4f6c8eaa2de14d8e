"""How far two real runs of the same workloads on the same engine disagree: the floor under any twin's error.

Compares the real figures (throughput, ITL, TTFT, starved) of two ``planner validate`` work dirs
that ran the same workloads (same ``workloads.json``; run at different times), computed from their
stored requests as ``planner rescore`` does, with the SMAPE the twin is scored by. Default: the
32 CPU validation workloads run twice back to back on one day. Per engine it also gives the mean ITL
ratio of the two runs: on a shared CPU VM the speed moves from one stretch of minutes to the next,
and one engine runs all its cases in one stretch.

    python -m benchmarks.fidelity.real_rerun_noise [--a DIR] [--b DIR]   # -> artifacts/benchmarks/real_rerun_noise.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks.record import result_path, write_result
from serving_harness.calibration import recorded_run, stored_workloads
from serving_harness.validation import engine_label
from twin.atomic import recorded_path
from twin.metrics import group_log_ratios, smape, smape_within_groups

ROOT = Path(__file__).resolve().parents[2]

MEASURED = ROOT / "datasets" / "measured" / "cpu-2core-tiny-llama"
METRICS = {"throughput": "total_throughput_tok_s", "itl": "itl_ms_mean", "ttft": "ttft_ms_mean",
           "itl_engine": "itl_ms_engine"}  # the last only for runs whose metrics kept it


def real_figures(work_dir: Path, duration_s: float, warmup_s: float) -> dict[str, dict]:
    """case id -> the real figures of each stored case."""
    cases = {}
    for path in sorted((work_dir / "cases").glob("*.json")):
        case = json.loads(path.read_text(encoding="utf-8"))
        real = recorded_run(work_dir, case, duration_s, warmup_s).real
        cases[case["case_id"]] = real | {"loadavg_1m": case.get("loadavg_1m"), "engine": engine_label(case)}
    if not cases:
        sys.exit(f"{work_dir}: no stored cases (cases/*.json of `planner validate`)")
    return cases


def compare(a: dict[str, dict], b: dict[str, dict], ids: list[str]) -> dict:
    out = {"cases": len(ids)}
    for name, key in METRICS.items():
        x, y = (np.array([s[i][key] for i in ids], float) for s in (a, b))
        out[f"{name}_smape_pct"] = smape(x, y)
    out["starved_agreement_pct"] = 100.0 * float(np.mean([a[i]["starved"] == b[i]["starved"] for i in ids]))
    return out


def by_engine(a: dict[str, dict], b: dict[str, dict], ids: list[str]) -> dict:
    """Per engine of run set ``a`` (A_max, max_lora_rank; one vLLM process runs all its cases back to back):
    the mean log ratio b/a of ITL, and what is left of the ITL SMAPE once each engine's ratio is divided out."""
    engines = [a[i]["engine"] for i in ids]
    x, y = (np.array([s[i]["itl_ms_mean"] for i in ids], float) for s in (a, b))
    ratios = group_log_ratios(y, x, engines)
    return {"engines": {e: {"cases": engines.count(e), "itl_log_ratio_b_over_a": ratios[e]} for e in sorted(ratios)},
            "itl_smape_pct_within_engines": smape_within_groups(y, x, engines)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", type=Path, default=MEASURED / "validation-day4a")
    ap.add_argument("--b", type=Path, default=MEASURED / "validation-day4b")
    ap.add_argument("--duration", type=float, default=30.0, help="Run length the work dirs ran with (s).")
    ap.add_argument("--warmup", type=float, default=5.0, help="Start of their measurement window (s).")
    ap.add_argument("--out", type=Path, default=result_path("real_rerun_noise"))
    args = ap.parse_args()
    if stored_workloads(args.a) != stored_workloads(args.b):
        sys.exit(f"{args.a} and {args.b} ran different workloads")
    a, b = (real_figures(d, args.duration, args.warmup) for d in (args.a, args.b))
    ids = sorted(set(a) & set(b))
    starved_in_a = [i for i in ids if a[i]["starved"]]
    result = {
        "benchmark": "real_rerun_noise",
        "a": recorded_path(args.a, ROOT), "b": recorded_path(args.b, ROOT), "smape": "standard: 100*mean(2|a-b|/(|a|+|b|))",
        "all": compare(a, b, ids),
        "starved_in_a": compare(a, b, starved_in_a) if starved_in_a else None,
        "not_starved_in_a": compare(a, b, [i for i in ids if not a[i]["starved"]]),
        "itl_by_engine": by_engine(a, b, ids),
        "per_case": {i: {name: [a[i][key], b[i][key]] for name, key in METRICS.items()}
                     | {"starved": [a[i]["starved"], b[i]["starved"]],
                        "loadavg_1m": [a[i]["loadavg_1m"], b[i]["loadavg_1m"]]} for i in ids},
    }
    write_result(args.out, result)
    s = result["all"]
    print(f"{s['cases']} workloads run twice: throughput SMAPE {s['throughput_smape_pct']:.2f} %, ITL "
          f"{s['itl_smape_pct']:.2f} %, TTFT {s['ttft_smape_pct']:.2f} %, starved agreement "
          f"{s['starved_agreement_pct']:.1f} %")
    print(f"ITL SMAPE with each engine's own speed ratio divided out: "
          f"{result['itl_by_engine']['itl_smape_pct_within_engines']:.2f} %")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
