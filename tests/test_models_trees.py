"""The numba tree compiler: bit-identical to scikit-learn, and refuses corrupt arrays."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("sklearn")
from sklearn.ensemble import RandomForestClassifier, RandomForestRegressor
from sklearn.tree import DecisionTreeClassifier, DecisionTreeRegressor

from models.trees import FlatForest, compile_sklearn, count_rules
from twin.errors import BadInputError


def data(n, seed):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 5)) * np.array([1.0, 10.0, 1e3, 0.01, 1.0])
    y = np.sin(X[:, 0]) + X[:, 1] / 10 + (X[:, 2] > 0) + rng.normal(size=n) * 0.1
    return X, y


@pytest.mark.parametrize("model", [
    RandomForestRegressor(n_estimators=12, max_leaf_nodes=64, random_state=0),
    RandomForestRegressor(n_estimators=5, criterion="poisson", random_state=1),
    DecisionTreeRegressor(max_leaf_nodes=32, random_state=0),
])
def test_regressors_are_bit_identical(model):
    X, y = data(600, 0)
    model.fit(X, np.abs(y))
    Xt, _ = data(400, 1)
    flat = compile_sklearn(model)
    assert np.array_equal(flat.predict(Xt), model.predict(Xt))
    assert count_rules(flat) == count_rules(model)


@pytest.mark.parametrize("model", [
    RandomForestClassifier(n_estimators=9, max_depth=6, random_state=0),
    DecisionTreeClassifier(max_leaf_nodes=16, criterion="entropy", random_state=0),
])
def test_classifiers_are_bit_identical(model):
    X, y = data(600, 2)
    model.fit(X, y > 1.0)
    Xt, _ = data(400, 3)
    flat = compile_sklearn(model)
    assert np.array_equal(flat.predict_raw(Xt), model.predict_proba(Xt))
    assert np.array_equal(model.classes_[flat.predict(Xt)], model.predict(Xt))


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
