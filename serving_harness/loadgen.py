"""Drive a vLLM OpenAI server with per-adapter arrivals and record one row per request.

Requests come from the twin's workload model (:func:`twin.workload.draw_requests` with Poisson or
unpredictable arrivals, or :func:`twin.workload.trace_requests`), so a real run and a twin run can
get exactly the same requests. Each request is a streaming ``/v1/completions`` call whose prompt is
a list of token ids of the exact input length and whose output length is forced (``max_tokens`` =
``min_tokens`` = output length, ``ignore_eos``). Arrivals over [0, window); at the window's end
every unfinished request is cancelled and recorded as such (the study's client convention).
``max_in_flight`` bounds the requests in flight: an arrival beyond it is not sent and is recorded
with error ``client_cap`` (the twin's ``max_in_flight`` does the same).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO

import aiohttp
import numpy as np

from twin.atomic import write_bytes_atomic
from twin.metrics import percentiles
from twin.simulate import STARVATION_THRESHOLD, request_outcomes
from twin.states import FINISHED, WAITING
from twin.workload import Requests

#: Columns of the per-request table; times are seconds from the run's start (arrival 0).
COLUMNS = ("request", "adapter", "arrival_s", "sent_s", "first_token_s", "finish_s", "input_tokens",
           "output_tokens", "output_tokens_received", "error")
FIRST_TOKEN_ID = 3  # ids below are the synthetic tokenizer's special tokens


@dataclass
class RunRecords:
    """One row per request (numpy columns); NaN times for what did not happen."""

    request: np.ndarray
    adapter: np.ndarray  # object array of adapter (OpenAI model) names
    arrival_s: np.ndarray
    sent_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    output_tokens_received: np.ndarray
    error: np.ndarray  # object array; "" when the request finished normally

    def __len__(self) -> int:
        return int(self.request.shape[0])

    @property
    def engine_arrival_s(self) -> np.ndarray:
        """When each request reached the engine: its send time, or its drawn time where it was never sent.
        A load generator short of CPU sends late; the engine (and the twin's replay of a run) only sees
        what was sent, so latencies count from here."""
        return np.where(np.isfinite(self.sent_s), self.sent_s, self.arrival_s)

    def to_parquet(self, path: str | os.PathLike) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({c: pa.array(getattr(self, c).tolist() if c in ("adapter", "error") else getattr(self, c))
                          for c in COLUMNS})
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        write_bytes_atomic(path, sink.getvalue().to_pybytes())

    @classmethod
    def from_parquet(cls, path: str | os.PathLike | BinaryIO) -> RunRecords:
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        return cls(**{c: np.array(table.column(c).to_pylist(), dtype=object) if c in ("adapter", "error")
                      else table.column(c).to_numpy() for c in COLUMNS})


def prompt_ids(n_tokens: int, vocab_size: int, rng: np.random.Generator) -> list[int]:
    """A prompt of exactly ``n_tokens`` ordinary token ids."""
    return rng.integers(FIRST_TOKEN_ID, vocab_size, n_tokens).tolist()


def completion_body(model: str, prompt: list[int], output_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": output_tokens, "min_tokens": output_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}


async def _send(session: aiohttp.ClientSession, url: str, body: dict, t0: float, row: int, out: dict) -> None:
    """One streaming completion; fills first_token/finish/received/error of ``row`` in ``out``."""
    loop = asyncio.get_running_loop()
    out["sent_s"][row] = loop.time() - t0
    received = 0
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200].replace("\n", " ")
                out["error"][row] = f"http_{resp.status}: {text}"
                return
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    break
                chunk = json.loads(payload)
                if chunk.get("choices"):
                    if np.isnan(out["first_token_s"][row]):
                        out["first_token_s"][row] = loop.time() - t0
                    out["finish_s"][row] = loop.time() - t0
                    received += 1
                usage = chunk.get("usage")
                if usage:
                    received = int(usage.get("completion_tokens", received))
        out["output_tokens_received"][row] = received
        if received < body["max_tokens"]:
            out["error"][row] = f"short_output: {received} of {body['max_tokens']} tokens"
            out["finish_s"][row] = np.nan
    except asyncio.CancelledError:
        out["error"][row] = "unfinished_at_window_end"
        out["finish_s"][row] = np.nan
        out["output_tokens_received"][row] = received
        raise
    except (aiohttp.ClientError, OSError, ValueError, TimeoutError) as exc:  # recorded per request
        out["error"][row] = f"{type(exc).__name__}: {exc}"[:200]
        out["finish_s"][row] = np.nan


@contextmanager
def _no_gc_pauses():
    """No cyclic garbage collection inside the block (one full collection after it): a collection stops the
    load generator for tens of milliseconds, late sends and late token times; a run's garbage is small."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        gc.collect()


async def run_load_async(base_url: str, requests: Requests, adapter_names: list[str] | tuple[str, ...],
                         window_s: float, *, vocab_size: int, max_in_flight: int = 0, seed: int = 0,
                         drain_s: float = 0.0, start_at: float | None = None) -> RunRecords:
    """Send ``requests`` (arrivals in [0, window_s)) and cut the run at ``window_s + drain_s``.

    ``start_at`` is the event-loop time of arrival 0 (default: now), to align with a Scraper.
    """
    with _no_gc_pauses():
        return await _run_load(base_url, requests, adapter_names, window_s, vocab_size, max_in_flight, seed,
                               drain_s, start_at)


async def _run_load(base_url, requests, adapter_names, window_s, vocab_size, max_in_flight, seed, drain_s,
                    start_at) -> RunRecords:
    """The body of :func:`run_load_async` (same arguments)."""
    n = len(requests)
    rng = np.random.default_rng(seed)
    names = np.array(list(adapter_names), dtype=object)
    out = {
        "sent_s": np.full(n, np.nan), "first_token_s": np.full(n, np.nan), "finish_s": np.full(n, np.nan),
        "output_tokens_received": np.zeros(n, np.int64), "error": np.full(n, "", dtype=object),
    }
    url = f"{base_url.rstrip('/')}/v1/completions"
    in_window = requests.arrival_s < window_s
    tasks: set[asyncio.Task] = set()
    connector = aiohttp.TCPConnector(limit=max_in_flight or 0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        loop = asyncio.get_running_loop()
        t0 = loop.time() + 0.05 if start_at is None else start_at
        end = t0 + window_s + drain_s

        async def dispatch():
            for i in np.flatnonzero(in_window):
                delay = t0 + requests.arrival_s[i] - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                if max_in_flight and len(tasks) >= max_in_flight:
                    out["error"][i] = "client_cap"
                    continue
                body = completion_body(str(names[requests.adapter[i]]),
                                       prompt_ids(int(requests.input_tokens[i]), vocab_size, rng),
                                       int(requests.output_tokens[i]))
                task = asyncio.create_task(_send(session, url, body, t0, int(i), out))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

        async def all_done():
            await dispatcher
            while tasks:
                await asyncio.wait(set(tasks))

        dispatcher = asyncio.create_task(dispatch())
        try:  # the run ends at the window's end, or earlier once every request is done
            await asyncio.wait_for(all_done(), timeout=max(0.0, end - loop.time()))
        except TimeoutError:
            pass
        dispatcher.cancel()
        pending = list(tasks)
        for task in pending:
            task.cancel()
        await asyncio.gather(dispatcher, *pending, return_exceptions=True)
    not_sent = in_window & np.isnan(out["sent_s"]) & (out["error"] == "")
    out["error"][not_sent] = "not_sent_before_window_end"
    out["error"][~in_window] = "outside_window"
    return RunRecords(
        request=np.arange(n, dtype=np.int64), adapter=names[requests.adapter], arrival_s=requests.arrival_s.copy(),
        input_tokens=requests.input_tokens.astype(np.int64), output_tokens=requests.output_tokens.astype(np.int64),
        **out,
    )


def run_load(base_url: str, requests: Requests, adapter_names, window_s: float, **kwargs) -> RunRecords:
    """Synchronous wrapper of :func:`run_load_async`."""
    return asyncio.run(run_load_async(base_url, requests, adapter_names, window_s, **kwargs))


@dataclass(frozen=True)
class RunSummary:
    """The twin's figures (twin.simulate.SimResult, same names) computed from real per-request records."""

    window_s: float
    total_throughput_tok_s: float
    arriving_tok_s: float
    starved: bool
    itl_ms_mean: float
    ttft_ms_mean: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    ttft_ms_p99_all: float  # over every arrival, one without a first token counted with its wait until the window's end
    tpot_ms_p99: float  # per finished request of >= 2 output tokens: (finish - first token) / (tokens - 1)
    arrived_requests: int
    finished_requests: int
    failed_requests: int


def summarise(records: RunRecords, duration_s: float, warmup_s: float = 0.0) -> RunSummary:
    """The twin's figures of the window [warmup_s, duration_s] by the twin's own definitions
    (twin.simulate.request_outcomes): a request counts as finished where it ended without error, and
    arrives when it was sent (:attr:`RunRecords.engine_arrival_s`)."""
    window = duration_s - warmup_s
    finished = (records.error == "") & np.isfinite(records.finish_s)
    in_sum, out_sum, arrived_sum, ttft, span, tpot, waited = request_outcomes(
        records.engine_arrival_s, np.where(finished, FINISHED, WAITING), np.nan_to_num(records.first_token_s, nan=-1.0),
        np.nan_to_num(records.finish_s, nan=-1.0), records.input_tokens.astype(np.int64),
        records.output_tokens.astype(np.int64), float(warmup_s), float(duration_s))
    total, arriving = (in_sum + out_sum) / window, arrived_sum / window
    gaps = out_sum - ttft.size
    arrived = (records.engine_arrival_s >= warmup_s) & (records.engine_arrival_s < duration_s)
    failed = arrived & ~np.isin(records.error, ("", "unfinished_at_window_end"))
    return RunSummary(
        window_s=window, total_throughput_tok_s=total, arriving_tok_s=arriving,
        starved=bool(total < STARVATION_THRESHOLD * arriving),
        itl_ms_mean=float(span.sum() / gaps * 1000.0) if gaps > 0 else float("nan"),
        ttft_ms_mean=float(ttft.mean()) if ttft.size else float("nan"),
        ttft_ms_p50=_percentile(ttft, 50), ttft_ms_p99=_percentile(ttft, 99),
        ttft_ms_p99_all=_percentile(waited * 1000.0, 99), tpot_ms_p99=_percentile(tpot, 99),
        arrived_requests=int(waited.size), finished_requests=int(ttft.size), failed_requests=int(failed.sum()),
    )


def _percentile(x: np.ndarray, q: float) -> float:
    """The twin's percentile of ``x`` (NaN when empty)."""
    return float(percentiles(x, q)) if x.size else float("nan")


async def measure_async(base_url: str, requests: Requests, adapter_names, window_s: float, *,
                        scrape_interval_s: float = 1.0, **kwargs):
    """Run the load and scrape /metrics over the same clock: (RunRecords, MetricsSeries)."""
    from serving_harness.metrics import Scraper

    origin = asyncio.get_running_loop().time() + 0.1
    async with Scraper(base_url, scrape_interval_s, origin) as scraper:
        records = await run_load_async(base_url, requests, adapter_names, window_s, start_at=origin, **kwargs)
    return records, scraper.series


def measure(base_url: str, requests: Requests, adapter_names, window_s: float, **kwargs):
    """Synchronous :func:`measure_async`."""
    return asyncio.run(measure_async(base_url, requests, adapter_names, window_s, **kwargs))
