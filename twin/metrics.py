"""SMAPE, the error measure every stage reports (DESIGN.md: with the factor 2), and the twin's tail percentiles."""

from __future__ import annotations

from collections import Counter

import numpy as np


def smape(pred, real) -> float:
    """100 · mean(2|pred − real| / (|pred| + |real|)) over pairs where both are finite; a pair of
    zeros counts as no error; NaN when no pair is left."""
    pred, real = np.asarray(pred, float), np.asarray(real, float)
    ok = np.isfinite(pred) & np.isfinite(real)
    pred, real = pred[ok], real[ok]
    if pred.size == 0:
        return float("nan")
    den = np.abs(pred) + np.abs(real)
    return float(100.0 * np.mean(np.where(den > 0, 2.0 * np.abs(pred - real) / np.where(den > 0, den, 1.0), 0.0)))


def geomean(values, axis=None):
    """Geometric mean (of positive values): the mean of ratios such as speeds or repeated runs' ITLs."""
    return np.exp(np.mean(np.log(np.asarray(values, float)), axis=axis))


def _scored(pred: np.ndarray, real: np.ndarray) -> np.ndarray:
    """Pairs a ratio can be taken of: both finite and positive."""
    return np.isfinite(pred) & np.isfinite(real) & (pred > 0) & (real > 0)


def group_log_ratios(pred, real, groups) -> dict:
    """Per group label: the mean log(pred / real) over its pairs where both are finite and positive."""
    pred, real, groups = np.asarray(pred, float), np.asarray(real, float), np.asarray(groups, object)
    ok = _scored(pred, real)
    log_ratio = np.log(pred[ok] / real[ok])
    return {g: float(np.mean(log_ratio[groups[ok] == g])) for g in dict.fromkeys(groups[ok])}


def smape_within_groups(pred, real, groups) -> float:
    """SMAPE once each group's mean log ratio (:func:`group_log_ratios`) is divided out of ``pred``:
    what is left when every group (e.g. one engine, running at its own speed) is allowed one scale.
    Only groups of two or more scored pairs count (one pair divided by its own ratio says nothing);
    NaN when there are none."""
    pred, real, groups = np.asarray(pred, float), np.asarray(real, float), np.asarray(groups, object)
    ok = _scored(pred, real)
    counts = Counter(groups[ok])
    keep = ok & np.array([counts[g] >= 2 for g in groups], bool)
    ratios = group_log_ratios(pred, real, groups)
    scale = np.array([np.exp(ratios[g]) for g in groups[keep]])
    return smape(pred[keep] / scale, real[keep])


#: Below this many values, or for a percentile under TOP_PERCENTILE, :func:`percentiles` is NumPy's own.
FAST_PERCENTILE_MIN_N, TOP_PERCENTILE = 4096, 90.0


def percentiles(x: np.ndarray, q) -> np.ndarray:
    """``np.percentile(x, q)`` (linear interpolation) of finite values, the same figures, faster for tail
    percentiles of long arrays: the two order statistics each needs are among the top few values, which one
    threshold (from every 16th value) picks out, so only those are sorted rather than all of ``x``
    partitioned. A twin run takes three of these per simulated GPU."""
    q = np.asarray(q, np.float64)
    n = x.shape[0]
    if n < FAST_PERCENTILE_MIN_N or q.min() < TOP_PERCENTILE:
        return np.percentile(x, q)
    index = (n - 1) * (q / 100.0)  # NumPy's virtual index of the linear method
    below = np.floor(index).astype(np.intp)
    top_n = n - int(below.min())  # the values whose ranks are needed: the top_n largest
    sample = x[::16]
    k = max(0, sample.shape[0] - 2 * (top_n // 16) - 16)  # a threshold with about twice top_n values above it
    top = x[x >= np.partition(sample, k)[k]]
    if top.shape[0] < top_n:  # too few above it (values in a strange order): take NumPy's way
        return np.percentile(x, q)
    top.sort()
    lo, hi = top[below - n + top.shape[0]], top[below + 1 - n + top.shape[0]]
    gamma = index - below
    diff = hi - lo  # NumPy's _lerp: from the nearer end
    return np.where(gamma >= 0.5, hi - diff * (1 - gamma), lo + diff * gamma)
