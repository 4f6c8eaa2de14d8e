"""Per-adapter traffic from a Prometheus server's HTTP API, for a router or gateway that counts it.

vLLM itself exports no per-adapter request or token counter: its ``vllm:lora_requests_info`` gauge only
lists which adapters are running or waiting at each scrape, from which no rate follows. A router or
gateway in front of the engines that counts requests and tokens per ``model`` (the adapter a client asked
for) does; three PromQL queries, each returning one series per adapter (``label``), give its request rate
(req/s) and its prompt and completion token rates (tokens/s). ``query_range`` samples them at ``step_s``
over the last ``range_s``; the request rates go to the forecast as hourly windows would, and the token
rates over the request rates give each adapter's mean lengths.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request

import numpy as np

from planner.forecast import Series
from planner.workload_csv import printable
from twin.errors import BadInputError

TIMEOUT_S = 60.0


def query_range(url: str, query: str, start: float, end: float, step_s: float) -> list[dict]:
    """The ``result`` of ``/api/v1/query_range`` (a matrix: series with their ``values``)."""
    params = urllib.parse.urlencode({"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                     "step": f"{step_s:g}"})
    target = f"{url.rstrip('/')}/api/v1/query_range?{params}"
    if not target.startswith(("http://", "https://")):
        raise BadInputError(f"the Prometheus URL must start with http:// or https:// (got {printable(url)[:60]!r})")
    try:
        with urllib.request.urlopen(target, timeout=TIMEOUT_S) as resp:
            body = json.loads(resp.read().decode("utf-8"))
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace")[:300]
        raise BadInputError(f"Prometheus at {url} refused the query {query!r}: HTTP {exc.code} {printable(detail)}") \
            from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise BadInputError(f"cannot reach Prometheus at {url} ({exc})") from None
    except (ValueError, RecursionError) as exc:
        raise BadInputError(f"Prometheus at {url} answered with something other than JSON ({exc})") from None
    if body.get("status") != "success" or body.get("data", {}).get("resultType") != "matrix":
        raise BadInputError(f"Prometheus at {url}: the query {query!r} gave no range vector "
                            f"({printable(str(body.get('error', body.get('data', {}).get('resultType'))))})")
    return body["data"]["result"]


def series_by(result: list[dict], label: str, start: float, step_s: float, n: int) -> dict[str, np.ndarray]:
    """Each series of ``result`` on the grid start + k * step (k < n), keyed by its ``label``; a missing or
    non-finite sample is 0 (no traffic counted then)."""
    out: dict[str, np.ndarray] = {}
    for series in result:
        name = series.get("metric", {}).get(label)
        if not name:
            continue
        values = out.setdefault(name, np.zeros(n))
        for ts, value in series.get("values", []):
            k = round((float(ts) - start) / step_s)
            v = float(value)
            if 0 <= k < n and math.isfinite(v):
                values[k] += v
    return out


def prometheus_traffic(url: str, label: str, requests_query: str, prompt_query: str | None,
                       completion_query: str | None, end: float, range_s: float,
                       step_s: float) -> tuple[Series, dict[str, tuple[float, float]]]:
    """Per adapter: its request rate at every step of the last ``range_s`` before ``end``, and its mean prompt
    and completion tokens over that range (NaN where a query is not given or counted nothing)."""
    n = round(range_s / step_s)
    if n < 1:
        raise BadInputError("--range must hold at least one --step")
    start = end - (n - 1) * step_s
    rates = series_by(query_range(url, requests_query, start, end, step_s), label, start, step_s, n)
    if not rates:
        raise BadInputError(f"Prometheus at {url}: {requests_query!r} gave no series with a {label!r} label")
    adapters = sorted(rates)
    tokens = {}
    for key, query in (("prompt", prompt_query), ("completion", completion_query)):
        tokens[key] = (series_by(query_range(url, query, start, end, step_s), label, start, step_s, n)
                       if query else {})
    lengths = {}
    for a in adapters:
        requests = float(rates[a].sum())
        lengths[a] = tuple(float(tokens[k][a].sum()) / requests if requests > 0 and a in tokens[k] else float("nan")
                           for k in ("prompt", "completion"))
    series = Series(adapters, np.array([rates[a] for a in adapters]), start - step_s / 2.0, step_s)
    return series, lengths
