"""Synthetic request traffic with a known daily and weekly shape, for the forecast and the log readers.

Adapter ``k`` asks ``base[k] * daily(t) * weekly(t)`` req/s: a daily cycle peaking mid-afternoon
(x0.4 at night, x1.6 at the peak) and quieter weekends (x0.6 on days 5 and 6 of each week).
"""

from __future__ import annotations

import numpy as np

HOUR, DAY = 3600.0, 86400.0
EPOCH = 1_760_000_400.0  # a fixed origin (09:00 UTC): day 0 of the weekly cycle starts here


def shape(t: np.ndarray) -> np.ndarray:
    """The traffic multiplier at epoch seconds ``t``."""
    hour = (t % DAY) / HOUR
    daily = 1.0 + 0.6 * np.sin(2 * np.pi * (hour - 9.0) / 24.0)
    day = np.floor((t - EPOCH) / DAY) % 7
    return daily * np.where(day >= 5, 0.6, 1.0)


def hourly_counts(base: np.ndarray, days: float, seed: int) -> tuple[np.ndarray, float]:
    """Poisson request counts per adapter and hour over ``days`` from EPOCH, and the start time."""
    rng = np.random.default_rng(seed)
    centres = EPOCH + (np.arange(int(days * 24)) + 0.5) * HOUR
    return rng.poisson(np.outer(base, shape(centres)) * HOUR).astype(float), EPOCH


def true_peak(base: np.ndarray, start: float, hours: int) -> np.ndarray:
    """Per adapter, its busiest rate over ``hours`` hours from ``start`` (on a fine grid)."""
    t = start + np.arange(hours * 60) * 60.0
    return base * shape(t).max()


def requests(base: np.ndarray, days: float, seed: int, names: list[str], prompt=(300.0, 0.5), completion=(150.0, 0.8)):
    """Every request: (epoch seconds, adapter, prompt tokens, completion tokens), log-normal lengths with
    these (mean, CV)."""
    rng = np.random.default_rng(seed)
    counts, start = hourly_counts(base, days, seed)
    rows = []
    for k, name in enumerate(names):
        for h, n in enumerate(counts[k].astype(int)):
            times = start + h * HOUR + np.sort(rng.uniform(0.0, HOUR, n))
            p = _lognormal(rng, *prompt, n)
            c = _lognormal(rng, *completion, n)
            rows += [(float(t), name, int(a), int(b)) for t, a, b in zip(times, p, c)]
    rows.sort()
    return rows


def _lognormal(rng, mean, cv, n):
    s2 = np.log1p(cv * cv)
    return np.maximum(1, np.rint(rng.lognormal(np.log(mean) - s2 / 2, np.sqrt(s2), n)))
