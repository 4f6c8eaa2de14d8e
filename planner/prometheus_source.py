"""Per-adapter traffic from a Prometheus server's HTTP API, for a router or gateway that counts it.

vLLM itself exports no per-adapter request or token counter: its ``vllm:lora_requests_info`` gauge only
lists which adapters are running or waiting at each scrape, from which no rate follows. A router or
gateway in front of the engines that counts requests and tokens per ``model`` (the adapter a client asked
for) does; three PromQL queries, each returning one series per adapter (``label``), give its request rate
(req/s) and its prompt and completion token rates (tokens/s). ``query_range`` samples them at ``step_s``
over the last ``range_s``; the request rates go to the forecast as hourly windows would, and the token
rates over the request rates give each adapter's mean lengths.

A server's answer is bounded and checked before it is used: each query's answer must come whole within the
timeout and in at most :data:`MAX_RESPONSE_BYTES`, hold a matrix of series whose samples are finite rates
(pydantic models of the query API's JSON), and ask for at most :data:`MAX_POINTS` samples a series (the most
Prometheus itself answers) and :data:`planner.log_tally.MAX_CELLS` in all.
"""

from __future__ import annotations

import http.client
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, Field, ValidationError

from planner.forecast import Series
from planner.log_tally import MAX_CELLS
from twin.errors import BadInputError, printable

MAX_RESPONSE_BYTES = 128 << 20  # one query's answer: 10,000 adapters over 8 days of hours take about 60 MB
MAX_POINTS = 11_000  # samples a series: Prometheus refuses a query_range of more


Time = Annotated[float, Field(allow_inf_nan=False)]
Rate = Annotated[float, Field(ge=0, allow_inf_nan=False)]  # a sample's value: a JSON string such as "0.5"


class _Series(BaseModel):
    metric: dict[str, str]
    values: list[tuple[Time, Rate]]


class _Matrix(BaseModel):
    resultType: Literal["matrix"]
    result: list[_Series]


class _Answer(BaseModel):
    """The JSON of ``/api/v1/query_range``: a range vector (``matrix``) whose samples are [time, "rate"]."""

    status: Literal["success", "error"]
    error: str = ""
    data: _Matrix | None = None


def query_range(url: str, query: str, start: float, end: float, step_s: float, timeout_s: float) -> list[_Series]:
    """The series of ``/api/v1/query_range`` (a matrix: series with their ``values``)."""
    params = urllib.parse.urlencode({"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                     "step": f"{step_s:g}"})
    target = f"{url.rstrip('/')}/api/v1/query_range?{params}"
    if not target.startswith(("http://", "https://")):
        raise BadInputError(f"the Prometheus URL must start with http:// or https:// (got {printable(url)[:60]!r})")
    body = _get(target, url, query, timeout_s)
    try:
        answer = _Answer.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        problem = f"{'.'.join(str(p) for p in first['loc']) or 'the answer'}: {first['msg']}"
        raise BadInputError(f"Prometheus at {printable(url)}: the query {query!r} gave no range vector of rates "
                            f"({printable(problem)[:300]})") from None
    if answer.status != "success" or answer.data is None:
        raise BadInputError(f"Prometheus at {printable(url)}: the query {query!r} failed "
                            f"({printable(answer.error or 'no data')[:300]})")
    return answer.data.result


def _get(target: str, url: str, query: str, timeout_s: float) -> bytes:
    """The body of a GET of ``target``, whole within ``timeout_s`` (however slowly a server sends it: the read
    runs in a thread waited for that long) and of at most :data:`MAX_RESPONSE_BYTES`."""
    box: list = []

    def fetch() -> None:
        try:
            box.append(_read(target, url, query, timeout_s))
        except BaseException as exc:  # noqa: BLE001 -- raised in the caller's thread
            box.append(exc)

    worker = threading.Thread(target=fetch, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not box:
        raise BadInputError(f"Prometheus at {printable(url)} did not answer the query {query!r} within "
                            f"{timeout_s:g} s (--timeout)")
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _read(target: str, url: str, query: str, timeout_s: float) -> bytes:
    shown = printable(url)
    try:
        with urllib.request.urlopen(target, timeout=timeout_s) as resp:
            body = resp.read(MAX_RESPONSE_BYTES + 1)
    except urllib.error.HTTPError as exc:
        detail = exc.read(300).decode("utf-8", "replace")
        raise BadInputError(f"Prometheus at {shown} refused the query {query!r}: HTTP {exc.code} {printable(detail)}") \
            from None
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        raise BadInputError(f"cannot reach Prometheus at {shown} ({printable(str(exc))[:300]})") from None
    if len(body) > MAX_RESPONSE_BYTES:
        raise BadInputError(f"Prometheus at {shown}: the answer to {query!r} is over {MAX_RESPONSE_BYTES:,} bytes; "
                            "ask for fewer series or a longer --step")
    return body


def series_by(result: list[_Series], label: str, start: float, step_s: float, n: int) -> dict[str, np.ndarray]:
    """Each series of ``result`` on the grid start + k * step (k < n), keyed by its ``label``; a missing sample
    is 0 (no traffic counted then). At most MAX_CELLS samples in all are held."""
    out: dict[str, np.ndarray] = {}
    for series in result:
        name = series.metric.get(label)
        if not name:
            continue
        if name not in out and (len(out) + 1) * n > MAX_CELLS:
            raise BadInputError(f"{len(out) + 1:,} series of {n:,} samples are more than the {MAX_CELLS:,} read at "
                                "most: a longer --step or a shorter --range")
        values = out.setdefault(name, np.zeros(n))
        for ts, value in series.values:
            k = round((ts - start) / step_s)
            if 0 <= k < n:
                values[k] += value
    return out


def prometheus_traffic(url: str, label: str, requests_query: str, prompt_query: str | None,
                       completion_query: str | None, end: float, range_s: float, step_s: float,
                       timeout_s: float) -> tuple[Series, dict[str, tuple[float, float]]]:
    """Per adapter: its request rate at every step of the last ``range_s`` before ``end``, and its mean prompt
    and completion tokens over that range (NaN where a query is not given or counted nothing); each query
    answered within ``timeout_s``."""
    n = round(range_s / step_s)
    if n < 1:
        raise BadInputError("--range must hold at least one --step")
    if n > MAX_POINTS:
        raise BadInputError(f"--range over --step is {n:,} samples a series; Prometheus answers at most "
                            f"{MAX_POINTS:,}: give a longer --step or a shorter --range")
    start = end - (n - 1) * step_s

    def rates_of(query: str) -> dict[str, np.ndarray]:
        return series_by(query_range(url, query, start, end, step_s, timeout_s), label, start, step_s, n)

    rates = rates_of(requests_query)
    if not rates:
        raise BadInputError(f"Prometheus at {printable(url)}: {requests_query!r} gave no series with a {label!r} "
                            "label")
    adapters = sorted(rates)
    tokens = {key: rates_of(query) if query else {}
              for key, query in (("prompt", prompt_query), ("completion", completion_query))}
    lengths = {}
    for a in adapters:
        requests = float(rates[a].sum())
        lengths[a] = tuple(float(tokens[k][a].sum()) / requests if requests > 0 and a in tokens[k] else float("nan")
                           for k in ("prompt", "completion"))
    series = Series(adapters, np.array([rates[a] for a in adapters]), start - step_s / 2.0, step_s)
    return series, lengths
