"""Prediction latency of the shipped surrogates (compiled forests and small trees).

    python -m benchmarks.speed.surrogate_speed [--profile ID ...] [--rows 10000] [--threads N]

Per profile and kind (``surrogate`` = the forests, ``small-tree``), on feature rows of random
scenarios of 32 adapters, for the throughput and the starvation model and their sum (``full``):

* ``single_row_us`` — one Python call evaluating one row (numba dispatch included), the same row
  again and again (hot caches); for ``full``, ``single_row_one_call_us`` evaluates both forests in
  one compiled call, as ``predict()`` does (the figure issue 4's target is set on);
* ``single_row_varying_us`` — the same, each call on the next of 1,000 different rows (what a
  packer asking about different GPUs sees);
* ``batch_ms`` / ``per_row_in_batch_ns`` — one call on ``--rows`` rows on the calling thread, and
  ``batch_threads_ms`` with ``predict_raw(X, threads=N)`` (row blocks in parallel; N = ``--threads``,
  default numba's thread count, the machine's cores unless NUMBA_NUM_THREADS says otherwise);
* ``predict_1_us`` / ``predict_3_us`` — ``Predictor.predict`` on 1 and 3 GpuScenarios of 32
  adapters (what the packer pays per question: features + both targets).

Best of ``--repeats``; first calls (compilation, numba's disk cache) are excluded. Targets
(issue 4): full model single row ≤ 5 µs, 10,000 rows ≤ 5 ms. Compare with the study's 0.25 ms (RF)
and 0.08–0.11 µs (numba small tree) per prediction. Writes artifacts/benchmarks/surrogate_speed.json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numba
import numpy as np

from benchmarks.record import result_path, write_result
from models.scenario import GpuScenario
from models.surrogate import SurrogatePredictor, has_artifact
from models.trees import forest_row
from twin import load_profile

TARGETS = {"full_single_row_us": 5.0, "full_batch_10k_ms": 5.0, "small_tree_single_row_ns": 100.0}


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


@numba.njit
def _full_row(t_nodes, t_thresholds, t_leaf_row, t_leaf_value, t_roots,
              s_nodes, s_thresholds, s_leaf_row, s_leaf_value, s_roots, x, out_t, out_s):
    """Both forests on one row in one compiled call (what ``_predict_one`` does after the features)."""
    forest_row(t_nodes, t_thresholds, t_leaf_row, t_leaf_value, t_roots, x, out_t)
    forest_row(s_nodes, s_thresholds, s_leaf_row, s_leaf_value, s_roots, x, out_s)


def full_row_us(pt, ps, x32: np.ndarray, repeats: int) -> float:
    out_t, out_s = np.empty(pt.leaf_value.shape[1]), np.empty(ps.leaf_value.shape[1])
    return best_of(lambda: _full_row(pt.nodes, pt.thresholds, pt.leaf_row, pt.leaf_value, pt.roots, ps.nodes,
                                     ps.thresholds, ps.leaf_row, ps.leaf_value, ps.roots, x32, out_t, out_s),
                   repeats, 20000) * 1e6


def model_speed(packed, X: np.ndarray, repeats: int, threads: int) -> dict:
    """Timings of one forest in the evaluation layout (models.trees.PackedForest)."""
    X32 = np.ascontiguousarray(X, dtype=np.float32)
    out = np.empty(packed.leaf_value.shape[1])
    x32 = X32[0]
    rows = X32[:1000]

    def varying():
        for x in rows:
            packed.row(x, out)

    batch = best_of(lambda: packed.predict_raw(X), repeats, 3)
    return {"trees": packed.n_trees, "nodes": packed.n_nodes, "leaves": packed.n_leaves,
            "single_row_us": best_of(lambda: packed.row(x32, out), repeats, 20000) * 1e6,
            "single_row_varying_us": best_of(varying, repeats, 3) / len(rows) * 1e6,
            "per_row_in_batch_ns": batch / X.shape[0] * 1e9, "batch_ms": batch * 1e3,
            "batch_threads_ms": best_of(lambda: packed.predict_raw(X, threads), repeats, 3) * 1e3}


def measure(profile_id: str, kind: str, rows: int, repeats: int, threads: int) -> dict:
    profile = load_profile(profile_id)
    pred = SurrogatePredictor(profile, kind)
    rng = np.random.default_rng(0)
    scs = random_scenarios(rng, rows, 32)
    X = pred.features(scs)
    t = model_speed(pred.throughput_forest, X, repeats, threads)
    s = model_speed(pred.starved_forest, X, repeats, threads)
    full = {k: t[k] + s[k] for k in ("single_row_us", "single_row_varying_us", "batch_ms", "batch_threads_ms")}
    full["single_row_one_call_us"] = full_row_us(pred.throughput_forest, pred.starved_forest,
                                                 np.ascontiguousarray(X[0], dtype=np.float32), repeats)
    return {"profile": profile_id, "kind": kind, "rows": rows, "threads": threads,
            "throughput_model": t, "starved_model": s, "full": full,
            "predict_1_us": best_of(lambda: pred.predict(scs[:1]), repeats, 5000) * 1e6,
            "predict_3_us": best_of(lambda: pred.predict(scs[:3]), repeats, 2000) * 1e6}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", nargs="+", default=["h100-64gb-llama-3.1-8b", "h100-64gb-qwen2.5-7b"])
    ap.add_argument("--rows", type=int, default=10000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS,
                    help="threads for the parallel batch figure [numba's thread count]")
    ap.add_argument("--out", type=Path, default=result_path("surrogate_speed"))
    args = ap.parse_args(argv)
    results = []
    for pid in args.profile:
        if not has_artifact(load_profile(pid)):
            print(f"{pid}: no surrogate artifact, skipped")
            continue
        for kind in ("surrogate", "small-tree"):
            r = measure(pid, kind, args.rows, args.repeats, args.threads)
            results.append(r)
            tm, sm, fm = r["throughput_model"], r["starved_model"], r["full"]
            print(f"{pid:24} {kind:10} single row {tm['single_row_us']:.2f}+{sm['single_row_us']:.2f}"
                  f"={fm['single_row_us']:.2f} us, one call {fm['single_row_one_call_us']:.2f} us "
                  f"(varying rows {fm['single_row_varying_us']:.2f} us); "
                  f"{args.rows} rows {tm['batch_ms']:.2f}+{sm['batch_ms']:.2f}={fm['batch_ms']:.2f} ms, "
                  f"{args.threads} threads {fm['batch_threads_ms']:.2f} ms; predict() 1 scenario "
                  f"{r['predict_1_us']:.1f} us, 3 scenarios {r['predict_3_us']:.1f} us   (throughput+starved)")
    write_result(args.out, {"benchmark": "surrogate_speed", "numba_threads": numba.config.NUMBA_NUM_THREADS,
                            "targets": TARGETS, "results": results}, argv)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
