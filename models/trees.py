"""Fitted scikit-learn trees and forests as flat numpy arrays, evaluated by ``@numba.njit`` loops.

Loading and evaluating a :class:`FlatForest` needs numpy and numba only. The evaluation repeats
scikit-learn's arithmetic step for step, so predictions are bit-identical to ``predict`` /
``predict_proba`` (checked by tests/test_models_trees.py):

* features are cast to float32 first (sklearn's tree input dtype) and compared ``x <= threshold``
  with the float64 threshold;
* a forest sums its trees' leaf values in tree order from zero and divides by the tree count
  (sklearn's ``_accumulate_prediction`` with ``n_jobs=1``);
* a classifier's leaf holds ``tree_.value`` (class fractions since sklearn 1.4, returned as is by
  ``predict_proba``) and the predicted class is the first argmax.

Layout: one node array for every tree, ``roots`` gives each tree's first node. Internal nodes
have ``feature >= 0`` and absolute ``left``/``right`` children; a leaf has ``feature == -1`` and
``left`` indexes its row of ``leaf_value`` (so internal nodes store no values).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from twin.errors import BadInputError


@dataclass(frozen=True)
class FlatForest:
    feature: np.ndarray  # int16 per node; -1 for a leaf
    threshold: np.ndarray  # float64 per node
    left: np.ndarray  # int32: left child, or the leaf's row in leaf_value
    right: np.ndarray  # int32
    leaf_value: np.ndarray  # float64 (leaves, outputs): regression value or class probabilities
    roots: np.ndarray  # int32, one per tree
    classifier: bool

    @property
    def n_trees(self) -> int:
        return int(self.roots.shape[0])

    @property
    def n_nodes(self) -> int:
        return int(self.feature.shape[0])

    @property
    def n_leaves(self) -> int:
        return int(self.leaf_value.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.feature, self.threshold, self.left, self.right, self.leaf_value, self.roots))

    def arrays(self, prefix: str) -> dict[str, np.ndarray]:
        """The arrays under ``prefix`` keys (for ``np.savez``)."""
        return {f"{prefix}{k}": getattr(self, k) for k in ("feature", "threshold", "left", "right", "leaf_value", "roots")}

    @classmethod
    def from_arrays(cls, arrays, prefix: str, classifier: bool) -> FlatForest:
        try:
            f = cls(*(np.ascontiguousarray(arrays[f"{prefix}{k}"])
                      for k in ("feature", "threshold", "left", "right", "leaf_value", "roots")), classifier=classifier)
        except KeyError as exc:
            raise BadInputError(f"surrogate arrays lack {exc.args[0]}") from None
        f.check()
        return f

    def check(self) -> None:
        """Refuse arrays whose traversal could leave the node or leaf range."""
        n, leaves = self.n_nodes, self.n_leaves
        internal = self.feature >= 0
        ok = (self.threshold.shape == (n,) and self.left.shape == (n,) and self.right.shape == (n,)
              and self.leaf_value.ndim == 2 and self.roots.size > 0
              and np.all((self.roots >= 0) & (self.roots < n))
              and np.all((self.left[internal] > np.flatnonzero(internal)) & (self.left[internal] < n))
              and np.all((self.right[internal] > np.flatnonzero(internal)) & (self.right[internal] < n))
              and np.all((self.left[~internal] >= 0) & (self.left[~internal] < leaves)))
        if not ok:
            raise BadInputError("surrogate tree arrays are inconsistent (corrupt artifact?)")

    def predict_raw(self, X: np.ndarray) -> np.ndarray:
        """Mean leaf values, (rows, outputs) float64 — sklearn's ``predict`` / ``predict_proba``."""
        X32 = np.ascontiguousarray(X, dtype=np.float32)
        if X32.ndim != 2:
            raise BadInputError("features must be a 2-D array (rows, features)")
        out = np.empty((X32.shape[0], self.leaf_value.shape[1]))
        _forest_batch(self.feature, self.threshold, self.left, self.right, self.leaf_value, self.roots, X32, out)
        return out

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Regression values, or for a classifier the index of the predicted class."""
        raw = self.predict_raw(X)
        return np.argmax(raw, axis=1) if self.classifier else raw[:, 0]


@numba.njit(cache=True, inline="always")
def _leaf(feature, threshold, left, right, node, x):
    while feature[node] >= 0:
        if x[feature[node]] <= threshold[node]:
            node = left[node]
        else:
            node = right[node]
    return left[node]


@numba.njit(cache=True)
def forest_row(feature, threshold, left, right, leaf_value, roots, x, out):
    """``out[k]`` = mean over trees of output ``k`` for one float32 row ``x``."""
    n_out = leaf_value.shape[1]
    for k in range(n_out):
        out[k] = 0.0
    for t in range(roots.shape[0]):
        leaf = _leaf(feature, threshold, left, right, roots[t], x)
        for k in range(n_out):
            out[k] += leaf_value[leaf, k]
    n = float(roots.shape[0])
    for k in range(n_out):
        out[k] /= n


@numba.njit(cache=True)
def _forest_batch(feature, threshold, left, right, leaf_value, roots, X, out):
    for i in range(X.shape[0]):
        forest_row(feature, threshold, left, right, leaf_value, roots, X[i], out[i])


def compile_sklearn(model) -> FlatForest:
    """Flatten a fitted ``DecisionTree*``, ``RandomForest*`` or ``ExtraTrees*`` (single output)."""
    estimators = getattr(model, "estimators_", None) or [model]
    classifier = hasattr(model, "classes_")
    if classifier and len(model.classes_) < 2:
        raise BadInputError("a classifier trained on one class cannot be compiled")
    feats, thrs, lefts, rights, values, roots = [], [], [], [], [], []
    offset = leaf_offset = 0
    for est in estimators:
        tree = est.tree_
        if tree.n_outputs != 1:
            raise BadInputError("only single-output trees can be compiled")
        n = tree.node_count
        is_leaf = tree.children_left < 0
        leaf_index = np.cumsum(is_leaf) - 1 + leaf_offset
        value = tree.value[:, 0, :]  # sklearn >= 1.4 stores class fractions for classifiers
        feats.append(np.where(is_leaf, -1, tree.feature).astype(np.int16))
        thrs.append(np.where(is_leaf, 0.0, tree.threshold))
        lefts.append(np.where(is_leaf, leaf_index, tree.children_left + offset).astype(np.int32))
        rights.append(np.where(is_leaf, -1, tree.children_right + offset).astype(np.int32))
        values.append(value[is_leaf])
        roots.append(offset)
        offset += n
        leaf_offset += int(is_leaf.sum())
    forest = FlatForest(np.concatenate(feats), np.concatenate(thrs), np.concatenate(lefts), np.concatenate(rights),
                        np.ascontiguousarray(np.concatenate(values), dtype=np.float64),
                        np.array(roots, np.int32), classifier)
    forest.check()
    return forest


def count_rules(model_or_forest) -> int:
    """Root-to-leaf paths (the study's "rules") of a single tree or a whole forest."""
    if isinstance(model_or_forest, FlatForest):
        return model_or_forest.n_leaves
    estimators = getattr(model_or_forest, "estimators_", None) or [model_or_forest]
    return int(sum(e.tree_.n_leaves for e in estimators))
