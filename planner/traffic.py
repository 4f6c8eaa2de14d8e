"""Request logs a fleet already keeps, counted as they are read: per adapter, its requests in each hour and
the sums its mean prompt and reply lengths come from (:class:`planner.log_tally.Tally`). No request is kept,
so a log of any size reads in bounded memory; logs may be gzip (by their first bytes), in any order.

Formats (``--format``, or told by the file):

* ``jsonl`` / ``csv``: the generic record an OpenAI-compatible gateway writes, one request per line or row:
  ``timestamp`` (epoch seconds or milliseconds, or ISO 8601; ``time``, ``created``, ``start_time`` and
  ``startTime`` are read too), ``model`` (the adapter id a client asked for), ``prompt_tokens`` and
  ``completion_tokens`` (top level, or in an OpenAI ``usage`` object).
* ``litellm``: LiteLLM proxy's spend logs (the rows of its ``LiteLLM_SpendLogs`` table, as its
  ``/spend/logs`` API or a database export gives them: ``startTime``, ``model_group`` (the model a client
  asked for; else ``model``, the deployment's), ``prompt_tokens``, ``completion_tokens``; a JSON array or
  JSON lines). LiteLLM is a common OpenAI-compatible gateway in
  front of vLLM that names LoRA adapters as models, and it keeps one row per request with its token counts
  by default, so a fleet behind it already has what a workload needs.
* ``loadgen``: the per-request records ``planner verify`` and ``planner validate`` store (parquet; times
  in seconds from the run's start, counted from ``--start``; read whole, as such runs are small).

JSON lines go through a compiled scanner (``planner.log_scan``) that reads the common shape of a record;
any other line (escapes, unusual numbers or times, every line that is an error) is read here by the
``json`` module, with the same result. Each model is checked when first met (``planner.log_ranks``): an
adapter without a rank stops the read there, naming the file and line.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from planner.forecast import Series, observed_rates
from planner.input_files import check_regular, read_capped
from planner.log_files import MAX_LINE, READ_ERRORS, Progress, first_byte, line_chunks, open_log, text_lines, where
from planner.log_ranks import Ranks
from planner.log_scan import DONE, GROW, MODEL_KEYS, TIME_KEYS, TOKEN_KEYS, Names, scan
from planner.log_tally import MAX_CELLS, Tally
from planner.workload_csv import MAX_ADAPTERS, printable
from twin.errors import BadInputError

FORMATS = ("auto", "jsonl", "csv", "litellm", "loadgen")
BATCH = 1 << 16  # records scanned, or read by Python, between two counts
MAX_LOADGEN_BYTES = 256 << 20  # a load generator's records are read whole: a run of millions of requests
#: Request times a log may hold (epoch seconds): from 1970 to 2100; a later one is a wrong time.
MAX_TIME = 4102444800.0
NEWLINE = b"\n"


def epoch_seconds(value, where: str) -> float:
    """A log's time as epoch seconds: a number (seconds, or milliseconds past the year 5138) or ISO 8601."""
    if isinstance(value, bool):
        raise BadInputError(f"{where}: the time is not a number or an ISO 8601 time ({value!r})")
    if isinstance(value, (int, float)) or isinstance(value, str) and _is_number(value):
        try:
            v = float(value)
        except OverflowError:
            v = math.inf
        if not math.isfinite(v) or v < 0:
            raise BadInputError(f"{where}: the time {printable(str(value))[:40]!r} is not a time")
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
    except (TypeError, ValueError, OverflowError):
        raise BadInputError(f"{where}: {key} {printable(str(value))[:30]!r} is not a token count") from None
    if not (math.isfinite(v) and 0 <= v <= 1e7):
        raise BadInputError(f"{where}: {key} {printable(str(value))[:30]} is not a token count")
    return v


def record_of(record, where: str, litellm: bool = False) -> tuple[float, str, float, float]:
    """(time, model, prompt tokens, completion tokens) of one parsed record; NaN tokens are unknown. LiteLLM:
    ``startTime``, and ``model_group`` (the name a client asked for) else ``model`` (the deployment's)."""
    if not isinstance(record, dict):
        raise BadInputError(f"{where}: a record must be a JSON object")
    keys = ("startTime",) if litellm else TIME_KEYS
    key = next((k for k in keys if k in record), None)
    if key is None:
        raise BadInputError(f"{where}: the record has no time ({', '.join(keys)})")
    model = next((record[k] for k in (MODEL_KEYS[::-1] if litellm else MODEL_KEYS[:1]) if record.get(k)), None)
    if not isinstance(model, str) or not model:
        raise BadInputError(f"{where}: the record has no model (the adapter a client asked for)")
    p, c = (_tokens(record, k, where) for k in TOKEN_KEYS)
    return epoch_seconds(record[key], where), model, p, c


