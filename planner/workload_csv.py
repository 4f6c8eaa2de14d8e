"""Read and validate workload.csv (one row per adapter; see DESIGN.md "The files between stages").

Every problem is reported as one line naming the file, the line, the column and the fix.
"""

from __future__ import annotations

import csv
import io
import math
import os
from pathlib import Path

from twin.errors import WorkloadError
from twin.profile import Profile
from twin.workload import Adapter, Workload

REQUIRED = ("adapter_id", "rank", "rate_rps")
OPTIONAL = ("input_tokens", "output_tokens", "path", "max_ttft_s", "max_tpot_ms")
#: Per-adapter SLO columns: (what it is, unit) for the messages.
SLO_COLUMNS = {"max_ttft_s": "p99 time to first token, seconds", "max_tpot_ms": "p99 time per output token, ms"}


def _fail(path, line: int | None, column: str | None, msg: str) -> WorkloadError:
    where = f"{path}"
    if line is not None:
        where += f":{line}"
    if column:
        where += f": column '{column}'"
    return WorkloadError(f"{where}: {msg}")


def read_workload(path: str | os.PathLike, profile: Profile | None = None) -> Workload:
    """Parse ``path``; with ``profile``, also check every rank is servable by it."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise _fail(path, None, None, f"cannot read the file ({exc.strerror})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise _fail(path, line, None, "is not UTF-8 text; save the file as UTF-8") from None
    if not text.strip():
        raise _fail(path, None, None, f"is empty; the first line must be a header with {', '.join(REQUIRED)}")
    rows = list(csv.reader(io.StringIO(text)))
    header = [h.strip() for h in rows[0]]
    if len(header) == 1 and any(sep in header[0] for sep in (";", "\t", "|")):
        raise _fail(path, 1, None, "uses another delimiter; separate columns with commas")
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise _fail(path, 1, missing[0], f"missing from the header; it needs {', '.join(REQUIRED)} "
                    f"(optional: {', '.join(OPTIONAL)})")
    extra = [c for c in header if c not in REQUIRED + OPTIONAL]
    if extra:
        raise _fail(path, 1, extra[0], f"not a workload column; allowed: {', '.join(REQUIRED + OPTIONAL)}")
    dup = {c for c in header if header.count(c) > 1}
    if dup:
        raise _fail(path, 1, min(dup), "appears twice in the header; keep one")
    col = {c: i for i, c in enumerate(header)}
    adapters: list[Adapter] = []
    seen: dict[str, int] = {}
    for lineno, row in enumerate(rows[1:], start=2):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != len(header):
            raise _fail(path, lineno, None, f"has {len(row)} fields but the header has {len(header)}")
        get = {c: row[i].strip() for c, i in col.items()}
        aid = get["adapter_id"]
        if not aid:
            raise _fail(path, lineno, "adapter_id", "is empty; give every adapter a unique name")
        if aid in seen:
            raise _fail(path, lineno, "adapter_id", f"'{aid}' already appears on line {seen[aid]}; ids must be unique")
        seen[aid] = lineno
        try:
            rank = int(get["rank"])
        except ValueError:
            raise _fail(path, lineno, "rank", f"'{get['rank']}' is not an integer LoRA rank (e.g. 8, 16, 32)") from None
        if rank <= 0:
            raise _fail(path, lineno, "rank", f"{rank} must be a positive LoRA rank")
        if profile is not None and profile.kv.rank_for(rank) is None:
            raise _fail(path, lineno, "rank", f"{rank} cannot be served by profile {profile.profile_id} "
                        f"(largest profiled max_lora_rank: {max(profile.kv.lora_ranks)})")
        rate = _number(path, lineno, "rate_rps", get["rate_rps"], "requests per second, >= 0", minimum=0.0)
        lengths = {}
        for c in ("input_tokens", "output_tokens"):
            v = get.get(c, "")
            lengths[c] = _number(path, lineno, c, v, "mean tokens per request, >= 1", minimum=1.0) if v else None
        slo = {}
        for c, what in SLO_COLUMNS.items():
            v = get.get(c, "")
            slo[c] = _number(path, lineno, c, v, f"{what}, > 0; leave it empty for the plan's", minimum=0.0,
                             positive=True) if v else None
        adapters.append(Adapter(aid, rank, rate, lengths["input_tokens"], lengths["output_tokens"],
                                get.get("path") or None, slo["max_ttft_s"], slo["max_tpot_ms"]))
    if not adapters:
        raise _fail(path, 2, None, "the file has a header but no adapters; add one row per adapter")
    if not any(a.rate_rps > 0 for a in adapters):
        raise _fail(path, None, "rate_rps", "is 0 for every adapter: there is no traffic to plan for")
    return Workload(tuple(adapters))


def _number(path, line, column, text, what, minimum, positive=False) -> float:
    try:
        v = float(text)
    except ValueError:
        raise _fail(path, line, column, f"'{text}' is not a number ({what})") from None
    if not math.isfinite(v) or v < minimum or positive and v <= 0:
        raise _fail(path, line, column, f"{text} is not valid ({what})")
    return v
