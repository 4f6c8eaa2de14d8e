"""Accuracy measures (numpy only): macro-F1 here, SMAPE shared with the rest of the project (twin.metrics)."""

from __future__ import annotations

import numpy as np

from twin.metrics import smape

__all__ = ["macro_f1", "smape"]


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