def json_line(line: bytes, where: str, litellm: bool = False) -> tuple[float, str, float, float] | None:
    """The record on one line of JSON lines by the ``json`` module (None: a blank line): the exact path."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInputError(f"{where}: not UTF-8 text (byte {exc.start + 1} of the line)") from None
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise BadInputError(f"{where}: not a JSON record ({exc})") from None
    return record_of(record, where, litellm)


class _Reader:
    """Records of every log of one read, counted into one :class:`Tally`; models checked when first met."""

    def __init__(self, ranks: Ranks | None) -> None:
        self.ranks = ranks
        self.names = Names()
        self.keep = np.zeros(0, np.bool_)
        self.tally = Tally()

    def admit(self, k: int, where: Callable[[], str]) -> None:
        """Model id ``k``, first met at ``where()``: counted, left out (the base model), or the read stops."""
        name = self.names.text[k]
        if k >= MAX_ADAPTERS:
            raise BadInputError(f"{where()}: the logs name more than {MAX_ADAPTERS:,} models ({name!r} the next); a "
                                f"workload holds at most {MAX_ADAPTERS:,} adapters")
        if self.keep.size < len(self.names):
            self.keep = np.concatenate([self.keep, np.zeros(max(len(self.names), 2 * self.keep.size, 64)
                                                            - self.keep.size, np.bool_)])
        excluded = self.ranks is not None and self.ranks.excluded(name)
        problem = None if excluded or self.ranks is None else self.ranks.problem(name)
        if problem:
            raise BadInputError(f"{where()}: {problem}")
        self.keep[k] = not excluded

    def model_id(self, name: str, where: str) -> int:
        before = len(self.names)
        k = self.names.id_of(name)
        if k >= before:
            self.admit(k, lambda: where)
        return k

    def count(self, ids, t, prompt, completion, where_of: Callable[[int], str]) -> None:
        t = np.asarray(t, float)
        wrong = np.flatnonzero(~((t >= 0) & (t < MAX_TIME)))
        if wrong.size:
            raise BadInputError(f"{where_of(int(wrong[0]))}: the time {t[wrong[0]]:.6g} (epoch seconds) is not "
                                "between 1970 and 2100")
        bad = self.tally.add(np.asarray(ids, np.int64), t, np.asarray(prompt, float),
                             np.asarray(completion, float), self.keep[:len(self.names)])
        if bad >= 0:
            stamp = dt.datetime.fromtimestamp(min(float(t[bad]), 253402300799.0), dt.UTC).isoformat()[:19]
            raise BadInputError(f"{where_of(bad)}: the time {stamp} would make the logs span too long for "
                                f"{len(self.names):,} models (at most {MAX_CELLS:,} model-hours): a wrong time, "
                                "or logs to read in parts")

    def rows(self, records: Iterator[tuple[float, str, float, float, str]]) -> None:
        """Count (time, model, prompt, completion, where) records read in Python."""
        ids, t, p, c, wheres = [], [], [], [], []
        for time, model, prompt, completion, at in records:
            ids.append(self.model_id(model, at))
            t.append(time)
            p.append(prompt)
            c.append(completion)
            wheres.append(at)
            if len(ids) == BATCH:
                self.count(ids, t, p, c, wheres.__getitem__)
                ids, t, p, c, wheres = [], [], [], [], []
        self.count(ids, t, p, c, wheres.__getitem__)


def _json_lines(path: Path, reader: _Reader, litellm: bool, progress: Progress | None) -> None:
    names = reader.names
    out = {"ids": np.zeros(BATCH, np.int64), "t": np.zeros(BATCH), "p": np.zeros(BATCH), "c": np.zeros(BATCH),
           "off": np.zeros(BATCH, np.int64)}
    fb_start, fb_end = np.zeros(BATCH, np.int64), np.zeros(BATCH, np.int64)
    done = np.zeros(2, np.int64)
    for chunk, lines_before in line_chunks(path, progress):
        buf = np.frombuffer(chunk, np.uint8)

        def at(offset: int, chunk=chunk, lines_before=lines_before) -> str:
            return f"{where(path)}:{lines_before + chunk.count(NEWLINE, 0, offset) + 1}"

        pos, status = 0, GROW
        while status != DONE:
            known = len(names)
            done[:] = 0
            status, resume = scan(buf, pos, litellm, names.slots, names.hashes, names.start, names.length,
                                  names.store, names.state, out["ids"], out["t"], out["p"], out["c"], out["off"],
                                  fb_start, fb_end, done)
            names.sync()
            n, nf = int(done[0]), int(done[1])
            _admit_and_count(reader, known, {k: v[:n] for k, v in out.items()}, chunk, fb_start[:nf], fb_end[:nf],
                             litellm, at)
            if status == GROW:
                end = chunk.find(NEWLINE, resume)
                names.grow((end if end >= 0 else len(chunk)) - resume)
            pos = resume


def _admit_and_count(reader: _Reader, known: int, fast: dict, chunk: bytes, fb_start, fb_end, litellm: bool,
                     at: Callable[[int], str]) -> None:
    """One scanned batch: the lines the scanner left read by the exact path, the models first met checked in
    the order of their lines (so the first bad line is the one named), then all counted."""
    first: dict[int, int] = {}  # model id first met in this batch -> its line's first byte
    new = np.flatnonzero(fast["ids"] >= known)
    if new.size:
        ids, index = np.unique(fast["ids"][new], return_index=True)
        first.update(zip(ids.tolist(), fast["off"][new[index]].tolist()))
    slow: list[tuple[int, float, float, float, int]] = []
    failure: tuple[int, BadInputError] | None = None
    for s, e in zip(fb_start.tolist(), fb_end.tolist()):
        try:
            rec = json_line(chunk[s:e], at(s), litellm)
        except BadInputError as exc:
            failure = (s, exc)
            break
        if rec is not None:
            k = reader.names.id_of(rec[1])
            if k >= known:
                first.setdefault(k, s)
            slow.append((k, rec[0], rec[2], rec[3], s))
    for k, offset in sorted(first.items(), key=lambda item: item[1]):
        if failure is not None and failure[0] < offset:
            break
        reader.admit(k, lambda offset=offset: at(offset))
    if failure is not None:
        raise failure[1]
    reader.count(fast["ids"], fast["t"], fast["p"], fast["c"], lambda i: at(int(fast["off"][i])))
    if slow:
        ids, t, p, c, offsets = zip(*slow)
        reader.count(ids, t, p, c, lambda i: at(offsets[i]))


def _json_array(path: Path, reader: _Reader, litellm: bool, progress: Progress | None) -> None:
    """A JSON array of records (LiteLLM's /spend/logs), decoded one record at a time."""
    with open_log(path) as (stream, raw):
        text = io.TextIOWrapper(stream, encoding="utf-8-sig")
        name = where(path)
        reader.rows((*record_of(obj, f"{name}: record {k}", litellm), f"{name}: record {k}")
                    for k, obj in enumerate(_array_items(text, name, raw, progress), start=1))


def _array_items(text, name: str, raw, progress: Progress | None) -> Iterator[object]:
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False

    def fill() -> bool:
        """Read on (False: at the end, or a record would exceed MAX_LINE)."""
        nonlocal buf, pos, eof
        if eof or len(buf) - pos > MAX_LINE:
            return False
        try:
            more = text.read(1 << 20)
        except (UnicodeDecodeError, *READ_ERRORS) as exc:
            raise BadInputError(f"{name}: cannot read the log ({exc})") from None
        eof = not more
        buf, pos = buf[pos:] + more, 0
        if progress is not None:
            progress.at(raw.tell())
        return True

    def skip_ws() -> str:
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf) or eof:
                return buf[pos] if pos < len(buf) else ""
            fill()

    def fail(why: str):
        return BadInputError(f"{name}: not a JSON array of records ({why})")

    if skip_ws() != "[":
        raise fail("it does not start with [")
    pos += 1
    if skip_ws() == "]":
        pos += 1
    else:
        while True:
            skip_ws()
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except (json.JSONDecodeError, RecursionError) as exc:  # a bad record, or one read in part
                if fill():
                    continue
                raise fail(str(exc)) from None
            if end == len(buf) and fill():
                continue
            pos = end
            yield obj
            c = skip_ws()
            pos += 1
            if c == "]":
                break
            if c != ",":
                raise fail(f"expected , or ] after record, found {c[:1]!r}" if c else "it ends inside the array")
    if skip_ws():
        raise fail("extra data after the array")


