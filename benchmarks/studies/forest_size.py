"""Speed against accuracy of smaller forests (issue 4): tree count, leaf bound, random forest vs extra trees.

    python -m benchmarks.studies.forest_size [--profile ID ...] [--trees 8 12 16 24 32 64] [--leaves 512 2048 0]
        [--families rf et] [--seeds 5] [--rows 10000] [--threads N] [--repeats 3]

Per profile, on its shipped dataset (``datasets/<profile-id>/paper.parquet``) and the split
``planner train`` uses (20 % of the scenarios held out, seed 0), for the throughput regressor
(target ``throughput / min(arriving, saturation)``) and the starvation classifier:

* every family (``rf`` = RandomForest*, ``et`` = ExtraTrees*) and leaf bound (``max_leaf_nodes``,
  0 = unbounded) is fitted once with ``max(--trees)`` trees, seed 0, ``max_features=1.0`` and the
  criterion / ``min_samples_leaf`` the tuned shipped models use (squared_error/1 for throughput,
  log_loss/1 for starvation); the first k trees of a seeded forest are the forest of k trees with
  that seed (checked once per profile: ``prefix_equals_refit``), so each tree count is a prefix;
* held-out throughput SMAPE (standard, factor 2) or starved macro-F1, and for the Qwen profile the
  throughput SMAPE on the study's 163 real runs (``--real-runs``); with ``--seeds N`` the held-out
  score of seeds 0..N-1 too (``*_seeds``, ``*_mean``, ``*_std``): one seed's forest of 16 trees
  differs from another's by about as much as 16 trees from 24;
* compiled speed (models.trees, bit-identical to scikit-learn): ``single_row_us`` (one call, the same
  row), ``single_row_varying_us`` (each call the next of 1,000 rows), ``batch_ms`` (``--rows``
  held-out rows drawn with replacement, one thread) and ``batch_threads_ms`` (``--threads``).

Best of ``--repeats``. Writes artifacts/benchmarks/forest_size.json. Targets (issue 4): full model
(both forests) single row ≤ 5 µs and 10,000 rows ≤ 5 ms; held-out throughput SMAPE ≤ 3 %;
starved macro-F1 ≥ 0.97.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from types import SimpleNamespace

import numba
import numpy as np

from benchmarks.fidelity.surrogate_accuracy import DEFAULT_REAL, QWEN
from benchmarks.record import result_path, write_result
from benchmarks.speed.surrogate_speed import best_of
from models.dataset import read_dataset
from models.features import N_FEATURES, engine_terms, fill_features, throughput_base
from models.metrics import macro_f1, smape
from models.realruns import load_real_runs
from models.train import SEED, split
from models.trees import compile_sklearn
from twin import load_profile

ROOT = Path(__file__).resolve().parents[2]

PARAMS = {"throughput": {"criterion": "squared_error", "min_samples_leaf": 1, "max_features": 1.0},
          "starved": {"criterion": "log_loss", "min_samples_leaf": 1, "max_features": 1.0}}
TARGETS = {"full_single_row_us": 5.0, "full_batch_10k_ms": 5.0, "held_out_throughput_smape": 3.0,
           "starved_macro_f1": 0.97}


def estimator(family: str, target: str, trees: int, leaves: int, seed: int = SEED):
    from sklearn.ensemble import (
        ExtraTreesClassifier,
        ExtraTreesRegressor,
        RandomForestClassifier,
        RandomForestRegressor,
    )

    cls = {("rf", "throughput"): RandomForestRegressor, ("et", "throughput"): ExtraTreesRegressor,
           ("rf", "starved"): RandomForestClassifier, ("et", "starved"): ExtraTreesClassifier}[family, target]
    return cls(n_estimators=trees, max_leaf_nodes=leaves or None, random_state=seed, n_jobs=1, **PARAMS[target])


def prefix_scores(model, target: str, X: np.ndarray, y: np.ndarray, trees: list[int]) -> dict[int, float]:
    """Held-out score of the first k trees, for each k (sums in tree order, as the forests do)."""
    if target == "throughput":
        cum = np.cumsum([e.predict(X) for e in model.estimators_], axis=0)
        return {k: smape(cum[k - 1] / k, y) for k in trees}
    cum = np.cumsum([e.predict_proba(X) for e in model.estimators_], axis=0)
    return {k: macro_f1(cum[k - 1][:, 1] > cum[k - 1][:, 0], y) for k in trees}


def prefix(model, k: int):
    """The first ``k`` trees of a fitted forest, in the shape compile_sklearn reads."""
    if hasattr(model, "classes_"):
        return SimpleNamespace(estimators_=model.estimators_[:k], classes_=model.classes_)
    return SimpleNamespace(estimators_=model.estimators_[:k])


def speed(flat, X_time: np.ndarray, repeats: int, threads: int) -> dict:
    packed = flat.packed
    X32 = np.ascontiguousarray(X_time, dtype=np.float32)
    out = np.empty(flat.leaf_value.shape[1])
    rows = X32[:1000]

    def varying():
        for x in rows:
            packed.row(x, out)

    return {"single_row_us": best_of(lambda: packed.row(X32[0], out), repeats, 5000) * 1e6,
            "single_row_varying_us": best_of(varying, repeats, 2) / len(rows) * 1e6,
            "batch_ms": best_of(lambda: flat.predict_raw(X_time), repeats, 2) * 1e3,
            "batch_threads_ms": best_of(lambda: flat.predict_raw(X_time, threads), repeats, 2) * 1e3}


def run_profile(pid: str, args) -> dict:
    profile = load_profile(pid)
    ds = read_dataset([ROOT / "datasets" / pid / "paper.parquet"], profile)
    base = np.array([throughput_base(x) for x in ds.X])
    usable = base > 0
    X = ds.X[usable]
    ys = {"throughput": ds.throughput[usable] / base[usable], "starved": ds.starved[usable]}
    real = None
    if pid == QWEN and args.real_runs.is_file():
        runs = load_real_runs(args.real_runs)
        real_X = np.empty((len(runs.scenarios), N_FEATURES))
        terms = engine_terms(profile)
        for i, sc in enumerate(runs.scenarios):
            fill_features(terms, sc.ranks, sc.rates_rps, sc.input_tokens, sc.output_tokens, sc.a_max,
                          sc.max_lora_rank, float(profile.kv.tokens_for(sc.a_max, sc.max_lora_rank)), real_X[i])
        real = (real_X, np.array([throughput_base(x) for x in real_X]), runs)
    n_trees = max(args.trees)
    entry = {"profile": pid, "rows": int(X.shape[0]), "configs": []}
    for target in ("throughput", "starved"):
        sp = split(X, ys[target], 0.2)
        X_time = sp.X_test[np.random.default_rng(SEED).integers(0, sp.X_test.shape[0], args.rows)]
        for family in args.families:
            for leaves in (args.leaves if target == "throughput" else [0]):
                t0 = time.perf_counter()
                model = estimator(family, target, n_trees, leaves).fit(sp.X_train, sp.y_train)
                fit_s = time.perf_counter() - t0
                # per-seed scores, read only with --seeds > 1
                seeds = [prefix_scores(model, target, sp.X_test, sp.y_test, args.trees)] if args.seeds > 1 else []
                for seed in range(1, args.seeds):
                    other = estimator(family, target, n_trees, leaves, seed).fit(sp.X_train, sp.y_train)
                    seeds.append(prefix_scores(other, target, sp.X_test, sp.y_test, args.trees))
                if "prefix_equals_refit" not in entry:
                    k = min(args.trees)
                    alone = estimator(family, target, k, leaves).fit(sp.X_train, sp.y_train)
                    entry["prefix_equals_refit"] = bool(np.array_equal(
                        compile_sklearn(prefix(model, k)).predict_raw(sp.X_test), compile_sklearn(alone).predict_raw(sp.X_test)))
                for k in sorted(args.trees):
                    flat = compile_sklearn(prefix(model, k))
                    raw = flat.predict_raw(sp.X_test)
                    c = {"target": target, "family": family, "trees": k, "max_leaf_nodes": leaves or None,
                         "nodes": flat.n_nodes, "leaves": flat.n_leaves,
                         "max_depth": int(max(e.get_depth() for e in model.estimators_[:k])),
                         "fit_s_all_trees": fit_s}
                    if target == "throughput":
                        c["held_out_smape"] = smape(raw[:, 0], sp.y_test)
                        if real is not None:
                            real_X, real_base, runs = real
                            c["real_runs_smape"] = smape(flat.predict_raw(real_X)[:, 0] * real_base, runs.throughput)
                    else:
                        c["held_out_macro_f1"] = macro_f1(raw[:, 1] > raw[:, 0], sp.y_test)
                    key = "held_out_smape" if target == "throughput" else "held_out_macro_f1"
                    if args.seeds > 1:
                        per_seed = [sc[k] for sc in seeds]
                        c.update({f"{key}_seeds": per_seed, f"{key}_mean": float(np.mean(per_seed)),
                                  f"{key}_std": float(np.std(per_seed))})
                    c.update(speed(flat, X_time, args.repeats, args.threads))
                    entry["configs"].append(c)
                    score = (f"SMAPE {c['held_out_smape']:5.2f}%" + (f" real {c['real_runs_smape']:5.2f}%"
                                                                     if "real_runs_smape" in c else "")
                             if target == "throughput" else f"F1 {c['held_out_macro_f1']:.4f}")
                    if args.seeds > 1:
                        score += f" ({args.seeds} seeds {c[f'{key}_mean']:.4g} ± {c[f'{key}_std']:.2g})"
                    print(f"{pid:22} {target:10} {family} {k:3} trees, leaves {leaves or 'any':>5} "
                          f"({flat.n_nodes:7} nodes, depth {c['max_depth']:2}): {score}; single row "
                          f"{c['single_row_us']:5.2f} us (varying {c['single_row_varying_us']:5.2f}), "
                          f"{args.rows} rows {c['batch_ms']:6.2f} ms, {args.threads} threads "
                          f"{c['batch_threads_ms']:6.2f} ms", flush=True)
    return entry


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", nargs="+", default=["h100-64gb-llama-3.1-8b", QWEN])
    ap.add_argument("--trees", type=int, nargs="+", default=[8, 12, 16, 24, 32, 64])
    ap.add_argument("--leaves", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 0],
                    help="max_leaf_nodes of the throughput forests (0 = unbounded)")
    ap.add_argument("--families", nargs="+", choices=["rf", "et"], default=["rf", "et"])
    ap.add_argument("--seeds", type=int, default=1, help="held-out scores of seeds 0..N-1 too")
    ap.add_argument("--rows", type=int, default=10000)
    ap.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--real-runs", type=Path, default=DEFAULT_REAL)
    ap.add_argument("--out", type=Path, default=result_path("forest_size"))
    args = ap.parse_args(argv)
    results = [run_profile(pid, args) for pid in args.profile]
    write_result(args.out, {"benchmark": "forest_size", "numba_threads": numba.config.NUMBA_NUM_THREADS,
                            "params": PARAMS, "smape": "standard: 100*mean(2|p-r|/(|p|+|r|))",
                            "targets": TARGETS, "results": results}, argv)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
