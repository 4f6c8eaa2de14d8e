"""SMAPE, the error measure every stage reports (DESIGN.md: with the factor 2)."""

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
