"""Accuracy of the shipped surrogates, next to the study's published figures.

    python -m benchmarks.fidelity.surrogate_accuracy [--real-runs PATH]

Collects what ``planner train`` measured (held-out scenarios, real runs, per model; ``rf`` is the
shipped forest, whose scikit-learn class each row names) from each artifact's ``surrogate.json``
and re-scores the shipped predictors (``surrogate``, ``small-tree``) end to end from GpuScenarios
against the real Qwen runs, with a trivial predictor ``min(0.98 × arriving, saturation)`` for
context; also the Qwen surrogate trained on the study's client (``study-client``), when built.
SMAPE is the standard one (factor 2); the study's figures are converted (doubled).
Writes artifacts/benchmarks/surrogate_accuracy.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from benchmarks.record import result_path, write_result
from models.metrics import macro_f1, smape
from models.realruns import load_real_runs
from models.surrogate import SurrogatePredictor, artifact_metadata, client_cap, has_artifact
from serving_harness.published_profiles import REFERENCE_DATA
from twin import load_profile

ROOT = Path(__file__).resolve().parents[2]

QWEN = "h100-64gb-qwen2.5-7b"
DEFAULT_REAL = REFERENCE_DATA / "real_runs_qwen.csv"
#: Paper Tables 3-4 (their SMAPE x 2 = standard SMAPE; test set = real runs).
STUDY = {
    "h100-64gb-llama-3.1-8b": {"rf": (8.78, 0.95), "knn": (9.04, 0.95), "svm": (13.68, 0.98),
                               "small_tree": (20.50, 0.92)},
    QWEN: {"rf": (10.56, 0.99), "knn": (10.56, 0.99), "svm": (14.92, 0.93), "small_tree": (25.78, 0.97)},
}
#: A Qwen surrogate trained on a dataset whose twin runs the study's client (at most 28,232 requests in
#: flight): it predicts the real runs' measurement setup, and the planner never loads it.
STUDY_CLIENT_DIR = ROOT / "artifacts" / "surrogates" / QWEN / "study-client"
TARGETS = {"held_out_throughput_smape": 3.0, "real_throughput_smape": 6.0, "starved_macro_f1": 0.97}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", nargs="+", default=["h100-64gb-llama-3.1-8b", QWEN])
    ap.add_argument("--real-runs", type=Path, default=DEFAULT_REAL, help=f"real runs of {QWEN}")
    ap.add_argument("--out", type=Path, default=result_path("surrogate_accuracy"))
    args = ap.parse_args(argv)
    table = []
    artifacts = [(pid, None) for pid in args.profile] + ([(QWEN, STUDY_CLIENT_DIR)] if QWEN in args.profile else [])
    for pid, directory in artifacts:
        profile = load_profile(pid)
        if not has_artifact(profile, directory):
            print(f"{pid}: no surrogate artifact{'' if directory is None else f' in {directory}'}, skipped")
            continue
        meta = artifact_metadata(profile, directory)
        label = pid if directory is None else f"{pid} ({directory.name})"
        entry = {"profile": pid, "artifact": str(directory.relative_to(ROOT)) if directory else "shipped",
                 "dataset_client_cap": client_cap(meta["dataset"]["files"]) or None, "dataset_rows": meta["dataset"]["rows"], "trained": {},
                 "study": STUDY.get(pid)}
        for target, models in meta["results"].items():
            for name, m in models.items():
                row = entry["trained"].setdefault(name, {})
                row[f"{target}_held_out"] = m["held_out"]
                if "real" in m:
                    row[f"{target}_real"] = m["real"]["score"]
                for k in ("estimator", "rules", "sklearn_us_per_row", "best_params"):
                    if k in m:
                        row[f"{target}_{k}"] = m[k]
        if pid == QWEN and args.real_runs.is_file():
            runs = load_real_runs(args.real_runs)
            sat = max(runs.throughput)
            trivial = np.minimum(0.98 * runs.arriving_tok_s, sat)
            entry["real_runs"] = {"runs": len(runs.scenarios), "trivial_throughput_smape": smape(trivial, runs.throughput)}
            # the runs with rank-32 adapters: no profile constant was chosen on them (twin_fidelity.py's split)
            held = np.array([32 in sc.ranks for sc in runs.scenarios])
            for kind in ("surrogate", "small-tree"):
                p = SurrogatePredictor(profile, kind, directory).predict(runs.scenarios)
                st = runs.starved
                entry["real_runs"][kind] = {
                    "throughput_smape": smape(p.throughput_tok_s, runs.throughput),
                    "throughput_smape_held_out_half": smape(p.throughput_tok_s[held], runs.throughput[held]),
                    "starved_macro_f1_held_out_half": macro_f1(p.starved[held], st[held]),
                    "throughput_smape_real_not_starved": smape(p.throughput_tok_s[~st], runs.throughput[~st]),
                    "throughput_smape_real_starved": smape(p.throughput_tok_s[st], runs.throughput[st]),
                    "starved_macro_f1": macro_f1(p.starved, st),
                }
        table.append(entry)
        for name, row in entry["trained"].items():
            print(f"{label:37} {name:10} throughput SMAPE held-out {row.get('throughput_held_out', float('nan')):6.2f}% "
                  f"real {row.get('throughput_real', float('nan')):6.2f}% | starved F1 held-out "
                  f"{row.get('starved_held_out', float('nan')):.3f} real {row.get('starved_real', float('nan')):.3f}")
    write_result(args.out, {"benchmark": "surrogate_accuracy", "smape": "standard: 100*mean(2|p-r|/(|p|+|r|))",
                            "targets": TARGETS, "results": table}, argv)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
