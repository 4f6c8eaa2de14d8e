"""``planner workload from-log`` and ``from-prometheus``: tomorrow's workload.csv from the traffic a fleet saw."""

from __future__ import annotations

import math
import time

import click

from planner.cli_common import FiniteFloat, user_errors

EPILOG_LOG = """\b
Examples:
  planner workload from-log gateway-*.jsonl.gz --ranks adapters.csv --out next-day.csv
  planner workload from-log spend-logs.json --format litellm --ranks adapters.csv --for next-hour --out w.csv
  planner workload from-log gw.jsonl --default-rank 16 --base-model meta-llama/Llama-3.1-8B-Instruct --out w.csv
  planner workload from-log requests.parquet --default-rank 16 --base-model none --quantile 1 --out w.csv
\b
A log line is one request: its time, the model (adapter) asked for, prompt and completion tokens.
Logs may be gzip, unsorted, and several (of one fleet); they are counted per adapter and hour as they are
read (a progress bar on a terminal), in bounded memory. An hour the logs cover in part is rated over the
part covered; an edge hour covered under 15 minutes joins its neighbour; under 60 s of log is refused.
Ranks are not in logs: --ranks names a CSV with adapter_id,rank[,path] (a previous workload.csv will do);
--default-rank needs --base-model (NAME, or none), lest the base model be planned as an adapter. A model
without a rank stops the read at its first line.
"""

EPILOG_PROM = """\b
Example (a router exporting per-adapter counters labelled `model`):
  planner workload from-prometheus http://prometheus:9090 --label model \\
      --requests-query 'sum by (model) (rate(router_requests_total[1h]))' \\
      --prompt-tokens-query 'sum by (model) (rate(router_prompt_tokens_total[1h]))' \\
      --completion-tokens-query 'sum by (model) (rate(router_completion_tokens_total[1h]))' \\
      --ranks adapters.csv --out next-day.csv
vLLM itself counts no requests or tokens per adapter (vllm:lora_requests_info only lists the adapters
running and waiting at each scrape), so the counters come from the router or gateway in front of it.
"""

COLUMNS = ("adapter_id", "rank", "rate_rps", "input_tokens", "output_tokens", "path", "input_tokens_cv",
           "output_tokens_cv", "requests_observed", "mean_rps_observed", "peak_rps_observed", "rate_method")


@click.group()
def workload() -> None:
    """Tomorrow's workload.csv from observed traffic: request logs or Prometheus counters."""


def forecast_options(fn):
    fn = click.option("--base-model", default=None,
                      help="The base model's name as the traffic names it: its requests are left out; `none`: "
                           "the traffic names adapters only. Needed with --default-rank.")(fn)
    fn = click.option("--default-rank", type=click.IntRange(1, 1024), default=None,
                      help="Rank of adapters --ranks does not name (needs --base-model) [none: they are an "
                           "error].")(fn)
    fn = click.option("--ranks", "ranks_file", type=click.Path(dir_okay=False), default=None,
                      help="CSV with adapter_id,rank[,path] (a workload.csv will do): each adapter's rank.")(fn)
    fn = click.option("--window", default="7d", show_default=True,
                      help="History the quantile method looks at, e.g. 7d, 36h.")(fn)
    fn = click.option("--quantile", "q", type=FiniteFloat(0, 1, min_open=True), default=0.95, show_default=True,
                      help="The quantile method's quantile of hourly rates (1: the busiest hour).")(fn)
    fn = click.option("--method", type=click.Choice(["auto", "quantile", "seasonal"]), default="auto",
                      show_default=True, help="auto: seasonal (the same hours a week before, times the trend) "
                                              "when the history spans 8 days, else the quantile of hourly rates; "
                                              "seasonal on 2 to 8 days: the same hours a day before.")(fn)
    fn = click.option("--for", "horizon", type=click.Choice(["next-day", "next-hour"]), default="next-day",
                      show_default=True, help="The period the plan must hold for: its busiest hour is planned.")(fn)
    return click.option("--out", type=click.Path(dir_okay=False), required=True, help="The workload.csv to write.")(fn)


def _duration(text: str) -> float:
    from twin import BadInputError

    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        value = float(text[:-1]) * units[text[-1]]
    except (KeyError, ValueError, IndexError):
        raise BadInputError(f"{text!r} is not a duration such as 90m, 36h or 7d") from None
    if not 0 < value < math.inf:
        raise BadInputError(f"{text!r} is not a positive finite duration")
    return value


def _write(out, series, rates, method, lengths, ranks, observed) -> int:
    """Write the workload; returns the adapters written."""
    import numpy as np

    from planner.workload_csv import write_workload
    from twin import BadInputError

    for a in series.adapters:
        problem = ranks.problem(a)
        if problem:
            raise BadInputError(problem)
    rows = []
    for k, a in enumerate(series.adapters):
        rank, path = ranks.rank_of(a)
        mean_in, mean_out, cv_in, cv_out = lengths[k]
        rows.append({"adapter_id": a, "rank": rank, "rate_rps": float(rates[k]),
                     "input_tokens": None if not np.isfinite(mean_in) or mean_in < 1 else float(mean_in),
                     "output_tokens": None if not np.isfinite(mean_out) or mean_out < 1 else float(mean_out),
                     "path": path, "input_tokens_cv": None if not np.isfinite(cv_in) else float(cv_in),
                     "output_tokens_cv": None if not np.isfinite(cv_out) else float(cv_out),
                     "requests_observed": float(observed[k]),
                     "mean_rps_observed": float(series.rates[k].mean()),
                     "peak_rps_observed": float(series.rates[k].max()), "rate_method": method})
    write_workload(out, rows, COLUMNS)
    return len(rows)


