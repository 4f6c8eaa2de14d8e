"""The numba tree compiler: bit-identical to scikit-learn, and refuses corrupt arrays."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import needs

needs("sklearn")
from sklearn.ensemble import ExtraTreesClassifier, ExtraTreesRegressor, RandomForestClassifier, RandomForestRegressor
from sklearn.tree import DecisionTreeClassifier, DecisionTreeRegressor

from models.trees import PARALLEL_BLOCK_ROWS, FlatForest, compile_sklearn, count_rules
from twin.errors import BadInputError


def data(n, seed):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 5)) * np.array([1.0, 10.0, 1e3, 0.01, 1.0])
    y = np.sin(X[:, 0]) + X[:, 1] / 10 + (X[:, 2] > 0) + rng.normal(size=n) * 0.1
    return X, y


def rows_one_by_one(flat, X):
    out = np.empty((X.shape[0], flat.leaf_value.shape[1]))
    for i, x in enumerate(np.asarray(X, np.float32)):
        flat.packed.row(x, out[i])
    return out


# Tree counts on both sides of 8 (trees walk in lockstep groups of 8) and 403 rows (rows in groups of 8).
@pytest.mark.parametrize("model", [
    RandomForestRegressor(n_estimators=12, max_leaf_nodes=64, random_state=0),
    RandomForestRegressor(n_estimators=5, criterion="poisson", random_state=1),
    ExtraTreesRegressor(n_estimators=17, random_state=0),
    DecisionTreeRegressor(max_leaf_nodes=32, random_state=0),
])
def test_regressors_are_bit_identical(model):
    X, y = data(600, 0)
    model.fit(X, np.abs(y))
    Xt, _ = data(403, 1)
    flat = compile_sklearn(model)
    assert np.array_equal(flat.predict(Xt), model.predict(Xt))
    assert np.array_equal(rows_one_by_one(flat, Xt)[:, 0], model.predict(Xt))
    assert count_rules(flat) == count_rules(model)


@pytest.mark.parametrize("model", [
    RandomForestClassifier(n_estimators=9, max_depth=6, random_state=0),
    ExtraTreesClassifier(n_estimators=8, criterion="log_loss", min_samples_leaf=2, random_state=0),
    DecisionTreeClassifier(max_leaf_nodes=16, criterion="entropy", random_state=0),
])
def test_classifiers_are_bit_identical(model):
    X, y = data(600, 2)
    model.fit(X, y > 1.0)
    Xt, _ = data(403, 3)
    flat = compile_sklearn(model)
    assert np.array_equal(flat.predict_raw(Xt), model.predict_proba(Xt))
    assert np.array_equal(rows_one_by_one(flat, Xt), model.predict_proba(Xt))
    assert np.array_equal(model.classes_[flat.predict(Xt)], model.predict(Xt))


def test_parallel_batches_are_identical():
    X, y = data(600, 4)
    model = ExtraTreesRegressor(n_estimators=10, random_state=0).fit(X, y)
    Xt, _ = data(2 * PARALLEL_BLOCK_ROWS + 5, 5)  # enough rows for more than one block
    flat = compile_sklearn(model)
    serial = flat.predict_raw(Xt)
    assert np.array_equal(serial[:, 0], model.predict(Xt))
    assert np.array_equal(flat.predict_raw(Xt, threads=2), serial)
    assert np.array_equal(flat.predict_raw(Xt, threads=64), serial)


def test_threshold_between_two_float32_values():
    # sklearn splits halfway between adjacent float32 values, a float64 threshold no float32 equals.
    # Rounded to the nearest float32 it would become the upper value (its mantissa is even) and send
    # that value left; rounded down, both values go where sklearn sends them.
    lo = np.float32(1e6)  # ulp 0.0625: far enough apart for sklearn to split them
    if lo.view(np.uint32) % 2 == 0:
        lo = np.nextafter(lo, np.float32(2e6))  # odd mantissa, so the next value up is even
    hi = np.nextafter(lo, np.float32(2e6))
    X = np.array([[lo], [hi]], np.float64)
    model = DecisionTreeRegressor().fit(X, [0.0, 1.0])
    assert np.float32(model.tree_.threshold[0]) == hi  # the trap exists
    flat = compile_sklearn(model)
    assert np.array_equal(flat.predict(X), [0.0, 1.0])
    assert np.array_equal(rows_one_by_one(flat, X)[:, 0], [0.0, 1.0])


def test_round_trip_and_corrupt_arrays_are_refused():
    X, y = data(300, 4)
    flat = compile_sklearn(DecisionTreeRegressor(max_depth=3).fit(X, y))
    again = FlatForest.from_arrays(flat.arrays("t."), "t.", classifier=False)
    assert np.array_equal(again.predict(X), flat.predict(X))
    bad = flat.arrays("t.")
    bad["t.left"] = bad["t.left"].copy()
    bad["t.left"][0] = 0  # a cycle back to the root
    with pytest.raises(BadInputError, match="inconsistent"):
        FlatForest.from_arrays(bad, "t.", classifier=False)


def test_forests_the_evaluator_cannot_hold_and_short_rows_are_refused():
    wide = FlatForest(np.array([200, -1, -1], np.int16), np.array([0.5, 0.0, 0.0]), np.array([1, 0, 1], np.int32),
                      np.array([2, -1, -1], np.int32), np.array([[0.0], [1.0]]), np.array([0], np.int32), False)
    wide.check()
    with pytest.raises(BadInputError, match="too large"):
        wide.predict(np.zeros((1, 201)))
    X, y = data(100, 6)
    flat = compile_sklearn(DecisionTreeRegressor(max_depth=4, random_state=0).fit(X, y))
    with pytest.raises(BadInputError, match="features"):
        flat.predict(X[:, :2])