def _csv(path: Path, reader: _Reader, progress: Progress | None) -> None:
    with open_log(path) as (stream, raw):
        text = io.TextIOWrapper(stream, encoding="utf-8-sig", newline="")
        rows = csv.DictReader(text_lines(text, path))
        name = where(path)

        def records():
            try:
                for k, row in enumerate(rows):
                    at = f"{name}:{rows.line_num}"
                    yield (*record_of(row, at), at)
                    if progress is not None and k % BATCH == 0:
                        progress.at(raw.tell())
            except csv.Error as exc:
                raise BadInputError(f"{name}:{rows.line_num}: not CSV ({exc})") from None
            except (UnicodeDecodeError, *READ_ERRORS) as exc:
                raise BadInputError(f"{name}: cannot read the log ({exc})") from None

        reader.rows(records())


def _loadgen(path: Path, reader: _Reader, start: float) -> None:
    from serving_harness.loadgen import RunRecords

    data = read_capped(path, MAX_LOADGEN_BYTES, "the load generator's records")
    try:
        rec = RunRecords.from_parquet(io.BytesIO(data))
    except (OSError, ValueError, KeyError, TypeError) as exc:  # pyarrow raises ArrowInvalid (a ValueError)
        raise BadInputError(f"{where(path)}: not a load generator's records ({type(exc).__name__}: "
                            f"{exc})") from None
    received = np.where(np.isfinite(rec.output_tokens_received.astype(float)), rec.output_tokens_received,
                        rec.output_tokens).astype(float)
    ids: dict[object, int] = {}  # each request's model (as stored: no fixed-width copy of every name) -> its id
    inverse = np.empty(len(rec.adapter), np.int64)
    for row, model in enumerate(rec.adapter.tolist()):
        if model not in ids:
            ids[model] = reader.model_id(str(model), f"{where(path)}: request {row + 1}")
        inverse[row] = ids[model]
    reader.count(inverse, start + rec.arrival_s.astype(float), rec.input_tokens.astype(float), received,
                 lambda i: f"{where(path)}: request {i + 1}")


