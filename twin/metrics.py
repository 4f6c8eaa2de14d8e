"""SMAPE, the error measure every stage reports (DESIGN.md: with the factor 2)."""

from __future__ import annotations

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
