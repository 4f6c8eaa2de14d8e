"""Fitted scikit-learn trees and forests as flat numpy arrays, evaluated by ``@numba.njit`` loops.

Loading and evaluating a :class:`FlatForest` needs numpy and numba only. The evaluation repeats
scikit-learn's decisions and arithmetic exactly, so predictions are bit-identical to ``predict`` /
``predict_proba`` (checked by tests/test_models_trees.py and by ``planner train`` on held-out rows):

* features are cast to float32 first (sklearn's tree input dtype) and go left when ``x <= threshold``
  (float64 in sklearn). The evaluator compares with the threshold rounded *down* to float32, which
  decides every float32 ``x`` the same way (x <= t  ⇔  x <= the largest float32 ≤ t); NaN goes right;
* a forest sums its trees' leaf values in tree order from zero and divides by the tree count
  (sklearn's ``_accumulate_prediction`` with ``n_jobs=1``);
* a classifier's leaf holds ``tree_.value`` (class fractions since sklearn 1.4, returned as is by
  ``predict_proba``) and the predicted class is the first argmax.

Stored layout (the artifact, :meth:`FlatForest.arrays`): one node array for every tree, ``roots``
gives each tree's first node. Internal nodes have ``feature >= 0`` and absolute ``left``/``right``
children; a leaf has ``feature == -1`` and ``left`` indexes its row of ``leaf_value``.

Evaluation layout (:class:`PackedForest`, built once per loaded forest): 8 bytes per node in one
int32 pair — ``child << 8 | leaf flag << 7 | feature`` and the float32 threshold's bits — each tree
in breadth-first order with the two children of a node side by side, so the next node is
``child + (x > threshold)`` without a branch and the top levels every row visits share cache lines.
A leaf's threshold is NaN and its child itself minus one, so a walker that reached a leaf stays
there; that lets several walkers advance in lockstep: eight trees for one row
(:func:`forest_row`), eight rows per tree for a batch (tree by tree over the rows, so one tree's
nodes stay in cache), and with ``threads`` > 1 row blocks in parallel (numba ``prange``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numba
import numpy as np
from numba import uint64

from twin.errors import BadInputError

LEAF_FLAG = 128  #: bit 7 of a packed node word; bits 0-6 hold the feature (at most 128 features)
MAX_PACKED_NODES = 1 << 23  #: child index in bits 8-31 of a signed int32
#: Version of the :class:`PackedForest` layout (part of the key of :mod:`models.packed_cache` entries).
PACKED_LAYOUT_VERSION = 1
#: Rows per parallel block; batches below 2 blocks run on the calling thread.
PARALLEL_BLOCK_ROWS = 2048


class _Counts:
    """Tree and leaf counts of a forest with ``roots`` and ``leaf_value`` arrays."""

    roots: np.ndarray
    leaf_value: np.ndarray

    @property
    def n_trees(self) -> int:
        return int(self.roots.shape[0])

    @property
    def n_leaves(self) -> int:
        return int(self.leaf_value.shape[0])


@dataclass(frozen=True)
class FlatForest(_Counts):
    feature: np.ndarray  # int16 per node; -1 for a leaf
    threshold: np.ndarray  # float64 per node
    left: np.ndarray  # int32: left child, or the leaf's row in leaf_value
    right: np.ndarray  # int32
    leaf_value: np.ndarray  # float64 (leaves, outputs): regression value or class probabilities
    roots: np.ndarray  # int32, one per tree
    classifier: bool

    @property
    def n_nodes(self) -> int:
        return int(self.feature.shape[0])

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

    @cached_property
    def packed(self) -> PackedForest:
        """The evaluation layout (built on first use)."""
        return PackedForest.build(self)

    def predict_raw(self, X: np.ndarray, threads: int = 1) -> np.ndarray:
        """Mean leaf values, (rows, outputs) float64 — sklearn's ``predict`` / ``predict_proba``.

        ``threads`` > 1 evaluates blocks of rows in parallel on up to that many numba threads (results
        are identical; batches under two blocks stay on the calling thread).
        """
        return self.packed.predict_raw(X, threads)

    def predict(self, X: np.ndarray, threads: int = 1) -> np.ndarray:
        """Regression values, or for a classifier the index of the predicted class."""
        raw = self.predict_raw(X, threads)
        return np.argmax(raw, axis=1) if self.classifier else raw[:, 0]


def _threshold_down_f32(threshold: np.ndarray) -> np.ndarray:
    """The largest float32 ≤ each float64 threshold (so float32 ``x <= t32`` ⇔ ``x <= t``)."""
    t32 = threshold.astype(np.float32)
    above = t32.astype(np.float64) > threshold
    t32[above] = np.nextafter(t32[above], np.float32(-np.inf))
    return t32


@dataclass(frozen=True)
class PackedForest(_Counts):
    """A :class:`FlatForest` in the evaluation layout (see the module docstring)."""

    nodes: np.ndarray  # int32 (nodes, 2): child << 8 | leaf flag | feature, then the threshold's bits
    thresholds: np.ndarray  # float32 (nodes, 2) view of ``nodes``; column 1 is the threshold
    leaf_row: np.ndarray  # int32 per node: the leaf's row in leaf_value, -1 for an internal node
    leaf_value: np.ndarray
    roots: np.ndarray  # int32, one per tree
    n_features: int  # the largest feature index + 1

    @classmethod
    def build(cls, forest: FlatForest) -> PackedForest:
        n = forest.n_nodes
        if n >= MAX_PACKED_NODES or forest.feature.max(initial=-1) >= LEAF_FLAG:
            raise BadInputError(f"a forest of {n} nodes and {int(forest.feature.max()) + 1} features is too large "
                                f"to evaluate (at most {MAX_PACKED_NODES - 1} nodes, {LEAF_FLAG} features)")
        nodes = np.empty((n, 2), np.int32)
        thresholds = nodes.view(np.float32)
        leaf_row = np.empty(n, np.int32)
        roots = np.empty_like(forest.roots)
        _pack(forest.feature, _threshold_down_f32(forest.threshold), forest.left, forest.right, forest.roots,
              nodes, thresholds, leaf_row, roots)
        return cls(nodes, thresholds, leaf_row, forest.leaf_value, roots, int(forest.feature.max(initial=-1)) + 1)

    @property
    def n_nodes(self) -> int:
        return int(self.nodes.shape[0])

    #: the arrays of :meth:`arrays`, by name (``thresholds`` is a view of ``nodes``)
    ARRAY_KEYS = ("nodes", "leaf_row", "leaf_value", "roots")

    def arrays(self) -> dict[str, np.ndarray]:
        """What :meth:`from_arrays` needs."""
        return {k: getattr(self, k) for k in self.ARRAY_KEYS}

    @classmethod
    def from_arrays(cls, arrays) -> PackedForest:
        """The forest of :meth:`arrays`; BadInputError if a walk could leave the node or leaf range."""
        nodes, leaf_row = np.asarray(arrays["nodes"]), np.asarray(arrays["leaf_row"])
        leaf_value, roots = np.asarray(arrays["leaf_value"]), np.asarray(arrays["roots"])
        n = nodes.shape[0]
        ok = (nodes.dtype == np.int32 and nodes.ndim == 2 and nodes.shape[1] == 2 and leaf_row.dtype == np.int32
              and leaf_row.shape == (n,) and roots.dtype == np.int32 and roots.size > 0 and leaf_value.ndim == 2
              and np.all((roots >= 0) & (roots < n)))
        if ok:
            word = nodes[:, 0]
            leaf = (word & LEAF_FLAG) != 0
            child = word >> 8
            ok = (np.array_equal(leaf, leaf_row >= 0) and np.all(leaf_row < leaf_value.shape[0])
                  and np.all(np.where(leaf, True, (child >= 0) & (child < n - 1))))
        if not ok:
            raise BadInputError("packed surrogate trees are inconsistent (corrupt cache?)")
        features = word[~leaf] & (LEAF_FLAG - 1)
        return cls(nodes, nodes.view(np.float32), leaf_row, leaf_value, roots, int(features.max(initial=-1)) + 1)

    def predict_raw(self, X: np.ndarray, threads: int = 1) -> np.ndarray:
        X32 = np.ascontiguousarray(X, dtype=np.float32)
        if X32.ndim != 2 or X32.shape[1] < self.n_features:
            raise BadInputError(f"features must be a 2-D array (rows, >= {self.n_features} features)")
        out = np.empty((X32.shape[0], self.leaf_value.shape[1]))
        blocks = -(-X32.shape[0] // PARALLEL_BLOCK_ROWS)
        if threads > 1 and blocks > 1:
            _forest_batch_parallel(self.nodes, self.thresholds, self.leaf_row, self.leaf_value, self.roots, X32, out,
                                   -(-X32.shape[0] // min(threads, blocks)))
        else:
            _forest_rows(self.nodes, self.thresholds, self.leaf_row, self.leaf_value, self.roots, X32, out)
        return out

    def row(self, x32: np.ndarray, out: np.ndarray) -> None:
        """``out`` = mean leaf values of one float32 feature row of at least ``n_features`` values (one
        compiled call, unchecked: the hot path)."""
        forest_row(self.nodes, self.thresholds, self.leaf_row, self.leaf_value, self.roots, x32, out)


@numba.njit(cache=True)
def _pack(feature, threshold32, left, right, roots, nodes, thresholds, leaf_row, new_roots):
    """Lay each tree out breadth-first with siblings adjacent (the queue position is the new index)."""
    order = np.empty(feature.shape[0], np.int32)  # old node id at each new position
    pos = 0
    for t in range(roots.shape[0]):
        new_roots[t] = pos
        order[pos] = roots[t]
        pos += 1
        q = new_roots[t]
        while q < pos:
            old = order[q]
            if feature[old] < 0:  # leaf: NaN threshold never goes left, child + 1 is the leaf itself
                nodes[q, 0] = ((q - 1) << 8) | LEAF_FLAG
                thresholds[q, 1] = np.nan
                leaf_row[q] = left[old]
            else:
                nodes[q, 0] = (pos << 8) | feature[old]
                thresholds[q, 1] = threshold32[old]
                leaf_row[q] = -1
                order[pos] = left[old]
                order[pos + 1] = right[old]
                pos += 2
            q += 1


@numba.njit(cache=True, inline="always")
def _next(thresholds, x, n, p):
    """The child of node ``n`` (packed word ``p``) for row ``x``: left if x <= threshold, else right."""
    return (p >> 8) + 1 - np.int32(x[uint64(p & (LEAF_FLAG - 1))] <= thresholds[uint64(n), 1])


@numba.njit(cache=True, inline="always")
def _leaf_of(nodes, thresholds, x, n):
    """Walk one tree from node ``n`` to its leaf."""
    p = nodes[uint64(n), 0]
    while (p & LEAF_FLAG) == 0:
        n = _next(thresholds, x, n, p)
        p = nodes[uint64(n), 0]
    return n


@numba.njit(cache=True)
def forest_row(nodes, thresholds, leaf_row, leaf_value, roots, x, out):
    """``out[k]`` = mean over trees of output ``k`` for one float32 row ``x``; eight trees walk in lockstep."""
    n_out = leaf_value.shape[1]
    n_trees = roots.shape[0]
    for k in range(n_out):
        out[k] = 0.0
    t = 0
    while t + 8 <= n_trees:
        a, b, c, d = np.int64(roots[t]), np.int64(roots[t + 1]), np.int64(roots[t + 2]), np.int64(roots[t + 3])
        e, f, g, h = np.int64(roots[t + 4]), np.int64(roots[t + 5]), np.int64(roots[t + 6]), np.int64(roots[t + 7])
        while True:
            pa, pb, pc, pd = nodes[uint64(a), 0], nodes[uint64(b), 0], nodes[uint64(c), 0], nodes[uint64(d), 0]
            pe, pf, pg, ph = nodes[uint64(e), 0], nodes[uint64(f), 0], nodes[uint64(g), 0], nodes[uint64(h), 0]
            if pa & pb & pc & pd & pe & pf & pg & ph & LEAF_FLAG:
                break
            a, b, c, d = (_next(thresholds, x, a, pa), _next(thresholds, x, b, pb), _next(thresholds, x, c, pc),
                          _next(thresholds, x, d, pd))
            e, f, g, h = (_next(thresholds, x, e, pe), _next(thresholds, x, f, pf), _next(thresholds, x, g, pg),
                          _next(thresholds, x, h, ph))
        for n in (a, b, c, d, e, f, g, h):
            for k in range(n_out):
                out[k] += leaf_value[leaf_row[n], k]
        t += 8
    while t < n_trees:
        n = _leaf_of(nodes, thresholds, x, roots[t])
        for k in range(n_out):
            out[k] += leaf_value[leaf_row[n], k]
        t += 1
    for k in range(n_out):
        out[k] /= float(n_trees)


@numba.njit(cache=True)
def _forest_rows(nodes, thresholds, leaf_row, leaf_value, roots, X, out):
    """Rows of ``X`` into ``out``: tree by tree (one tree's nodes stay in cache), eight rows in lockstep."""
    n_out = leaf_value.shape[1]
    n_rows = X.shape[0]
    out[:, :] = 0.0
    for t in range(roots.shape[0]):
        r = np.int64(roots[t])
        i = 0
        while i + 8 <= n_rows:
            xa, xb, xc, xd, xe, xf, xg, xh = X[i], X[i + 1], X[i + 2], X[i + 3], X[i + 4], X[i + 5], X[i + 6], X[i + 7]
            a = b = c = d = e = f = g = h = r
            while True:
                pa, pb, pc, pd = nodes[uint64(a), 0], nodes[uint64(b), 0], nodes[uint64(c), 0], nodes[uint64(d), 0]
                pe, pf, pg, ph = nodes[uint64(e), 0], nodes[uint64(f), 0], nodes[uint64(g), 0], nodes[uint64(h), 0]
                if pa & pb & pc & pd & pe & pf & pg & ph & LEAF_FLAG:
                    break
                a, b, c, d = (_next(thresholds, xa, a, pa), _next(thresholds, xb, b, pb),
                              _next(thresholds, xc, c, pc), _next(thresholds, xd, d, pd))
                e, f, g, h = (_next(thresholds, xe, e, pe), _next(thresholds, xf, f, pf),
                              _next(thresholds, xg, g, pg), _next(thresholds, xh, h, ph))
            for j, n in enumerate((a, b, c, d, e, f, g, h)):
                for k in range(n_out):
                    out[i + j, k] += leaf_value[leaf_row[n], k]
            i += 8
        while i < n_rows:
            n = _leaf_of(nodes, thresholds, X[i], r)
            for k in range(n_out):
                out[i, k] += leaf_value[leaf_row[n], k]
            i += 1
    n_trees = float(roots.shape[0])
    for i in range(n_rows):
        for k in range(n_out):
            out[i, k] /= n_trees


@numba.njit(cache=True, parallel=True)
def _forest_batch_parallel(nodes, thresholds, leaf_row, leaf_value, roots, X, out, block):
    for b in numba.prange(-(-X.shape[0] // block)):
        s = b * block
        e = min(X.shape[0], s + block)
        _forest_rows(nodes, thresholds, leaf_row, leaf_value, roots, X[s:e], out[s:e])


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
