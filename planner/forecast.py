"""Tomorrow's (or the next hour's) rate per adapter, from its past traffic in hourly windows.

A plan must hold at the busiest hour of the period it covers, not at the period's mean: an adapter
averaging 1 req/s over a day may see 2.5 at its daily peak. Each adapter's past traffic is cut into
windows of ``bin_s`` (an hour), and its rate in each is its requests over the part of the window the logs
cover (:func:`observed_rates`); the planned rate is then:

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
MIN_COVER = 0.25  # of a window: less, at an edge of the logs, and it is merged into its neighbour
MIN_SPAN_S = 60.0  # the least log a rate is measured from
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


def observed_rates(counts: np.ndarray, start: float, first: float, last: float, adapters: list[str],
                   bin_s: float = HOUR) -> Series:
    """Per adapter, its rate in each window of ``bin_s`` from ``start`` (``counts``: its requests in each):
    the requests over the seconds of the window the logs cover, from the ``first`` request's time to the
    ``last`` one's (any adapter's, across every log). A 30-minute log at 1 req/s is 1 req/s, not 0.5.

    An edge window the logs cover for less than :data:`MIN_COVER` of it is merged into its neighbour, so that
    no rate rests on a few minutes at the edge of an hour; logs covering less than :data:`MIN_SPAN_S` in all
    are refused: a rate from a few seconds of log would be noise."""
    span = last - first
    if span < MIN_SPAN_S:
        raise BadInputError(f"the logs cover {span:.3g} s (from the first request to the last); a rate needs at "
                            f"least {MIN_SPAN_S:g} s of log")
    n = counts.shape[1]
    covered = np.full(n, bin_s)
    covered[0] -= first - start
    covered[-1] -= start + n * bin_s - last
    if n == 1:
        covered[0] = span
    counts = counts.astype(float)
    if n > 1 and covered[0] < MIN_COVER * bin_s:
        counts[:, 1] += counts[:, 0]
        covered[1] += covered[0]
        counts, covered, start, n = counts[:, 1:], covered[1:], start + bin_s, n - 1
    if n > 1 and covered[-1] < MIN_COVER * bin_s:
        counts[:, -2] += counts[:, -1]
        covered[-2] += covered[-1]
        counts, covered = counts[:, :-1], covered[:-1]
    return Series(adapters, counts / covered, float(start), float(bin_s))


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
                            f"{span / DAY:.2f} days (use --method quantile)")
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


def length_stats(sums: np.ndarray) -> np.ndarray:
    """Per adapter, from the count, sum and sum of squares of its known prompt tokens and of its completion
    tokens (``sums``, six columns): mean prompt tokens, mean output tokens and the coefficient of variation
    of each (NaN where no request of the adapter recorded them)."""
    out = np.full((sums.shape[0], 4), np.nan)
    for col in (0, 1):
        n, total, squares = sums[:, 3 * col], sums[:, 3 * col + 1], sums[:, 3 * col + 2]
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = total / n
            sd = np.sqrt(np.maximum(squares / n - mean ** 2, 0.0))
            out[:, col] = mean
            out[:, col + 2] = np.where(mean > 0, sd / mean, np.nan)
    return out
