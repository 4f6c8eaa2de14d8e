"""Training, evaluation and distillation of the surrogates (needs the ``train`` extra: scikit-learn, optuna).

Targets:

* **throughput** — regressed as ``throughput / base`` with base = min(arriving tok/s in the twin's
  run, estimated saturation tok/s feature); a prediction multiplies it by the same base from the nominal
  rates (:func:`models.features.throughput_base`). The ratio is near 1 whether the server keeps up or
  is saturated, which trees and kernels fit far better than raw tok/s; its SMAPE is scale invariant.
* **starved** — classified directly (macro-F1).
* **ttft** — log10 of the p99 time to first token over every arrival (ms), for the latency SLO;
  scored by mean absolute error in log10 units and by agreement with the twin on meeting a limit.
* **tpot** — log10 of the p99 time per output token (ms), scored the same way: what a TPOT limit tighter
  than the default needs (:func:`planner.packing.aim_tpot_limit`).

Models: the forest that ships (``rf``), SVM and KNN, each tuned with ``HalvingGridSearchCV``
(5-fold, seeded) over either a reduced, faster space (``search="reduced"``, the default) or the
paper's Appendix B spaces (``search="paper"``; sklearn no longer has ``max_features="auto"``, its
meaning 1.0 is used). SVM and KNN see standardised features (the study fed them raw features).

The shipped forest of the reduced search is sized for speed (issue 4: a full-model row in ≤ 5 µs,
10,000 rows in ≤ 5 ms): :data:`SHIPPED_FOREST` — 16 extremely randomized trees (sklearn's
``ExtraTreesRegressor``: random split thresholds, no bootstrap) for throughput and a random forest
of 8 trees for starvation, leaves unbounded unless ``max_leaf_nodes`` says otherwise
(``benchmarks/studies/forest_size.py`` measures the alternatives). Their small grid is searched exhaustively
(GridSearchCV): successive halving dropped the squared-error criterion after scoring it on a third
of the rows, while 5-fold CV on all training rows prefers it for unbounded trees. ``search="paper"`` tunes the study's
random forests (32–256 trees), which are larger and slower. A ``max_leaf_nodes`` at least the
training-set size cannot bind and means unbounded (trees grown depth-first, as sklearn does without
a bound). The small trees come from an Optuna search over single decision trees of at most
``MAX_RULES`` leaves, minimising CV error plus a complexity penalty.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models import DEFAULT_KERNEL_ROWS
from models.dataset import read_dataset
from models.edge import edge_features, evaluate_edge, fit_edge
from models.features import ARRIVING, N_FEATURES, SATURATION, engine_terms, fill_features, throughput_base
from models.metrics import macro_f1, smape
from models.surrogate import (
    METADATA_FILE,
    SurrogatePredictor,
    client_cap,
    save_artifact,
    simulation_hash,
    surrogate_dir,
)
from models.trees import FlatForest, compile_sklearn, count_rules
from twin.atomic import write_json_atomic
from twin.errors import BadInputError
from twin.policies.spec import PolicySpec, policy_record

MAX_RULES = 32
SEED = 0
#: The limits each latency forest's agreement with the twin is reported at: p99 TTFT (s), p99 TPOT (ms).
SLO_LIMITS = {"ttft": (0.5, 2.0, 10.0), "tpot": (50.0, 100.0, 200.0)}
#: The shipped forests of the reduced search: (scikit-learn estimator, trees) per task.
SHIPPED_FOREST = {"regression": ("ExtraTreesRegressor", 16), "classification": ("RandomForestClassifier", 8)}


def _sk():
    try:
        import sklearn  # noqa: F401
    except ImportError:
        raise BadInputError("training needs scikit-learn and optuna: pip install 'lora-planner[train]'") from None


def search_spaces(search: str, task: str, max_leaf_nodes: int | None) -> dict[str, tuple[Any, dict[str, list]]]:
    """{model name: (estimator, param grid)} for ``task`` in {"regression", "classification"}; ``rf`` is
    the forest that ships (:data:`SHIPPED_FOREST` for the reduced search), ``max_leaf_nodes`` its
    leaf bound (None: unbounded)."""
    from sklearn import ensemble
    from sklearn.neighbors import KNeighborsClassifier, KNeighborsRegressor
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVC, SVR

    reg = task != "classification"
    task = "regression" if reg else task
    family = SHIPPED_FOREST[task][0] if search == "reduced" else ("RandomForestRegressor" if reg
                                                                   else "RandomForestClassifier")
    rf = getattr(ensemble, family)(random_state=SEED, n_jobs=1)
    svm = make_pipeline(StandardScaler(), SVR() if reg else SVC())
    knn = make_pipeline(StandardScaler(), (KNeighborsRegressor if reg else KNeighborsClassifier)(
        leaf_size=8, algorithm="kd_tree"))
    if search == "paper":
        rf_grid = {"n_estimators": [32, 128, 256], "max_depth": [None, 5, 10, 20], "min_samples_split": [2, 5, 10, 20],
                   "criterion": (["squared_error", "absolute_error", "friedman_mse", "poisson"] if reg
                                 else ["gini", "entropy", "log_loss"]),
                   "min_samples_leaf": [1, 2, 5, 10, 32, 128],
                   "max_features": [1.0, "sqrt", "log2"] if reg else [None, "sqrt", "log2"]}
        svm_grid = {"C": [0.1, 1, 10, 100, 1000, 10000], "kernel": ["linear", "poly", "rbf", "sigmoid"],
                    "degree": [2, 3, 4, 5], "gamma": ["scale", "auto", 0.01, 0.1, 1, 10], "coef0": [0, 0.1, 0.5, 1]}
        if reg:
            svm_grid["epsilon"] = [0.1, 0.5, 1, 5]
        knn_grid = {"n_neighbors": [1], "weights": ["uniform"], "p": [1, 2]}
    elif search == "reduced":
        rf_grid = {"n_estimators": [SHIPPED_FOREST[task][1]], "min_samples_leaf": [1, 2, 5],
                   "max_features": [1.0, 0.5, "sqrt"],
                   "criterion": ["squared_error", "poisson"] if reg else ["gini", "log_loss"]}
        svm_grid = {"C": [1, 10, 100, 1000], "kernel": ["rbf"], "gamma": ["scale", 0.1, 1]}
        if reg:
            svm_grid["epsilon"] = [0.001, 0.01]
        knn_grid = {"n_neighbors": [1, 3, 5], "weights": ["uniform", "distance"], "p": [1, 2]}
    else:
        raise BadInputError(f"unknown search space '{search}' (paper, reduced)")
    rf_grid["max_leaf_nodes"] = [max_leaf_nodes]

    def piped(grid, step):
        return {f"{step}__{k}": v for k, v in grid.items()}

    return {"rf": (rf, rf_grid), "svm": (svm, piped(svm_grid, svm.steps[-1][0])),
            "knn": (knn, piped(knn_grid, knn.steps[-1][0]))}


def _smape_score(y_true, y_pred) -> float:
    return -smape(y_pred, y_true)


def _scorer(task: str):
    from sklearn.metrics import make_scorer

    return {"regression": make_scorer(_smape_score), "log-regression": "neg_mean_absolute_error",
            "classification": "f1_macro"}[task]


@dataclass
class Split:
    X_train: np.ndarray
    X_test: np.ndarray
    y_train: np.ndarray
    y_test: np.ndarray


def split(X: np.ndarray, y: np.ndarray, test_fraction: float, seed: int = SEED) -> Split:
    """Held-out scenarios: a seeded random ``test_fraction`` of the rows (each row is one scenario)."""
    idx = np.random.default_rng(seed).permutation(X.shape[0])
    n_test = round(test_fraction * X.shape[0])
    te, tr = idx[:n_test], idx[n_test:]
    return Split(X[tr], X[te], y[tr], y[te])


def _sample(X: np.ndarray, y: np.ndarray, rows: int, seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    """A seeded sample of at most ``rows`` rows (0: all), in their original order."""
    if not rows or X.shape[0] <= rows:
        return X, y
    keep = np.sort(np.random.default_rng(seed).choice(X.shape[0], rows, replace=False))
    return X[keep], y[keep]


def score(task: str, pred: np.ndarray, real: np.ndarray) -> float:
    """SMAPE (regression), mean absolute error in log10 units (log-regression), macro-F1 (classification)."""
    if task == "log-regression":
        return float(np.mean(np.abs(pred - real)))
    return smape(pred, real) if task == "regression" else macro_f1(pred, real)


def tune(task: str, name: str, estimator, grid: dict, X: np.ndarray, y: np.ndarray, jobs: int,
         exhaustive: bool = False) -> dict[str, Any]:
    """HalvingGridSearchCV (5-fold) of one model, or with ``exhaustive`` GridSearchCV (every candidate
    on all rows); returns the refitted best estimator and its CV score."""
    from sklearn.experimental import enable_halving_search_cv  # noqa: F401
    from sklearn.model_selection import GridSearchCV, HalvingGridSearchCV, KFold, StratifiedKFold

    cv = (StratifiedKFold if task == "classification" else KFold)(5, shuffle=True, random_state=SEED)
    common = {"cv": cv, "scoring": _scorer(task), "n_jobs": jobs, "error_score": np.nan}
    search = (GridSearchCV(estimator, grid, **common) if exhaustive
              else HalvingGridSearchCV(estimator, grid, random_state=SEED, **common))
    t0 = time.perf_counter()
    search.fit(X, y)
    best = search.best_estimator_
    return {"model": name, "estimator": best, "best_params": {k: _jsonable(v) for k, v in search.best_params_.items()},
            "cv_score": float(search.best_score_ if task == "classification" else -search.best_score_),
            "candidates": len(search.cv_results_["params"]), "search": type(search).__name__,
            "search_s": time.perf_counter() - t0}


def _jsonable(v):
    return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)


def predict_timed(estimator, X: np.ndarray) -> tuple[np.ndarray, float]:
    """Predictions and sklearn's time per row in µs (the study reports ms/sample)."""
    t0 = time.perf_counter()
    pred = estimator.predict(X)
    return pred, (time.perf_counter() - t0) / max(1, X.shape[0]) * 1e6


