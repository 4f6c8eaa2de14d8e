"""Read and validate workload.csv (one row per adapter; see docs/workload.md).

Every problem is reported as one line naming the file, the line, the column and the fix.

* **Adapter ids** become the OpenAI ``model`` string a router sends and a directory name under
  ``--adapter-dir``, so they follow one grammar (:data:`ADAPTER_ID`): 1-256 ASCII characters, letters,
  digits and ``. _ - : @ + /``, starting with a letter or digit, with no empty, ``.`` or ``..`` path
  segment. No control character, NUL, space or leading ``-`` (which a command line would read as an
  option) gets through.
* **Numbers** are plain decimal or scientific notation in ASCII digits (:data:`NUMBER`; no ``0_1``, no
  ``nan``/``inf``, no other scripts' digits) and must be finite and within :data:`BOUNDS`.
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
from pathlib import Path

from planner.input_files import read_capped
from twin.errors import WorkloadError, printable
from twin.profile import Profile
from twin.workload import Adapter, Workload

REQUIRED = ("adapter_id", "rank", "rate_rps")
ADAPTER_ID = re.compile(r"(?!.*(^|/)\.{1,2}(/|$))(?!.*//)(?!.*/$)[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,255}", re.ASCII)
NUMBER = re.compile(r"[+]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", re.ASCII)
INTEGER = re.compile(r"[+]?\d+", re.ASCII)
#: Physical bounds of each number column (inclusive), with the unit a message names.
BOUNDS = {"rank": (1, 1024, "a LoRA rank"), "rate_rps": (0.0, 1e5, "requests per second"),
          "input_tokens": (1.0, 1e7, "mean prompt tokens per request"),
          "output_tokens": (1.0, 1e7, "mean output tokens per request"),
          "max_ttft_s": (1e-3, 3600.0, "p99 time to first token, seconds; leave it empty for the plan's"),
          "max_tpot_ms": (1e-3, 60000.0, "p99 time per output token, ms; leave it empty for the plan's"),
          "input_tokens_cv": (0.0, 100.0, "coefficient of variation"),
          "output_tokens_cv": (0.0, 100.0, "coefficient of variation"),
          "requests_observed": (0.0, 1e12, "requests"), "mean_rps_observed": (0.0, 1e5, "requests per second"),
          "peak_rps_observed": (0.0, 1e5, "requests per second")}
#: The longest field the reader takes (a path column can be long; an id is at most 256).
MAX_FIELD = 4096
#: The most adapters one workload holds: a plan of 100,000 takes under a minute and 0.5 GB on 2 cores
#: (benchmarks/placement/fleet_plans.py); this bounds a plan's memory near 1 GB. A larger fleet plans in parts.
MAX_ADAPTERS = 200_000
#: The largest workload (or ranks) file read: MAX_ADAPTERS rows of over 300 bytes each.
MAX_WORKLOAD_BYTES = 64 << 20
OPTIONAL = ("input_tokens", "output_tokens", "path", "max_ttft_s", "max_tpot_ms")
#: Where a workload came from, as `planner workload` writes it: read and checked, not planned with (the
#: twin draws lengths with the profile's spread).
PROVENANCE = ("input_tokens_cv", "output_tokens_cv", "requests_observed", "mean_rps_observed", "peak_rps_observed",
              "rate_method")


def _fail(path, line: int | None, column: str | None, msg: str) -> WorkloadError:
    where = printable(str(path))
    if line is not None:
        where += f":{line}"
    if column:
        where += f": column '{column}'"
    return WorkloadError(f"{where}: {msg}")


def read_ranks(path: str | os.PathLike) -> dict[str, tuple[int, str | None]]:
    """adapter id -> (rank, path) from a CSV with ``adapter_id`` and ``rank`` columns (and ``path``, if any;
    other columns, a workload's rates say, are ignored)."""
    path = Path(path)
    try:
        text = read_capped(path, MAX_WORKLOAD_BYTES, "the ranks file").decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise _fail(path, None, None, f"cannot read the ranks ({exc})") from None
    rows = _rows(path, text)
    if not rows:
        raise _fail(path, None, None, "is empty; it needs a header with adapter_id,rank")
    header = [h.strip() for h in rows[0][1]]
    for c in ("adapter_id", "rank"):
        if c not in header:
            raise _fail(path, 1, c, "missing from the header; a ranks file needs adapter_id,rank[,path]")
    col = {c: header.index(c) for c in ("adapter_id", "rank", "path") if c in header}
    out: dict[str, tuple[int, str | None]] = {}
    for lineno, row in rows[1:]:
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != len(header):
            raise _fail(path, lineno, None, f"has {len(row)} fields but the header has {len(header)}")
        aid = _adapter_id(path, lineno, row[col["adapter_id"]].strip())
        rank = int(_number(path, lineno, "rank", row[col["rank"]].strip(), integer=True))
        out[aid] = (rank, row[col["path"]].strip() or None if "path" in col else None)
    return out


def write_workload(path, rows: list[dict], columns: tuple[str, ...]) -> None:
    """workload.csv from ``rows`` (dicts by column; None is an empty field), written atomically."""
    from twin.atomic import write_text_atomic

    buf = io.StringIO()
    out = csv.writer(buf, lineterminator="\n")
    out.writerow(columns)
    for row in rows:
        out.writerow(["" if row.get(c) is None else f"{row[c]:.6g}" if isinstance(row[c], float) else row[c]
                      for c in columns])
    write_text_atomic(path, buf.getvalue())


def read_workload(path: str | os.PathLike, profile: Profile | None = None) -> Workload:
    """Parse ``path``; with ``profile``, also check every rank is servable by it."""
    path = Path(path)
    raw = read_capped(path, MAX_WORKLOAD_BYTES, "the workload")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise _fail(path, line, None, "is not UTF-8 text; save the file as UTF-8") from None
    if not text.strip():
        raise _fail(path, None, None, f"is empty; the first line must be a header with {', '.join(REQUIRED)}")
    lines = text.count("\n")
    if lines > MAX_ADAPTERS + 1:
        raise _fail(path, None, None, f"has {lines - 1:,} rows; a workload holds at most {MAX_ADAPTERS:,} adapters "
                    "(plan a larger fleet in parts, by model or by region)")
    if "\x00" in text:
        line = text[:text.index("\x00")].count("\n") + 1
        raise _fail(path, line, None, "holds a NUL character; save the file as plain CSV text")
    rows = _rows(path, text)
    header = [h.strip() for h in rows[0][1]]
    if len(header) == 1 and any(sep in header[0] for sep in (";", "\t", "|")):
        raise _fail(path, 1, None, "uses another delimiter; separate columns with commas")
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise _fail(path, 1, missing[0], f"missing from the header; it needs {', '.join(REQUIRED)} "
                    f"(optional: {', '.join(OPTIONAL)})")
    extra = [c for c in header if c not in REQUIRED + OPTIONAL + PROVENANCE]
    if extra:
        raise _fail(path, 1, extra[0][:40], f"not a workload column; allowed: {', '.join(REQUIRED + OPTIONAL)} "
                    f"(and {', '.join(PROVENANCE)})")
    dup = {c for c in header if header.count(c) > 1}
    if dup:
        raise _fail(path, 1, min(dup), "appears twice in the header; keep one")
    col = {c: i for i, c in enumerate(header)}
    adapters: list[Adapter] = []
    seen: dict[str, int] = {}
    servable: set[int] = set()  # ranks the profile serves, checked once each
    for lineno, row in rows[1:]:
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != len(header):
            raise _fail(path, lineno, None, f"has {len(row)} fields but the header has {len(header)}")
        get = {c: row[i].strip() for c, i in col.items()}
        aid = _adapter_id(path, lineno, get["adapter_id"])
        if aid in seen:
            raise _fail(path, lineno, "adapter_id", f"'{aid}' already appears on line {seen[aid]}; ids must be unique")
        seen[aid] = lineno
        rank = int(_number(path, lineno, "rank", get["rank"], integer=True))
        if profile is not None and rank not in servable and profile.kv.rank_for(rank) is None:
            raise _fail(path, lineno, "rank", f"{rank} cannot be served by profile {profile.profile_id} "
                        f"(largest profiled max_lora_rank: {max(profile.kv.lora_ranks)})")
        servable.add(rank)
        rate = _number(path, lineno, "rate_rps", get["rate_rps"])
        optional = {c: _number(path, lineno, c, get[c]) if get.get(c) else None
                    for c in ("input_tokens", "output_tokens", "max_ttft_s", "max_tpot_ms")}
        if profile is not None and (optional["input_tokens"] or optional["output_tokens"]):
            _check_fits(path, lineno, profile, optional["input_tokens"], optional["output_tokens"])
        for c in PROVENANCE[:-1]:
            if get.get(c):
                _number(path, lineno, c, get[c])
        if get.get("rate_method") and not get["rate_method"].isidentifier():
            raise _fail(path, lineno, "rate_method", f"'{printable(get['rate_method'])[:20]}' is not a method name")
        where = get.get("path") or None
        if where is not None and any(ord(ch) < 32 or ord(ch) == 127 for ch in where):
            raise _fail(path, lineno, "path", "holds a control character; give a plain file system path")
        adapters.append(Adapter(aid, rank, rate, optional["input_tokens"], optional["output_tokens"], where,
                                optional["max_ttft_s"], optional["max_tpot_ms"]))
    if not adapters:
        raise _fail(path, 2, None, "the file has a header but no adapters; add one row per adapter")
    if not any(a.rate_rps > 0 for a in adapters):
        raise _fail(path, None, "rate_rps", "is 0 for every adapter: there is no traffic to plan for")
    return Workload(tuple(adapters))


def _check_fits(path, lineno: int, profile: Profile, ins: float | None, outs: float | None) -> None:
    """A row's own lengths must fit the profile's context: vLLM refuses a longer request (planner.packing.mean_lengths
    checks them again with the lengths the command gives the adapters that leave one out)."""
    limit = profile.engine.max_model_len
    if (ins or 0) + (outs or 0) > limit:
        said = " + ".join(f"{n:g} {what}" for n, what in ((ins, "prompt"), (outs, "output")) if n)
        raise _fail(path, lineno, "input_tokens" if ins else "output_tokens",
                    f"a request of {said} tokens does not fit max_model_len {limit} of profile {profile.profile_id}; "
                    "vLLM would refuse it (shorten the request, or plan with a profile of a longer context)")


def _rows(path, text: str) -> list[tuple[int, list[str]]]:
    """(line number, fields) of every record; a malformed file is one clear error, not a csv traceback."""
    if "\r" in text.replace("\r\n", ""):
        line = text[:text.replace("\r\n", "\n\n").index("\r")].count("\n") + 1
        raise _fail(path, line, None, "has a carriage return that does not end a line; save the file with "
                    "\\n or \\r\\n line endings")
    reader = csv.reader(io.StringIO(text, newline=""))
    out = []
    previous = csv.field_size_limit(MAX_FIELD)  # the csv module's limit is process-wide: put it back after
    try:
        for fields in reader:
            out.append((reader.line_num, fields))
    except csv.Error as exc:
        raise _fail(path, reader.line_num + 1, None, f"is not valid CSV ({exc}); a field holds at most "
                    f"{MAX_FIELD} characters") from None
    finally:
        csv.field_size_limit(previous)
    return out


def adapter_id_problem(aid: str) -> str | None:
    """Why ``aid`` is not an adapter id of the module docstring's grammar (None: it is)."""
    if not aid:
        return "is empty; give every adapter a unique name"
    if len(aid) > 256:
        return f"is {len(aid)} characters long; an adapter id has at most 256"
    if ADAPTER_ID.fullmatch(aid) is None:
        shown = aid.encode("unicode_escape").decode("ascii")[:60]
        return (f"'{shown}' is not an adapter id: use letters, digits and . _ - : @ + /, start with a letter "
                "or digit, and no '.', '..' or empty path segment")
    return None


def _adapter_id(path, line: int, aid: str) -> str:
    problem = adapter_id_problem(aid)
    if problem:
        raise _fail(path, line, "adapter_id", problem)
    return aid


def _number(path, line, column, text, integer=False) -> float:
    """A number of ``column`` in plain notation, finite and within :data:`BOUNDS`."""
    lo, hi, what = BOUNDS[column]
    grammar = INTEGER if integer else NUMBER
    if grammar.fullmatch(text) is None:
        shown = text.encode("unicode_escape").decode("ascii")[:40]
        kind = "an integer" if integer else "a number"
        raise _fail(path, line, column, f"'{shown}' is not {kind} in plain notation ({what}, e.g. "
                    f"{'16' if integer else '0.25 or 2.5e-3'})")
    v = float(text)
    if not (math.isfinite(v) and lo <= v <= hi):
        shown = text.encode("unicode_escape").decode("ascii")[:40]
        raise _fail(path, line, column, f"{shown} is out of range ({what}, {lo:g} to {hi:g})")
    return v
