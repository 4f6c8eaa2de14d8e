"""Tomorrow's (or the next hour's) rate per adapter, from its past traffic in hourly windows.

A plan must hold at the busiest hour of the period it covers, not at the period's mean: an adapter
averaging 1 req/s over a day may see 2.5 at its daily peak. Each adapter's past traffic is cut into
windows of ``bin_s`` (an hour) and its rate in each is counted; the planned rate is then:

* ``quantile``: the ``q`` quantile (default 0.95) of its hourly rates over the last ``window_s``. With
  ``q`` = 1 it is the busiest hour seen. Needs no seasonality, and over a week of history covers the
  weekly peak too.
* ``seasonal``: the same hours one week earlier (``period_s``), scaled by the trend (this past day's
  traffic over the same day a week before), for the hours the plan covers: the next hour, or the 24 hours
  of the next day, whose busiest one is taken. A weekly cycle (a quiet weekend, a busy Monday) is then
  followed instead of planning every day for the busiest day of the week. Needs a week of history plus
  one day; with less, the period is one day.

Each adapter's own busiest hour is planned for, though adapters peak at different hours: a GPU's
adapters then never all exceed their planned rates at once, which leaves the plan on the safe side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from twin.errors import BadInputError

HOUR = 3600.0
DAY = 24 * HOUR
WEEK = 7 * DAY
METHODS = ("auto", "quantile", "seasonal")
HORIZONS = ("next-day", "next-hour")


@dataclass(frozen=True)
class Series:
    """Per adapter, its rate (req/s) in consecutive windows of ``bin_s`` starting at ``start``."""

    adapters: list[str]
    rates: np.ndarray  # (adapters, windows)
    start: float  # epoch seconds of the first window
    bin_s: float

    @property
    def end(self) -> float:
        return self.start + self.rates.shape[1] * self.bin_s


def hourly(t: np.ndarray, model: np.ndarray, bin_s: float = HOUR, end: float | None = None) -> Series:
    """Requests (times ``t``, adapters ``model``) counted per adapter in windows of ``bin_s`` aligned to the
    epoch, up to ``end`` (default: the last request's window)."""
    if t.size == 0:
        raise BadInputError("no request to count")
    start = np.floor(t.min() / bin_s) * bin_s
    stop = end if end is not None else (np.floor(t.max() / bin_s) + 1) * bin_s
    n_bins = max(1, round((stop - start) / bin_s))
    names, index = np.unique(model.astype(str), return_inverse=True)
    col = np.minimum(((t - start) // bin_s).astype(np.int64), n_bins - 1)
    counts = np.zeros((names.size, n_bins))
    np.add.at(counts, (index, col), 1.0)
    return Series(names.tolist(), counts / bin_s, float(start), float(bin_s))


def forecast(series: Series, horizon: str = "next-day", method: str = "auto", q: float = 0.95,
             window_s: float = WEEK) -> tuple[np.ndarray, str]:
    """Per adapter of ``series``, the rate to plan the ``horizon`` for, and the method used (``auto``:
    seasonal when the history spans a week and a day, else quantile)."""
    if horizon not in HORIZONS:
        raise BadInputError(f"unknown horizon '{horizon}'; choose one of {', '.join(HORIZONS)}")
    if method not in METHODS:
        raise BadInputError(f"unknown forecast method '{method}'; choose one of {', '.join(METHODS)}")
    if not 0 < q <= 1:
        raise BadInputError(f"--quantile must be in (0, 1]; got {q:g}")
    span = series.rates.shape[1] * series.bin_s
    if method == "auto":
        method = "seasonal" if span >= WEEK + DAY else "quantile"
    if method == "quantile":
        keep = max(1, round(min(window_s, span) / series.bin_s))
        return np.quantile(series.rates[:, -keep:], q, axis=1), "quantile"
    period = WEEK if span >= WEEK + DAY else DAY
    if span < period + DAY:
        raise BadInputError(f"the seasonal forecast needs {(period + DAY) / DAY:g} days of log; these span "
                            f"{span / DAY:.2f} (use --method quantile)")
    return _seasonal(series, horizon, period), "seasonal"


def _seasonal(series: Series, horizon: str, period: float) -> np.ndarray:
    per_period = round(period / series.bin_s)
    per_day = round(DAY / series.bin_s)
    rates = series.rates
    recent = rates[:, -per_day:].sum(axis=1)
    before = rates[:, -per_period - per_day:-per_period].sum(axis=1)
    trend = np.where(before > 0, recent / np.maximum(before, 1e-12), 1.0)
    ahead = 1 if horizon == "next-hour" else per_day
    # the windows one period before the ones planned for: [end - period, end - period + ahead)
    first = rates.shape[1] - per_period
    past = rates[:, first:first + ahead]
    return past.max(axis=1) * trend


def length_stats(model: np.ndarray, prompt: np.ndarray, completion: np.ndarray, adapters: list[str]) -> np.ndarray:
    """Per adapter (rows in ``adapters`` order): mean prompt tokens, mean output tokens and the coefficient of
    variation of each (NaN where no request of the adapter recorded them)."""
    index = {a: k for k, a in enumerate(adapters)}
    rows = np.array([index[m] for m in model.astype(str)], np.int64)
    out = np.full((len(adapters), 4), np.nan)
    for col, values in ((0, prompt), (1, completion)):
        known = np.isfinite(values)
        n = np.bincount(rows[known], minlength=len(adapters)).astype(float)
        total = np.bincount(rows[known], values[known], minlength=len(adapters))
        squares = np.bincount(rows[known], values[known] ** 2, minlength=len(adapters))
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = total / n
            sd = np.sqrt(np.maximum(squares / n - mean ** 2, 0.0))
            out[:, col] = mean
            out[:, col + 2] = np.where(mean > 0, sd / mean, np.nan)
    return out
