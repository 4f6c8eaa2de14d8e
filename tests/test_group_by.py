"""The per-adapter request lists of the twin are exactly NumPy's stable argsort by adapter."""

import numpy as np

from twin.core import group_by


def test_group_by_lists_positions_in_order():
    keys = np.array([2, 0, 2, 1, 0, 2])
    starts, members = group_by(keys, 4)
    assert starts.tolist() == [0, 2, 3, 6, 6]  # key 3 has no member
    assert members.tolist() == [1, 4, 3, 0, 2, 5]
    many = np.random.default_rng(3).integers(0, 50, 10_000)
    starts, members = group_by(many, 50)
    assert np.array_equal(members, np.argsort(many, kind="stable"))
    assert np.array_equal(np.diff(starts), np.bincount(many, minlength=50))