def distil(task: str, X: np.ndarray, y: np.ndarray, trials: int, penalty: float, jobs: int) -> dict[str, Any]:
    """Optuna search for one decision tree of ≤ MAX_RULES leaves minimising CV error + penalty·leaves/MAX_RULES.

    The error is SMAPE (%) for regression and 100·(1 − macro-F1) for classification, so the
    penalty is in the same units: ``penalty`` points for a tree that uses all MAX_RULES leaves.
    """
    import optuna
    from sklearn.model_selection import KFold, StratifiedKFold, cross_val_score
    from sklearn.tree import DecisionTreeClassifier, DecisionTreeRegressor

    reg = task != "classification"
    cv = (KFold if reg else StratifiedKFold)(5, shuffle=True, random_state=SEED)
    criteria = ["squared_error", "poisson"] if reg else ["gini", "entropy", "log_loss"]

    def make(params):
        cls = DecisionTreeRegressor if reg else DecisionTreeClassifier
        return cls(random_state=SEED, **params)

    def objective(trial):
        params = {"max_leaf_nodes": trial.suggest_int("max_leaf_nodes", 4, MAX_RULES),
                  "max_depth": trial.suggest_int("max_depth", 2, 10),
                  "min_samples_leaf": trial.suggest_int("min_samples_leaf", 1, 256, log=True),
                  "criterion": trial.suggest_categorical("criterion", criteria)}
        cv_score = float(np.mean(cross_val_score(make(params), X, y, cv=cv, scoring=_scorer(task), n_jobs=jobs)))
        err = -cv_score * (100.0 if task == "log-regression" else 1.0) if reg else 100.0 * (1.0 - cv_score)
        leaves = make(params).fit(X, y).tree_.n_leaves
        trial.set_user_attr("cv_error", err)
        trial.set_user_attr("leaves", int(leaves))
        return err + penalty * leaves / MAX_RULES

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=SEED))
    t0 = time.perf_counter()
    study.optimize(objective, n_trials=trials)
    best = study.best_trial
    tree = make(best.params).fit(X, y)
    return {"estimator": tree, "best_params": dict(best.params), "cv_error": best.user_attrs["cv_error"],
            "objective": float(best.value), "rules": int(tree.tree_.n_leaves), "trials": trials,
            "penalty": penalty, "search_s": time.perf_counter() - t0}


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("lora-planner", "scikit-learn", "optuna", "numpy", "numba"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "unknown"
    return out


def _regimes(pred_thr, real_thr, real_starved) -> dict[str, float]:
    return {"throughput_smape": smape(pred_thr, real_thr),
            "throughput_smape_not_starved": smape(pred_thr[~real_starved], real_thr[~real_starved]),
            "throughput_smape_starved": smape(pred_thr[real_starved], real_thr[real_starved])}


def _assert_identical(name: str, compiled: np.ndarray, reference: np.ndarray) -> None:
    if not np.array_equal(compiled, reference):
        raise AssertionError(f"compiled {name} differs from scikit-learn on the rows checked "
                             f"(max |diff| {np.max(np.abs(compiled - reference))})")


def train_edge(X: np.ndarray, passed: np.ndarray, seed: np.ndarray, first_round: np.ndarray,
               jobs: int = 1) -> tuple[FlatForest, dict[str, Any]]:
    """The edge classifier (:mod:`models.edge`) of judged GPUs: ``X`` their ``FEATURES`` at the packer's aim,
    ``passed`` the verdicts, ``seed`` each GPU's workload seed (held out in turn to evaluate it), ``first_round``
    the GPUs of first packings. Returns the compiled forest, checked identical to scikit-learn on every judged
    GPU, and what its metadata records of the training (``evaluation``, ``versions``)."""
    _sk()
    Xe = edge_features(X)
    evaluation = evaluate_edge(Xe, passed, seed, first_round, jobs)
    model = fit_edge(Xe, passed, jobs)
    forest = compile_sklearn(model)
    model.set_params(n_jobs=1)  # sums the trees in order, as the compiled forest does
    _assert_identical("edge classifier", forest.predict_raw(Xe), model.predict_proba(Xe))
    return forest, {"evaluation": evaluation, "versions": _versions()}


def train_surrogates(dataset_paths, profile, out_dir, *, search: str = "reduced", models=("rf", "svm", "knn"),
                     jobs: int = 1, trials: int = 60, penalty: float = 1.0, test_fraction: float = 0.2,
                     max_leaf_nodes: int | None = None, kernel_rows: int = DEFAULT_KERNEL_ROWS, real_runs=None,
                     command: str = "", log=print, policy: PolicySpec | None = None) -> dict[str, Any]:
    """Train, evaluate, distil, compile and write the surrogate artifact of ``profile`` under serving
    ``policy`` (None: stock vLLM; the datasets must be built for the same); return its metadata.

    Every model is scored on held-out scenarios (and on ``real_runs``, a :class:`models.realruns.RealRuns`,
    when given); the shipped forests are the tuned ``rf`` forests (leaves at most ``max_leaf_nodes``,
    None or a bound of at least the training rows: unbounded), checked bit-identical after compiling.
    SVM and KNN are tuned on at most ``kernel_rows`` training rows (0: all).
    """
    _sk()
    if policy is not None and real_runs is not None:
        raise BadInputError(f"real runs are measurements of stock vLLM; they cannot score a surrogate of "
                            f"policy {policy.name} (drop --real-runs)")

    if "rf" not in models:
        raise BadInputError("the random forest ('rf') is the model that ships; keep it in --models")
    ds = read_dataset(dataset_paths, profile, policy)
    cap = client_cap(ds.metadata["files"])
    if cap and Path(out_dir).resolve() == surrogate_dir(profile.profile_id, policy).resolve():
        raise BadInputError(f"the dataset was built with a client cap of {cap} requests in flight (a measurement "
                            f"client, not production traffic); the planner would use a surrogate trained on it, so "
                            f"write it elsewhere with --out")
    # The target divides by what arrived in the twin's own run, not the nominal rates: a light scenario's
    # Poisson draw brings 25 or 45 requests where 36 were expected, and a ratio to the nominal load would
    # teach the forest that draw's noise (a light GPU predicted to serve 70 % of its load).
    base = np.minimum(ds.arriving, ds.X[:, SATURATION])
    usable = base > 0
    X, base = ds.X[usable], base[usable]
    y_frac = ds.throughput[usable] / base
    y_starved = ds.starved[usable]
    if X.shape[0] < 50 or y_starved.all() or not y_starved.any():
        raise BadInputError(f"dataset has {X.shape[0]} usable rows ({int(y_starved.sum())} starved); "
                            "training needs >= 50 rows with both starved and healthy scenarios")
    log(f"{X.shape[0]} scenarios ({int(y_starved.sum())} starved), {N_FEATURES} features; held out {test_fraction:.0%}")
    if max_leaf_nodes is not None and max_leaf_nodes >= X.shape[0]:
        max_leaf_nodes = None  # no tree has more leaves than training rows: the bound cannot bind
    real_X = None
    if real_runs is not None:
        real_X = np.empty((len(real_runs.scenarios), N_FEATURES))
        terms = engine_terms(profile)
        for i, sc in enumerate(real_runs.scenarios):
            fill_features(terms, sc.ranks, sc.rates_rps, sc.input_tokens, sc.output_tokens, sc.a_max, sc.max_lora_rank,
                          float(profile.kv.tokens_for(sc.a_max, sc.max_lora_rank)), real_X[i])

    tasks = {"throughput": ("regression", X, y_frac), "starved": ("classification", X, y_starved)}
    for target, values in (("ttft", ds.ttft_ms_p99_all), ("tpot", ds.tpot_ms_p99)):
        logged = np.log10(np.maximum(values[usable], 1.0))
        timed = np.isfinite(logged)
        if timed.sum() >= 50:  # rows of schema-2 datasets: the latency SLO's targets
            tasks[target] = ("log-regression", X[timed], logged[timed])
            log(f"  {int(timed.sum())} of them with p99 {target.upper()} (the {target} forest's rows)")
    results: dict[str, Any] = {}
    best_rf: dict[str, Any] = {}
    small: dict[str, Any] = {}
    splits: dict[str, Split] = {}
    for target, (task, X_task, y) in tasks.items():
        sp = splits[target] = split(X_task, y, test_fraction)
        results[target] = {}
        spaces = search_spaces(search, task, max_leaf_nodes)
        for name in models if task != "log-regression" else ("rf",):
            est, grid = spaces[name]
            X_fit, y_fit = (sp.X_train, sp.y_train) if name == "rf" else _sample(sp.X_train, sp.y_train, kernel_rows)
            r = tune(task, name, est, grid, X_fit, y_fit, jobs, exhaustive=name == "rf" and search == "reduced")
            pred, us = predict_timed(r["estimator"], sp.X_test)
            entry = {k: v for k, v in r.items() if k != "estimator"}
            entry["estimator"] = type(r["estimator"]).__name__
            entry["sklearn_us_per_row"] = us
            entry["train_rows"] = int(X_fit.shape[0])
            entry.update(_evaluate(target, task, pred, sp, real_X, real_runs, r["estimator"]))
            results[target][name] = entry
            log(f"  {target:10} {name:4} cv {entry['cv_score']:.4f} held-out {entry['held_out']:.4f}"
                + (f" real {entry['real']['score']:.4f}" if "real" in entry else "")
                + f" ({entry['search_s']:.0f} s, {entry['candidates']} candidates)")
            if name == "rf":
                best_rf[target] = r["estimator"]
        d = distil(task, sp.X_train, sp.y_train, trials, penalty, jobs)
        pred = d["estimator"].predict(sp.X_test)
        entry = {k: v for k, v in d.items() if k != "estimator"}
        entry.update(_evaluate(target, task, pred, sp, real_X, real_runs, d["estimator"]))
        results[target]["small_tree"] = entry
        small[target] = d["estimator"]
        log(f"  {target:10} small tree {entry['rules']} rules, held-out {entry['held_out']:.4f}"
            + (f" real {entry['real']['score']:.4f}" if "real" in entry else ""))

    forests = {}
    for prefix, fitted in (("full", best_rf), ("small", small)):
        for target, est in fitted.items():
            flat = compile_sklearn(est)
            Xt = splits[target].X_test
            if target != "starved":
                _assert_identical(f"{prefix} {target}", flat.predict_raw(Xt)[:, 0], est.predict(Xt))
            else:
                _assert_identical(f"{prefix} {target}", flat.predict_raw(Xt), est.predict_proba(Xt))
            forests[f"{prefix}_{target}"] = flat
    meta = {
        "profile_id": profile.profile_id, "profile_simulation_hash": simulation_hash(profile, policy),
        **({} if policy is None else {"policy": policy_record(policy)}),
        "throughput_target": "throughput_tok_s / min(arriving_tok_s measured in the twin's run, saturation_tok_s "
                             "feature); predicted throughput = target x min(nominal arriving_tok_s, saturation_tok_s)",
        "ttft_target": "log10 of p99 TTFT over every arrival in ms (SimResult.ttft_ms_p99_all), at least 1 ms",
        **({"tpot_target": "log10 of p99 TPOT over finished requests in ms (SimResult.tpot_ms_p99), at least 1 ms"}
           if "tpot" in tasks else {}),
        "smape": "standard: 100*mean(2|p-r|/(|p|+|r|))",
        "dataset": {"sha256": ds.sha256, "rows": int(X.shape[0]), "profile_hash": ds.metadata["profile_hash"],
                    "files": [{k: f.get(k) for k in ("rows", "grid_scenarios", "complete", "grid")}
                              for f in ds.metadata["files"]]},
        "training": {"search": search, "models": list(models), "cv_folds": 5, "seed": SEED,
                     "test_fraction": test_fraction, "max_leaf_nodes": max_leaf_nodes, "kernel_rows": kernel_rows,
                     "shipped_forests": {t: type(est).__name__ for t, est in best_rf.items()}, "optuna_trials": trials,
                     "complexity_penalty": penalty, "max_rules": MAX_RULES},
        "results": results,
        "compiled": {name: {"trees": f.n_trees, "nodes": f.n_nodes, "rules": count_rules(f), "bytes": f.nbytes,
                            "bit_identical_to_sklearn_on_held_out": True} for name, f in forests.items()},
        "versions": _versions(), "command": command,
    }
    meta = save_artifact(out_dir, forests, meta)
    if real_runs is not None:  # the shipped predictors, end to end from GpuScenario
        for kind in ("surrogate", "small-tree"):
            p = SurrogatePredictor(profile, kind, out_dir, edge=False).predict(real_runs.scenarios)
            meta.setdefault("real_runs_predictor", {})[kind] = {
                **_regimes(p.throughput_tok_s, real_runs.throughput, real_runs.starved),
                "starved_macro_f1": macro_f1(p.starved, real_runs.starved)}
        write_json_atomic(Path(out_dir) / METADATA_FILE, meta)
    return meta


def _evaluate(target, task, pred, sp: Split, real_X, real_runs, estimator) -> dict[str, Any]:
    out: dict[str, Any] = {"held_out": score(task, pred, sp.y_test)}
    if task == "log-regression":  # how often it sides with the twin on meeting a limit
        unit, to_ms = ("s", 1000.0) if target == "ttft" else ("ms", 1.0)
        out["slo_agreement"] = {f"{limit:g}{unit}": float(np.mean((pred <= np.log10(limit * to_ms))
                                                                 == (sp.y_test <= np.log10(limit * to_ms))))
                                for limit in SLO_LIMITS[target]}
        return out
    if real_X is not None:
        rp = estimator.predict(real_X)
        if task == "regression":
            thr = rp * np.array([throughput_base(x) for x in real_X])
            out["real"] = {"score": smape(thr, real_runs.throughput),
                           **_regimes(thr, real_runs.throughput, real_runs.starved),
                           "starved_from_fraction_macro_f1": macro_f1(thr < 0.9 * real_X[:, ARRIVING],
                                                                        real_runs.starved)}
        else:
            out["real"] = {"score": macro_f1(rp, real_runs.starved)}
    return out
