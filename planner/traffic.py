"""Request logs a fleet already keeps, read into one table: when each request came, for which adapter, and
how long its prompt and reply were.

Formats (``--format``, or told by the file):

* ``jsonl`` / ``csv``: the generic record an OpenAI-compatible gateway writes, one request per line or row:
  ``timestamp`` (epoch seconds or milliseconds, or ISO 8601; ``time``, ``created`` and ``start_time`` are
  read too), ``model`` (the adapter id a client asked for), ``prompt_tokens`` and ``completion_tokens``
  (top level, or in an OpenAI ``usage`` object).
* ``litellm``: LiteLLM proxy's spend logs (the rows of its ``LiteLLM_SpendLogs`` table, as its
  ``/spend/logs`` API or a database export gives them: ``startTime``, ``model_group`` (the model a client
  asked for; else ``model``, the deployment's), ``prompt_tokens``, ``completion_tokens``; a JSON array or
  JSON lines). LiteLLM is a common OpenAI-compatible gateway in
  front of vLLM that names LoRA adapters as models, and it keeps one row per request with its token counts
  by default, so a fleet behind it already has what a workload needs.
* ``loadgen``: the per-request records ``planner verify`` and ``planner validate`` store (parquet; times
  in seconds from the run's start, counted from ``--start``).

Requests for ``--base-model`` (the plain model, not an adapter) are left out.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from planner.workload_csv import printable
from twin.errors import BadInputError

FORMATS = ("auto", "jsonl", "csv", "litellm", "loadgen")
TIME_KEYS = ("timestamp", "time", "created", "start_time", "startTime")


@dataclass(frozen=True)
class Traffic:
    """One row per request, sorted by time."""

    t: np.ndarray  # epoch seconds
    model: np.ndarray  # object array of adapter ids
    prompt_tokens: np.ndarray  # float64
    completion_tokens: np.ndarray

    def __len__(self) -> int:
        return int(self.t.shape[0])

    @classmethod
    def of(cls, rows: list[tuple[float, str, float, float]]) -> Traffic:
        rows.sort(key=lambda r: r[0])
        t, model, p, c = zip(*rows) if rows else ((), (), (), ())
        return cls(np.array(t, float), np.array(model, dtype=object), np.array(p, float), np.array(c, float))


def epoch_seconds(value, where: str) -> float:
    """A log's time as epoch seconds: a number (seconds, or milliseconds past the year 5138) or ISO 8601."""
    if isinstance(value, bool):
        raise BadInputError(f"{where}: the time is not a number or an ISO 8601 time ({value!r})")
    if isinstance(value, (int, float)) or isinstance(value, str) and _is_number(value):
        v = float(value)
        if not math.isfinite(v) or v < 0:
            raise BadInputError(f"{where}: the time {value!r} is not a time")
        return v / 1000.0 if v > 1e11 else v
    if isinstance(value, str):
        try:
            stamp = dt.datetime.fromisoformat(value.strip())
        except ValueError:
            raise BadInputError(f"{where}: {printable(value)[:40]!r} is not an ISO 8601 time or epoch seconds") from None
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=dt.UTC)
        return stamp.timestamp()
    raise BadInputError(f"{where}: the record has no time ({', '.join(TIME_KEYS)})")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _tokens(record: dict, key: str, where: str) -> float:
    value = record.get(key, (record.get("usage") or {}).get(key) if isinstance(record.get("usage"), dict) else None)
    if value is None or value == "":
        return float("nan")  # unknown: the lengths come from the adapter's other requests, else the profile
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise BadInputError(f"{where}: {key} {printable(str(value))[:30]!r} is not a token count") from None
    if not (math.isfinite(v) and 0 <= v <= 1e7):
        raise BadInputError(f"{where}: {key} {value!r} is not a token count")
    return v


