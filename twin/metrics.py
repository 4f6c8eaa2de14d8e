"""SMAPE, the error measure every stage reports (DESIGN.md: with the factor 2), and the twin's percentiles."""

from __future__ import annotations

import math
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


#: Below this many values :func:`percentiles` is NumPy's own.
FAST_PERCENTILE_MIN_N = 4096
#: One value in this many is sampled to bracket the order statistics a percentile needs.
SAMPLE_STRIDE = 16


def percentiles(x: np.ndarray, q) -> np.ndarray:
    """``np.percentile(x, q)`` (linear interpolation) of finite values, the same figures, faster for long arrays:
    the two order statistics each percentile needs lie between two thresholds read off every 16th value, so
    only the values between them are sorted rather than all of ``x`` partitioned (a twin run takes four of
    these per simulated GPU; for a p99, only the top few values are sorted)."""
    q = np.asarray(q, np.float64)
    n = x.shape[0]
    if n < FAST_PERCENTILE_MIN_N:
        return np.percentile(x, q)
    index = (n - 1) * (q / 100.0)  # NumPy's virtual index of the linear method
    below = np.floor(index).astype(np.intp)
    above = np.minimum(below + 1, n - 1)
    first, last = int(below.min()), int(above.max())
    sample = x[::SAMPLE_STRIDE]
    m = sample.shape[0]
    # sample ranks around the needed ones, with a margin of many standard deviations of a sample rank
    margin = 4.0 * math.sqrt(m) + 16
    k_lo, k_hi = math.floor(first * m / n - margin), math.ceil(last * m / n + margin)
    if k_hi >= m:  # a tail percentile: every value from a threshold up
        lo_t = np.partition(sample, max(k_lo, 0))[max(k_lo, 0)]
        mid = x[x >= lo_t]
        n_under = n - mid.shape[0]
    else:
        part = np.partition(sample, [max(k_lo, 0), k_hi])
        lo_t, hi_t = part[max(k_lo, 0)], part[k_hi]
        mid = x[(x >= lo_t) & (x <= hi_t)]
        n_under = int(np.count_nonzero(x < lo_t))
    if not (n_under <= first and last < n_under + mid.shape[0]):  # thresholds missed (a strange order of
        return np.percentile(x, q)  # values): NumPy's way
    mid.sort()
    lo, hi = mid[below - n_under], mid[above - n_under]
    gamma = index - below
    diff = hi - lo  # NumPy's _lerp: from the nearer end
    return np.where(gamma >= 0.5, hi - diff * (1 - gamma), lo + diff * gamma)