def _checked_options(out, window, ranks_file, default_rank, base_model):
    """The options a read needs, checked before any is made: (--window in seconds, the ranks)."""
    from planner.log_ranks import Ranks
    from twin.atomic import check_writable

    check_writable(out, "--out")
    return _duration(window), Ranks.from_options(ranks_file, default_rank, base_model)


@workload.command("from-log", epilog=EPILOG_LOG)
@click.argument("logs", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["auto", "jsonl", "csv", "litellm", "loadgen"]), default="auto",
              show_default=True, help="Log format (auto: by file name, a .gz aside: .parquet loadgen, .csv csv, "
                                      "else jsonl; a JSON array of records is read too).")
@click.option("--start", "start_s", type=FiniteFloat(), default=0.0, show_default=True,
              help="--format loadgen: epoch seconds of the run's time 0.")
@forecast_options
@user_errors
def from_log(logs, fmt, start_s, out, horizon, method, q, window, ranks_file, default_rank, base_model) -> None:
    """Read request LOGS and write the workload a plan for the next day (or hour) needs: per adapter the
    rate of its busiest hour to come, its mean lengths and their spread, and what was observed."""
    from planner.forecast import forecast, length_stats
    from planner.traffic import read_logs

    window_s, ranks = _checked_options(out, window, ranks_file, default_rank, base_model)
    traffic = read_logs(logs, fmt, ranks, start_s)
    series = traffic.series()
    rates, used = forecast(series, horizon, method, q, window_s)
    n = _write(out, series, rates, used, length_stats(traffic.sums), ranks, traffic.counts.sum(axis=1))
    click.echo(f"{n} adapters from {traffic.requests:,} requests over {(traffic.last - traffic.first) / 3600:.1f} h; "
               f"rates for the {horizon} by the {used} method ({float(rates.sum()):,.2f} req/s in all); "
               f"written to {out}")


@workload.command("from-prometheus", epilog=EPILOG_PROM)
@click.argument("url")
@click.option("--requests-query", required=True, help="PromQL: per-adapter request rate (req/s).")
@click.option("--prompt-tokens-query", default=None, help="PromQL: per-adapter prompt token rate (tokens/s).")
@click.option("--completion-tokens-query", default=None, help="PromQL: per-adapter completion token rate (tokens/s).")
@click.option("--label", default="model", show_default=True, help="The label naming the adapter in every series.")
@click.option("--range", "range_text", default="8d", show_default=True, help="History read, e.g. 8d or 36h.")
@click.option("--step", "step_text", default="1h", show_default=True, help="Sample spacing (the forecast's window).")
@click.option("--end", "end_s", type=FiniteFloat(min=0), default=None, help="Epoch seconds the history ends at [now].")
@click.option("--timeout", "timeout_s", type=FiniteFloat(min=0, min_open=True), default=60.0, show_default=True,
              help="Seconds each query's whole answer may take.")
@forecast_options
@user_errors
def from_prometheus(url, requests_query, prompt_tokens_query, completion_tokens_query, label, range_text, step_text,
                    end_s, timeout_s, out, horizon, method, q, window, ranks_file, default_rank, base_model) -> None:
    """Read per-adapter request and token rates from the Prometheus server at URL (its HTTP API) and write the
    workload a plan for the next day (or hour) needs, as `from-log` does from logs."""
    import numpy as np

    from planner.forecast import Series, forecast
    from planner.prometheus_source import prometheus_traffic
    from twin import BadInputError

    window_s, ranks = _checked_options(out, window, ranks_file, default_rank, base_model)
    step, range_s = _duration(step_text), _duration(range_text)
    series, means = prometheus_traffic(url, label, requests_query, prompt_tokens_query, completion_tokens_query,
                                       end_s if end_s is not None else time.time(), range_s, step, timeout_s)
    kept = [k for k, a in enumerate(series.adapters) if not ranks.excluded(a)]
    if not kept:
        raise BadInputError(f"Prometheus at {url}: {requests_query!r} gave series of the base model only")
    series = Series([series.adapters[k] for k in kept], series.rates[kept], series.start, series.bin_s)
    rates, used = forecast(series, horizon, method, q, window_s)
    lengths = np.array([[*means[a], np.nan, np.nan] for a in series.adapters])
    observed = series.rates.sum(axis=1) * step
    n = _write(out, series, rates, used, lengths, ranks, observed)
    click.echo(f"{n} adapters from {url}; rates for the {horizon} by the {used} method "
               f"({float(rates.sum()):,.2f} req/s in all); written to {out}")
