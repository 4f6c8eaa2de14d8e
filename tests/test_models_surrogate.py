"""Surrogates end to end on a small twin dataset: train, artifact, predictors, refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import needs

needs("sklearn")
needs("optuna")

from models.dataset import GridSpec, build_dataset
from models.features import FEATURES, engine_terms, feature_row, saturation_tok_s
from models.predictor import default_predictor, load_predictor
from models.scenario import GpuScenario
from models.surrogate import METADATA_FILE, SurrogatePredictor, load_artifact
from models.train import SHIPPED_FOREST, train_surrogates
from models.trees import PARALLEL_BLOCK_ROWS
from twin import load_profile
from twin.errors import BadInputError, InfeasibleError, ProfileError

LLAMA = "h100-64gb-llama-3.1-8b"
GRID = {"name": "unit", "served": [4, 8, 16], "a_max": [4, 8, 16], "rates": [3.2, 1.6, 0.8, 0.4, 0.1, 0.05, 0.025],
        "ranks": [8, 16], "ranks_per_scenario": 2, "duration_s": 60.0, "max_scenarios": 160}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("artifacts")
    prof = load_profile(LLAMA)
    ds = build_dataset(prof, GridSpec.from_dict(GRID), root / "d.parquet", jobs=2, progress=False)
    out = root / "surrogates" / LLAMA
    meta = train_surrogates([ds.out], prof, out, models=("rf", "knn"), trials=3, max_leaf_nodes=32,
                            kernel_rows=100, log=lambda _m: None)
    return root, out, meta


def scenario(n=6, rate=0.2, a_max=4, rank=8):
    return GpuScenario(np.full(n, rank), np.full(n, rate), np.full(n, 220.0), np.full(n, 200.0), a_max)


def test_metadata_reports_every_model_and_the_compiled_forests(artifact):
    meta = artifact[2]
    assert meta["features"] == list(FEATURES) and meta["profile_id"] == LLAMA
    for target in ("throughput", "starved"):
        assert {"rf", "knn", "small_tree"} <= meta["results"][target].keys()
        assert meta["results"][target]["small_tree"]["rules"] <= 32
    assert meta["compiled"]["small_starved"]["trees"] == 1
    assert all(c["bit_identical_to_sklearn_on_held_out"] for c in meta["compiled"].values())
    assert meta["results"]["throughput"]["rf"]["held_out"] < 60  # SMAPE %, a sanity bound on 160 rows
    # The reduced search ships the speed-sized forests, here with the test's leaf bound.
    assert meta["training"]["shipped_forests"] == {"throughput": "ExtraTreesRegressor", "starved": "RandomForestClassifier",
                                                   "ttft": "ExtraTreesRegressor", "tpot": "ExtraTreesRegressor"}
    # the latency forests: log10 p99 TTFT and TPOT, scored by their agreement with the twin on meeting a limit
    assert meta["results"]["ttft"]["rf"]["held_out"] < 1.0 and "2s" in meta["results"]["ttft"]["rf"]["slo_agreement"]
    assert meta["results"]["tpot"]["rf"]["held_out"] < 1.0 and "50ms" in meta["results"]["tpot"]["rf"]["slo_agreement"]
    assert {"full_ttft", "small_ttft", "full_tpot", "small_tpot"} <= meta["compiled"].keys()
    assert meta["training"]["max_leaf_nodes"] == 32
    # KNN is tuned on the capped sample, the shipped forest on every training row.
    assert meta["training"]["kernel_rows"] == 100
    for target in ("throughput", "starved"):
        assert meta["results"][target]["knn"]["train_rows"] == 100
        assert meta["results"][target]["rf"]["train_rows"] > 100
    for target, task in (("throughput", "regression"), ("starved", "classification")):
        compiled = meta["compiled"][f"full_{target}"]
        assert compiled["trees"] == SHIPPED_FOREST[task][1] and compiled["rules"] <= 32 * compiled["trees"]


def test_a_leaf_bound_that_cannot_bind_means_unbounded(artifact, tmp_path):
    root, _, _ = artifact
    meta = train_surrogates([root / "d.parquet"], load_profile(LLAMA), tmp_path, models=("rf",), trials=2,
                            max_leaf_nodes=10**6, log=lambda _m: None)
    assert meta["training"]["max_leaf_nodes"] is None
    assert meta["results"]["throughput"]["rf"]["best_params"]["max_leaf_nodes"] is None


def test_predictors_agree_between_single_and_batch_paths(artifact, monkeypatch):
    root, out, _ = artifact
    prof = load_profile(LLAMA)
    for kind in ("surrogate", "small-tree"):
        pred = SurrogatePredictor(prof, kind, out)
        scs = [scenario(rate=r) for r in (0.01, 0.2, 3.0)] * 2
        few = [pred.predict([sc]) for sc in scs]
        many = pred.predict(scs)
        assert np.array_equal(np.concatenate([p.throughput_tok_s for p in few]), many.throughput_tok_s)
        assert np.array_equal(np.concatenate([p.starved for p in few]), many.starved)
        assert np.allclose(many.arriving_tok_s, [sc.arriving_tok_s for sc in scs])
    light, heavy = pred.predict([scenario(rate=0.01), scenario(n=16, rate=3.2, a_max=16)]).starved
    assert not light and heavy
    qwen = load_profile("h100-64gb-qwen2.5-7b")
    monkeypatch.setenv("LORA_PLANNER_ARTIFACTS", str(root))  # surrogates/<id>/ under it
    assert default_predictor(prof).kind == "surrogate"
    assert load_predictor(prof, "small-tree").kind == "small-tree"
    assert default_predictor(qwen).kind == "twin"


def test_parallel_batches_give_the_same_predictions(artifact):
    _, out, _ = artifact
    prof = load_profile(LLAMA)
    one = SurrogatePredictor(prof, "surrogate", out, threads=1)
    X = one.features([scenario(n=1 + i % 9, rate=0.05 * (1 + i % 7), a_max=4 + 4 * (i % 3)) for i in range(40)])
    X = np.tile(X, (2 * PARALLEL_BLOCK_ROWS // 40 + 1, 1))  # more than one parallel block
    a, b = one.predict_features(X), SurrogatePredictor(prof, "surrogate", out, threads=2).predict_features(X)
    assert np.array_equal(a.throughput_tok_s, b.throughput_tok_s) and np.array_equal(a.starved, b.starved)
    assert np.array_equal(a.throughput_tok_s[:40], one.predict_features(X[:40]).throughput_tok_s)
    with pytest.raises(BadInputError, match="threads"):
        SurrogatePredictor(prof, "surrogate", out, threads=0)


def test_features_match_the_dataset_function():
    sc = scenario(n=5, rate=0.3)
    row = feature_row(engine_terms(load_profile(LLAMA)), sc.ranks, sc.rates_rps, sc.input_tokens, sc.output_tokens,
                      4, 8, 1000)
    assert row[FEATURES.index("arriving_tok_s")] == pytest.approx(sc.arriving_tok_s)
    assert row[FEATURES.index("std_rate")] == 0.0 and row[FEATURES.index("served_adapters")] == 5
    sat = row[FEATURES.index("saturation_tok_s")]
    assert row[FEATURES.index("load_over_saturation")] == pytest.approx(sc.arriving_tok_s / sat)


def test_saturation_estimate_by_hand():
    # max_num_seqs 2048, budget 2048; step = 10 ms x (100 + 10 x adapters) / 100, nothing else.
    terms = np.array([2048, 2048, 0.0, 10.0, 0.0, 10.0, 100.0, 0.0, 0.0, 0.0])
    # KV 15,000 tokens / (100 + 100/2) = 100 requests, each step 100 decodes + 100 prompt tokens.
    assert saturation_tok_s(terms, 100.0, 100.0, 0, 15000.0) == pytest.approx(200 / 0.010)
    assert saturation_tok_s(terms, 100.0, 100.0, 2, 15000.0) == pytest.approx(200 / 0.012)
    # A huge KV cache: the token budget binds (1024 decodes + 1024 prompt tokens per step).
    assert saturation_tok_s(terms, 100.0, 100.0, 0, 1e9) == pytest.approx(2048 / 0.010)


def test_refusals(artifact, tmp_path):
    _, out, _ = artifact
    prof = load_profile(LLAMA)
    with pytest.raises(InfeasibleError, match="memory error"):
        SurrogatePredictor(prof, "surrogate", out).predict([scenario(a_max=384, rank=32)])
    with pytest.raises(ProfileError, match="trained for profile"):
        load_artifact(load_profile("h100-64gb-qwen2.5-7b"), out)
    with pytest.raises(ProfileError, match="no surrogate"):
        load_artifact(prof, tmp_path)
    for name in ("surrogate.npz", METADATA_FILE):
        (tmp_path / name).write_bytes((out / name).read_bytes())
    meta = json.loads((tmp_path / METADATA_FILE).read_text())
    meta["features"] = meta["features"][:7]
    (tmp_path / METADATA_FILE).write_text(json.dumps(meta))
    with pytest.raises(ProfileError, match="uses features"):
        load_artifact(prof, tmp_path)