def _record(record, where: str, time_key: str | None = None,
            model_keys: tuple[str, ...] = ("model",)) -> tuple[float, str, float, float]:
    if not isinstance(record, dict):
        raise BadInputError(f"{where}: a record must be a JSON object")
    key = time_key or next((k for k in TIME_KEYS if k in record), None)
    if key is None:
        raise BadInputError(f"{where}: the record has no time ({', '.join(TIME_KEYS)})")
    model = next((record[k] for k in model_keys if record.get(k)), None)
    if not isinstance(model, str) or not model:
        raise BadInputError(f"{where}: the record has no model (the adapter a client asked for)")
    return (epoch_seconds(record[key], where), model, _tokens(record, "prompt_tokens", where),
            _tokens(record, "completion_tokens", where))


def _json_records(path: Path, text: str) -> list:
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise BadInputError(f"{printable(str(path))}: not a JSON array of records ({exc})") from None
        return data
    out = []
    for k, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except (json.JSONDecodeError, RecursionError) as exc:
                raise BadInputError(f"{printable(str(path))}:{k}: not a JSON record ({exc})") from None
    return out


def read_log(path: str | os.PathLike, fmt: str = "auto", base_model: str | None = None,
             start: float = 0.0) -> Traffic:
    """Every request of one log file (``fmt`` one of :data:`FORMATS`; ``start``: epoch seconds of a
    ``loadgen`` run's time 0)."""
    path = Path(path)
    if fmt not in FORMATS:
        raise BadInputError(f"unknown log format '{fmt}'; choose one of {', '.join(FORMATS)}")
    if fmt == "auto":
        fmt = _guess(path)
    if fmt == "loadgen":
        rows = _loadgen_rows(path, start)
    else:
        try:
            text = path.read_text(encoding="utf-8-sig")
        except (OSError, UnicodeDecodeError) as exc:
            raise BadInputError(f"{printable(str(path))}: cannot read the log ({exc})") from None
        if fmt == "csv":
            reader = csv.DictReader(io.StringIO(text))
            rows = [_record(r, f"{printable(str(path))}:{reader.line_num}") for r in reader]
        else:
            # LiteLLM: model_group is the name a client asked for; model the deployment's (``hosted_vllm/...``)
            keys = ("startTime", ("model_group", "model")) if fmt == "litellm" else (None, ("model",))
            rows = [_record(r, f"{printable(str(path))}: record {k}", *keys)
                    for k, r in enumerate(_json_records(path, text), start=1)]
    if base_model is not None:
        rows = [r for r in rows if r[1] != base_model]
    return Traffic.of(rows)


def _guess(path: Path) -> str:
    if path.suffix == ".parquet":
        return "loadgen"
    if path.suffix == ".csv":
        return "csv"
    return "jsonl"


def _loadgen_rows(path: Path, start: float) -> list[tuple[float, str, float, float]]:
    from serving_harness.loadgen import RunRecords

    try:
        rec = RunRecords.from_parquet(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # pyarrow raises ArrowInvalid (a ValueError)
        raise BadInputError(f"{printable(str(path))}: not a load generator's records ({type(exc).__name__}: "
                            f"{exc})") from None
    received = np.where(np.isfinite(rec.output_tokens_received.astype(float)), rec.output_tokens_received,
                        rec.output_tokens).astype(float)
    return list(zip((start + rec.arrival_s.astype(float)).tolist(), rec.adapter.tolist(),
                    rec.input_tokens.astype(float).tolist(), received.tolist()))


def read_logs(paths, fmt: str = "auto", base_model: str | None = None, start: float = 0.0) -> Traffic:
    """Every request of several logs (of one fleet), as one table."""
    parts = [read_log(p, fmt, base_model, start) for p in paths]
    rows = [(float(t), m, float(p), float(c)) for part in parts
            for t, m, p, c in zip(part.t, part.model, part.prompt_tokens, part.completion_tokens)]
    if not rows:
        raise BadInputError("the logs hold no request for an adapter")
    return Traffic.of(rows)
