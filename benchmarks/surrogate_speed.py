"""Prediction latency of the shipped surrogates (compiled forests and small trees).

    python benchmarks/surrogate_speed.py [--profile ID ...] [--rows 10000]

Per profile and kind (``surrogate`` = the forests, ``small-tree``), on feature rows of the
profile's training set when it is there (else rows of random scenarios):

* ``single_row_us`` — one Python call evaluating one row (numba dispatch included);
* ``per_row_in_batch_ns`` and ``batch_ms`` — one call on ``--rows`` rows, i.e. the compiled
  tree walk itself;
* ``predict_1_us`` / ``predict_3_us`` — ``Predictor.predict`` on 1 and 3 GpuScenarios of 32
  adapters (what the packer pays per question: features + both targets).

Best of ``--repeats``; first calls (compilation, numba's disk cache) are excluded. Compare with the
study's 0.25 ms (RF) and 0.08–0.11 µs (numba small tree) per prediction. Writes
artifacts/benchmarks/surrogate_speed.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.predictor import GpuScenario
from models.surrogate import SurrogatePredictor, has_artifact
from models.trees import forest_row
from twin import load_profile
from twin.atomic import write_json_atomic

TARGETS = {"surrogate_single_row_us": 5.0, "small_tree_single_row_ns": 100.0, "batch_10k_ms": 5.0}


def best_of(fn, repeats: int, number: int) -> float:
    """Seconds per call: the best of ``repeats`` timings of ``number`` calls."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best


def random_scenarios(rng, n: int, adapters: int) -> list[GpuScenario]:
    out = []
    for _ in range(n):
        ranks = rng.choice([8, 16], adapters)
        rates = rng.choice([0.4, 0.1, 0.05, 0.025], adapters)
        out.append(GpuScenario(ranks, rates, np.full(adapters, 220.0), np.full(adapters, 200.0),
                               int(rng.choice([8, 16, 32]))))
    return out


def measure(profile_id: str, kind: str, rows: int, repeats: int) -> dict:
    profile = load_profile(profile_id)
    pred = SurrogatePredictor(profile, kind)
    rng = np.random.default_rng(0)
    scs = random_scenarios(rng, rows, 32)
    X = pred.features(scs)
    x32 = X[0].astype(np.float32)
    out = np.empty(2)
    t, s = pred.throughput_forest, pred.starved_forest
    single_t = best_of(lambda: forest_row(t.feature, t.threshold, t.left, t.right, t.leaf_value, t.roots, x32, out),
                       repeats, 20000)
    single_s = best_of(lambda: forest_row(s.feature, s.threshold, s.left, s.right, s.leaf_value, s.roots, x32, out),
                       repeats, 20000)
    batch_t = best_of(lambda: t.predict_raw(X), repeats, 3)
    batch_s = best_of(lambda: s.predict_raw(X), repeats, 3)
    p1 = best_of(lambda: pred.predict(scs[:1]), repeats, 5000)
    p3 = best_of(lambda: pred.predict(scs[:3]), repeats, 2000)
    return {
        "profile": profile_id, "kind": kind, "rows": rows,
        "throughput_model": {"trees": t.n_trees, "nodes": t.n_nodes, "single_row_us": single_t * 1e6,
                             "per_row_in_batch_ns": batch_t / rows * 1e9, "batch_ms": batch_t * 1e3},
        "starved_model": {"trees": s.n_trees, "nodes": s.n_nodes, "single_row_us": single_s * 1e6,
                          "per_row_in_batch_ns": batch_s / rows * 1e9, "batch_ms": batch_s * 1e3},
        "predict_1_us": p1 * 1e6, "predict_3_us": p3 * 1e6,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", nargs="+", default=["h100-64gb-llama-3.1-8b", "h100-64gb-qwen2.5-7b"])
    ap.add_argument("--rows", type=int, default=10000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / "benchmarks" / "surrogate_speed.json")
    args = ap.parse_args(argv)
    results = []
    for pid in args.profile:
        if not has_artifact(load_profile(pid)):
            print(f"{pid}: no surrogate artifact, skipped")
            continue
        for kind in ("surrogate", "small-tree"):
            r = measure(pid, kind, args.rows, args.repeats)
            results.append(r)
            tm, sm = r["throughput_model"], r["starved_model"]
            print(f"{pid:24} {kind:10} single row {tm['single_row_us']:.2f}/{sm['single_row_us']:.2f} us, "
                  f"in batch {tm['per_row_in_batch_ns']:.0f}/{sm['per_row_in_batch_ns']:.0f} ns/row, "
                  f"batch {tm['batch_ms']:.2f}/{sm['batch_ms']:.2f} ms; predict() 1 scenario {r['predict_1_us']:.1f} us, "
                  f"3 scenarios {r['predict_3_us']:.1f} us   (throughput/starved)")
    write_json_atomic(args.out, {"benchmark": "surrogate_speed", "command": "python " + " ".join(sys.argv),
                                 "targets": TARGETS, "results": results})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