@dataclass(frozen=True)
class Traffic:
    """What the logs say, per adapter (the base model left out; sorted by name)."""

    adapters: list[str]
    counts: np.ndarray  # (adapters, hours): requests in each hour from the first request's to the last's
    start: float  # epoch seconds of the first of those hours
    first: float  # the first and last request's time, any model's (what the logs cover)
    last: float
    sums: np.ndarray  # (adapters, 6): count, sum, sum of squares of known prompt, then completion, tokens
    requests: int

    def series(self) -> Series:
        """Each adapter's rate per hour, over the seconds of each the logs cover."""
        return observed_rates(self.counts, self.start, self.first, self.last, self.adapters)


def guess_format(path: Path) -> str:
    """The format a log's name tells (a ``.gz`` suffix aside): .parquet loadgen, .csv csv, else jsonl."""
    suffixes = [s for s in path.suffixes if s != ".gz"]
    last = suffixes[-1] if suffixes else ""
    return {".parquet": "loadgen", ".csv": "csv"}.get(last, "jsonl")


def read_logs(paths, fmt: str = "auto", ranks: Ranks | None = None, start: float = 0.0) -> Traffic:
    """The requests of several logs (of one fleet), counted (``fmt`` one of :data:`FORMATS`; ``ranks``: which
    models are adapters, the read stopping at the first that is not; None: every model is; ``start``: epoch
    seconds of a ``loadgen`` run's time 0)."""
    if fmt not in FORMATS:
        raise BadInputError(f"unknown log format '{fmt}'; choose one of {', '.join(FORMATS)}")
    paths = [Path(p) for p in paths]
    seen: dict[Path, Path] = {}
    for p in paths:
        check_regular(p, "the log")
        first = seen.setdefault(p.resolve(), p)
        if first is not p:
            raise BadInputError(f"{where(p)}: the log {where(first)} given again; each log is read once (its requests "
                                "would count twice)")
    reader = _Reader(ranks)
    progress = Progress(paths)
    try:
        for path in paths:
            kind = guess_format(path) if fmt == "auto" else fmt
            if kind == "loadgen":
                _loadgen(path, reader, start)
            elif kind == "csv":
                _csv(path, reader, progress)
            elif first_byte(path) == b"[":
                _json_array(path, reader, kind == "litellm", progress)
            else:
                _json_lines(path, reader, kind == "litellm", progress)
            progress.file_done(path)
    finally:
        progress.close()
    tally = reader.tally
    if tally.requests == 0:
        raise BadInputError(f"{', '.join(where(p) for p in paths[:4])}{' ...' if len(paths) > 4 else ''}: no request "
                            "for an adapter in the log" + ("s" if len(paths) > 1 else ""))
    kept = sorted((k for k in range(len(reader.names)) if reader.keep[k]), key=reader.names.text.__getitem__)
    counts, first_hour = tally.hours()
    return Traffic([reader.names.text[k] for k in kept], counts[kept], first_hour, tally.first, tally.last,
                   tally.sums[kept], tally.requests)
