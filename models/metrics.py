"""Accuracy measures (numpy only). SMAPE is the standard one, with the factor 2 (DESIGN.md)."""

from __future__ import annotations

import numpy as np


def smape(pred, real) -> float:
    """100 · mean(2|pred − real| / (|pred| + |real|)); pairs with both zero count as 0."""
    pred, real = np.asarray(pred, float), np.asarray(real, float)
    if pred.size == 0:
        return float("nan")
    den = np.abs(pred) + np.abs(real)
    return float(100.0 * np.mean(np.where(den > 0, 2.0 * np.abs(pred - real) / np.where(den > 0, den, 1.0), 0.0)))


def macro_f1(pred, real) -> float:
    """Mean over the classes present in ``real`` or ``pred`` of the per-class F1 (binary labels)."""
    pred, real = np.asarray(pred, bool), np.asarray(real, bool)
    scores = []
    for cls in (False, True):
        p, r = pred == cls, real == cls
        if not (p.any() or r.any()):
            continue
        tp = np.sum(p & r)
        scores.append(2.0 * tp / (p.sum() + r.sum()))
    return float(np.mean(scores)) if scores else float("nan")
