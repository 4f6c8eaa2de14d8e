"""Scrape a vLLM server's Prometheus ``/metrics`` every ~1–2 s and keep the time series.

:func:`parse_prometheus` reads the Prometheus text exposition format. :class:`Scraper` polls a server in the
background (asyncio) and keeps one row per scrape of the series in :data:`SERIES`; the labels of
``vllm:cache_config_info`` (block size, ``num_gpu_blocks``, ``kv_cache_size_tokens`` — T_max
straight from the engine) are kept once.
"""

from __future__ import annotations

import asyncio
import math
import os
from dataclasses import dataclass, field
from typing import Self

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from twin.atomic import write_bytes_atomic

#: column name → (metric name, label filter) summed over matching samples. Counters carry _total.
SERIES = {
    "running": ("vllm:num_requests_running", {}),
    "waiting": ("vllm:num_requests_waiting", {}),
    "waiting_capacity": ("vllm:num_requests_waiting_by_reason", {"reason": "capacity"}),
    "waiting_deferred": ("vllm:num_requests_waiting_by_reason", {"reason": "deferred"}),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", {}),
    "preemptions": ("vllm:num_preemptions_total", {}),
    "prompt_tokens": ("vllm:prompt_tokens_total", {}),
    "generation_tokens": ("vllm:generation_tokens_total", {}),
    "requests_succeeded": ("vllm:request_success_total", {}),
    # Finished requests, timed by the engine core (not the client): decode time = last minus first token.
    "finished_decode_time_s": ("vllm:request_decode_time_seconds_sum", {}),
    "finished_generation_tokens": ("vllm:request_generation_tokens_sum", {}),
    "finished_requests": ("vllm:request_generation_tokens_count", {}),
}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_prometheus(text: str) -> list[Sample]:
    """All samples of a Prometheus text-format page (``prometheus_client``'s parser); ValueError if malformed."""
    try:
        return [Sample(s.name, dict(s.labels), float(s.value))
                for family in text_string_to_metric_families(text) for s in family.samples]
    except ValueError as exc:
        raise ValueError(f"not a Prometheus text page: {exc or 'malformed line'}") from None


def series_values(samples: list[Sample]) -> dict[str, float]:
    """One value per :data:`SERIES` column (sum over matching samples; NaN when absent)."""
    out = {}
    for column, (name, want) in SERIES.items():
        vals = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in want.items())]
        out[column] = float(sum(vals)) if vals else math.nan
    return out


def cache_config(samples: list[Sample]) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` ({} if the server does not export it)."""
    for s in samples:
        if s.name == "vllm:cache_config_info":
            return dict(s.labels)
    return {}


@dataclass
class MetricsSeries:
    """Scrapes over time: ``t_s`` (seconds from the run's start) and one array per SERIES column."""

    t_s: list[float] = field(default_factory=list)
    values: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in SERIES})
    cache_config: dict[str, str] = field(default_factory=dict)
    errors: int = 0

    def add(self, t_s: float, samples: list[Sample]) -> None:
        self.t_s.append(t_s)
        for column, value in series_values(samples).items():
            self.values[column].append(value)
        if not self.cache_config:
            self.cache_config = cache_config(samples)

    def column(self, name: str) -> np.ndarray:
        return np.array(self.t_s if name == "t_s" else self.values[name], np.float64)

    def to_parquet(self, path: str | os.PathLike) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({"t_s": self.column("t_s"), **{c: self.column(c) for c in SERIES}})
        table = table.replace_schema_metadata({f"cache_config.{k}": v for k, v in self.cache_config.items()})
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        write_bytes_atomic(path, sink.getvalue().to_pybytes())

    @classmethod
    def from_parquet(cls, path: str | os.PathLike) -> Self:
        """A saved series; columns it was scraped without (an older SERIES) read as NaN."""
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        t_s = table.column("t_s").to_pylist()
        values = {c: table.column(c).to_pylist() if c in table.column_names else [math.nan] * len(t_s)
                  for c in SERIES}
        meta = table.schema.metadata or {}
        config = {k.decode()[len("cache_config."):]: v.decode() for k, v in meta.items()
                  if k.startswith(b"cache_config.")}
        return cls(t_s=t_s, values=values, cache_config=config)

    def engine_itl_ms(self, start_s: float, end_s: float) -> float:
        """Mean inter-token latency (ms, per token) of the requests that finished between the first scrape
        at or after ``start_s`` and the last at or before ``end_s``, timed by the engine core: free of the
        delays of the API server and the client that the per-request records carry. NaN where nothing
        finished or the series lacks the columns."""
        t = self.column("t_s")
        inside = np.flatnonzero((t >= start_s) & (t <= end_s))
        if inside.size < 2:
            return math.nan
        a, b = inside[0], inside[-1]
        decode_s, tokens, requests = (self.values[c][b] - self.values[c][a]
                                      for c in ("finished_decode_time_s", "finished_generation_tokens",
                                                "finished_requests"))
        gaps = tokens - requests
        return float(decode_s / gaps * 1000.0) if gaps > 0 else math.nan


async def fetch_samples(session, base_url: str) -> list[Sample]:
    async with session.get(f"{base_url.rstrip('/')}/metrics") as resp:
        resp.raise_for_status()
        return parse_prometheus(await resp.text())


class Scraper:
    """Poll ``base_url``/metrics every ``interval_s`` while the ``async with`` block runs.

    Times are seconds from ``origin`` (an event-loop time; default: when scraping starts).
    """

    def __init__(self, base_url: str, interval_s: float = 1.0, origin: float | None = None):
        self.base_url, self.interval_s, self.origin = base_url, interval_s, origin
        self.series = MetricsSeries()
        self._task: asyncio.Task | None = None

    async def _loop(self) -> None:
        import aiohttp

        loop = asyncio.get_running_loop()
        if self.origin is None:
            self.origin = loop.time()
        t0 = self.origin
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while True:
                started = loop.time()
                try:
                    self.series.add(started - t0, await fetch_samples(session, self.base_url))
                except (TimeoutError, aiohttp.ClientError, ValueError):
                    self.series.errors += 1
                await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            await self._final_sample()

    async def _final_sample(self) -> None:
        """One last sample after the load: the server's counters lag the last responses a little."""
        import aiohttp

        loop = asyncio.get_running_loop()
        await asyncio.sleep(min(1.0, self.interval_s))
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
                self.series.add(loop.time() - (self.origin or 0.0), await fetch_samples(session, self.base_url))
        except (TimeoutError, aiohttp.ClientError, ValueError):
            self.series.errors += 1


def wait_idle(base_url: str, timeout_s: float = 60.0) -> None:
    """Return once the engine at ``base_url`` has no running or waiting request (or after ``timeout_s``)."""
    import aiohttp

    async def idle():
        async with aiohttp.ClientSession() as session:
            loop = asyncio.get_running_loop()
            end = loop.time() + timeout_s
            while loop.time() < end:
                v = series_values(await fetch_samples(session, base_url))
                if v["running"] == 0 and v["waiting"] == 0:
                    return
                await asyncio.sleep(0.5)

    asyncio.run(idle())
