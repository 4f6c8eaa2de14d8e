"""The twin's linear-time orderings give exactly NumPy's stable argsorts (the simulation depends on it)."""

import numpy as np
import pytest

from twin.sorting import group_by, stable_argsort


def _cases():
    rng = np.random.default_rng(7)
    yield np.empty(0)
    yield np.array([5.0])
    yield np.array([2.0, 1.0, 2.0, 1.0, 0.5])  # ties keep their order
    yield rng.uniform(0.0, 3600.0, 5000)
    yield rng.integers(0, 20, 3000).astype(float)  # many ties per bucket
    yield np.concatenate([np.sort(rng.uniform(0.0, 60.0, rng.integers(0, 200))) for _ in range(40)])  # adapters' runs
    yield np.concatenate([rng.uniform(0.0, 1e-9, 500), [1e6]])  # bunched: the general sort
    yield np.array([0.0, 5e-324, 0.0])  # a few ulps apart
    yield np.array([3.0, np.nan, 1.0, np.inf, -np.inf, 1.0])  # non-finite: the general sort


@pytest.mark.parametrize("values", list(_cases()))
def test_stable_argsort_equals_numpy(values):
    assert np.array_equal(stable_argsort(values), np.argsort(values, kind="stable"))


def test_group_by_lists_positions_in_order():
    keys = np.array([2, 0, 2, 1, 0, 2])
    starts, members = group_by(keys, 4)
    assert starts.tolist() == [0, 2, 3, 6, 6]  # key 3 has no member
    assert members.tolist() == [1, 4, 3, 0, 2, 5]
    many = np.random.default_rng(3).integers(0, 50, 10_000)
    assert np.array_equal(group_by(many, 50)[1], np.argsort(many, kind="stable"))
