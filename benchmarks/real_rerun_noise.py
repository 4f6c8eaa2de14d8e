"""How far two real runs of the same workloads on the same engine disagree: the floor under any twin's error.

Compares the real figures (throughput, ITL, TTFT, starved) that two ``planner validate`` work dirs
recorded for the same workloads (same ``workloads.json``; run at different times), with the SMAPE
the twin is scored by. Default: the shipped CPU profile's validation runs against their rerun.

    python benchmarks/real_rerun_noise.py [--a DIR] [--b DIR]   # -> artifacts/benchmarks/real_rerun_noise.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from serving_harness.calibration import stored_workloads
from twin.atomic import recorded_path, write_json_atomic
from twin.metrics import smape

MEASURED = ROOT / "datasets" / "measured" / "cpu-2core-tiny-llama"
METRICS = {"throughput": "total_throughput_tok_s", "itl": "itl_ms_mean", "ttft": "ttft_ms_mean"}


def real_figures(work_dir: Path) -> dict[str, dict]:
    """case id -> the ``real`` block of each stored case."""
    cases = {}
    for path in sorted((work_dir / "cases").glob("*.json")):
        case = json.loads(path.read_text(encoding="utf-8"))
        cases[case["case_id"]] = case["real"] | {"loadavg_1m": case.get("loadavg_1m")}
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", type=Path, default=MEASURED / "validation")
    ap.add_argument("--b", type=Path, default=MEASURED / "validation-rerun")
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / "benchmarks" / "real_rerun_noise.json")
    args = ap.parse_args()
    if stored_workloads(args.a) != stored_workloads(args.b):
        sys.exit(f"{args.a} and {args.b} ran different workloads")
    a, b = real_figures(args.a), real_figures(args.b)
    ids = sorted(set(a) & set(b))
    starved_in_a = [i for i in ids if a[i]["starved"]]
    result = {
        "a": recorded_path(args.a, ROOT), "b": recorded_path(args.b, ROOT), "smape": "standard: 100*mean(2|a-b|/(|a|+|b|))",
        "all": compare(a, b, ids),
        "starved_in_a": compare(a, b, starved_in_a) if starved_in_a else None,
        "not_starved_in_a": compare(a, b, [i for i in ids if not a[i]["starved"]]),
        "per_case": {i: {name: [a[i][key], b[i][key]] for name, key in METRICS.items()}
                     | {"starved": [a[i]["starved"], b[i]["starved"]],
                        "loadavg_1m": [a[i]["loadavg_1m"], b[i]["loadavg_1m"]]} for i in ids},
    }
    write_json_atomic(args.out, result)
    s = result["all"]
    print(f"{s['cases']} workloads run twice: throughput SMAPE {s['throughput_smape_pct']:.2f} %, ITL "
          f"{s['itl_smape_pct']:.2f} %, TTFT {s['ttft_smape_pct']:.2f} %, starved agreement "
          f"{s['starved_agreement_pct']:.1f} %")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
