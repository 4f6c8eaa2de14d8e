"""`planner workload from-log` at scale: the compiled scanner reads lines as the json module does, logs are
counted as they stream (gzip, unsorted, several files), partial hours are rated over the time covered, and the
options and ranks are checked before a long read, which stops at the first model without a rank."""

from __future__ import annotations

import datetime as dt
import gzip
import json
import math
import random
import tracemalloc

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner import log_files
from planner.cli import main
from planner.log_ranks import Ranks
from planner.log_scan import Names, scan
from planner.traffic import json_line, read_logs
from planner.workload_csv import read_workload
from twin.errors import BadInputError

T0 = 1_733_000_000.0  # 20:53:20 UTC


def fast(line: bytes, litellm: bool = False):
    """What the scanner makes of one line: a record (time, model, prompt, completion), None (blank) or
    'exact' (left to the json path)."""
    names = Names()
    buf = np.frombuffer(line + b"\n", np.uint8)
    ids, off = np.zeros(1, np.int64), np.zeros(1, np.int64)
    t, p, c = np.zeros(1), np.zeros(1), np.zeros(1)
    fb_start, fb_end, done = np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(2, np.int64)
    scan(buf, 0, litellm, names.slots, names.hashes, names.start, names.length, names.store, names.state,
         ids, t, p, c, off, fb_start, fb_end, done)
    names.sync()
    if done[0]:
        return float(t[0]), names.text[int(ids[0])], float(p[0]), float(c[0])
    return "exact" if done[1] else None


def exact(line: bytes, litellm: bool = False):
    try:
        return json_line(line, "log:1", litellm)
    except BadInputError:
        return "error"


def same(a, b) -> bool:
    return len(a) == len(b) and all(x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))
                                    for x, y in zip(a, b))


def iso(t: float, rng: random.Random) -> str:
    stamp = dt.datetime.fromtimestamp(t, dt.UTC)
    text = stamp.isoformat(sep=rng.choice("T "), timespec=rng.choice(["seconds", "milliseconds", "microseconds",
                                                                       "minutes"]))
    return rng.choice([text, text.replace("+00:00", "Z"), text.replace("+00:00", ""), text.replace("+00:00", "+05:30"),
                       text.replace("+00:00", "-01:00"), text[:10]])


def value(rng: random.Random, depth: int = 0):
    """An arbitrary JSON value: nesting, escapes, non-ASCII, odd numbers."""
    kinds = ["int", "float", "str", "bool", "null"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, -1, 7, 2**53 + 1, 10**30, -(10**20)])
    if kind == "float":
        return rng.choice([0.5, -2.25e-30, 1e300, 3.14159, float(rng.random())])
    if kind == "str":
        return rng.choice(["", "plain", 'quo"te', "back\\slash", "tab\there", "é ü 中文", "\U0001f600", "\x00ctl",
                           "\u2028", "\ud800"[:0] + "x"])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["a", "b", "usage", "model", "x y"]): value(rng, depth + 1) for _ in range(rng.randrange(4))}


def record_line(seed: int) -> bytes:
    """A gateway or LiteLLM record: usual and unusual times, models, token counts, layouts and extra keys."""
    rng = random.Random(seed)
    t = T0 + rng.uniform(-1e6, 1e6)
    fields = []
    def pick(good: list, bad: list):
        return rng.choice(good if rng.random() < 0.85 else bad)

    time_key = rng.choice(["timestamp", "time", "created", "start_time", "startTime"])
    fields.append((time_key, pick([round(t, 3), int(t), t, int(t * 1000), round(t * 1000, 1), iso(t, rng),
                                   iso(t, rng), str(round(t, 3))],
                                  ["yesterday", -5, True, None, "1e400", " " + iso(t, rng), "2024-02-30T10:00:00",
                                   "2024-13-01", 1e-400, "0012", 2**64])))
    if rng.random() < 0.2:
        fields.append((rng.choice(["timestamp", "time", "startTime"]), rng.choice([round(t + 50, 3), iso(t, rng)])))
    model = pick(["adapter-12", "sql/gen", "a"], ["", "é-adapter", "a\u0062c", "x" * 300, "base model"])
    fields.append(("model", pick([model, "hosted_vllm/" + model], [None, 5])))
    if rng.random() < 0.5:
        fields.append(("model_group", pick([model, "", None, "group-7"], [3, False])))

    def tokens():
        return pick([812, 95, 0, 1e7, 12.5, None, 1.5e-7], [1e7 + 1, -3, "812", "", True, 2**60])

    where = rng.choice(["top", "usage", "both", "none", "usage-twice", "usage-not-dict"])
    usage = {k: tokens() for k in ("prompt_tokens", "completion_tokens") if rng.random() < 0.8}
    if where in ("top", "both"):
        fields += [(k, tokens()) for k in ("prompt_tokens", "completion_tokens") if rng.random() < 0.8]
    if where in ("usage", "both", "usage-twice"):
        fields.append(("usage", {**usage, **({"total_tokens": 5, "details": {"cached": [1, 2]}}
                                            if rng.random() < 0.5 else {})}))
    if where == "usage-twice":
        fields.append(("usage", rng.choice([{"prompt_tokens": 3}, 7, None])))
    if where == "usage-not-dict":
        fields.append(("usage", rng.choice([[1, 2], "x", 5])))
    fields += [(f"extra{k}", value(rng)) for k in range(rng.randrange(4))]
    rng.shuffle(fields)
    sep = rng.choice([(", ", ": "), (",", ":"), (" , ", " : ")])
    ascii_only = rng.random() < 0.5
    body = "{" + sep[0].join(json.dumps(k, ensure_ascii=ascii_only) + sep[1] + json.dumps(v, ensure_ascii=ascii_only)
                             for k, v in fields) + "}"
    pad = rng.choice(["", " ", "\t", "\r", " \r"])
    return (rng.choice(["", " "]) + body + pad).encode("utf-8", "surrogatepass")


def mutate(line: bytes, rng: random.Random) -> bytes:
    """The line with a few bytes changed, cut or duplicated: mostly broken JSON, which must be left alone."""
    b = bytearray(line)
    for _ in range(rng.randrange(1, 4)):
        if not b:
            break
        i = rng.randrange(len(b))
        op = rng.randrange(4)
        if op == 0:
            b[i] = rng.choice(b'{}[]",:0123456789.eE-+ \\tnulrf\x00\x80\xff\xc3')
        elif op == 1:
            del b[i]
        elif op == 2:
            b.insert(i, b[rng.randrange(len(b))])
        else:
            del b[i:]
    return bytes(b).replace(b"\n", b" ")


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32), st.booleans(), st.booleans())
def test_the_fast_path_reads_every_line_as_the_json_module_does(seed, litellm, mutated):
    """Random records (key orders, nested and repeated usage, epoch s/ms and ISO times, escapes, non-ASCII,
    odd numbers, extra values of any shape), and the same with bytes broken: whatever the scanner reads
    itself equals the json module's reading exactly; the rest it leaves to the json path."""
    line = record_line(seed)
    if mutated:
        line = mutate(line, random.Random(seed))
    got = fast(line, litellm)
    if got != "exact":
        want = exact(line, litellm)
        assert want is None if got is None else same(got, want), (line, got, want)


def test_the_fast_path_reads_the_usual_lines_itself():
    """Not a vacuous equivalence: the common shapes of a gateway's and LiteLLM's records never need json."""
    lines = [(b'{"timestamp": 1733000000.123, "model": "adapter-123", "usage": {"prompt_tokens": 812, '
             b'"completion_tokens": 95}}'),
             b'{"time":"2024-12-01T10:11:12.345Z","model":"sql/gen","prompt_tokens":812,"completion_tokens":null}',
             b'{"created": 1733000000123, "model": "a", "user": "\xc3\xa9", "messages": [{"role": "user"}]}',
             b'  {"start_time": "2024-12-01 10:11:12+05:30", "model": "a", "usage": {}}\r']
    for line in lines:
        got, want = fast(line), exact(line)
        assert got != "exact" and same(got, want), (line, got, want)
    spend = (b'{"request_id": "r1", "startTime": "2024-12-01T10:11:12.123456+00:00", "model": "hosted_vllm/a", '
             b'"model_group": "a", "prompt_tokens": 12, "completion_tokens": 3, "spend": 0.0}')
    assert fast(spend, True) == (dt.datetime(2024, 12, 1, 10, 11, 12, 123456, dt.UTC).timestamp(), "a", 12.0, 3.0)
    assert fast(b"   \t") is None and exact(b"   \t") is None


def _write_log(path, rows, opener=open) -> None:
    with opener(path, "wt") as f:
        f.writelines(json.dumps({"timestamp": t, "model": m, "usage": {"prompt_tokens": p, "completion_tokens": c}})
                     + "\n" for t, m, p, c in rows)


def _ranks(tmp_path, names=("a", "b")):
    path = tmp_path / "ranks.csv"
    path.write_text("adapter_id,rank\n" + "".join(f"{n},8\n" for n in names))
    return str(path)


def _from_log(tmp_path, *args):
    out = tmp_path / "w.csv"
    res = CliRunner().invoke(main, ["workload", "from-log", *map(str, args), "--out", str(out)])
    return res, out


def test_a_partial_hour_is_rated_over_the_time_the_log_covers(tmp_path):
    """Half an hour at exactly 1 req/s is 1 req/s (an hour's window over a full hour said 0.5); a log from
    20:53:20 to 22:30 at 2 req/s: the 6 min 40 s of the first hour join the next, the last half hour is rated
    over its half hour, every hour is 2 req/s."""
    log = tmp_path / "half-hour.jsonl"
    _write_log(log, [(T0 + 600 + k, "a", 100, 10) for k in range(1800)])
    res, out = _from_log(tmp_path, log, "--ranks", _ranks(tmp_path), "--quantile", "1")
    assert res.exit_code == 0, res.output
    assert read_workload(out).adapters[0].rate_rps == pytest.approx(1.0, rel=0.002)
    rows = [(T0 + k * 0.5, "a", 100, 10) for k in range(int((22.5 * 3600 - (T0 % 86400)) * 2))]
    _write_log(log, rows)
    traffic = read_logs([log])
    series = traffic.series()
    assert series.start == (T0 // 3600 + 1) * 3600 and series.rates.shape == (1, 2)
    assert series.rates[0] == pytest.approx([2.0, 2.0], rel=0.001)


def test_a_log_of_a_few_seconds_is_refused_not_blown_up(tmp_path):
    log = tmp_path / "short.jsonl"
    _write_log(log, [(T0, "a", 1, 1), (T0 + 0.001, "a", 1, 1)])
    res, _ = _from_log(tmp_path, log, "--ranks", _ranks(tmp_path))
    assert res.exit_code == 2 and "a rate needs at least 60 s of log" in res.output, res.output


def test_gzip_unsorted_and_several_logs_count_as_one_sorted_log(tmp_path):
    rng = random.Random(1)
    rows = [(T0 + rng.uniform(0, 3 * 86400), rng.choice("ab"), rng.randrange(1, 900), rng.randrange(1, 200))
            for _ in range(20000)]
    _write_log(tmp_path / "sorted.jsonl", sorted(rows))
    shuffled = rows[:]
    rng.shuffle(shuffled)
    _write_log(tmp_path / "part-1.jsonl.gz", shuffled[:12000], gzip.open)
    _write_log(tmp_path / "part-2.log", shuffled[12000:], gzip.open)  # gzip told by its bytes, not its name
    whole = read_logs([tmp_path / "sorted.jsonl"])
    parts = read_logs([tmp_path / "part-1.jsonl.gz", tmp_path / "part-2.log"])
    assert parts.adapters == whole.adapters == ["a", "b"] and parts.requests == whole.requests == 20000
    assert (parts.counts == whole.counts).all() and parts.start == whole.start
    assert (parts.first, parts.last) == (whole.first, whole.last)
    assert np.allclose(parts.sums, whole.sums, rtol=1e-12)
    res, out = _from_log(tmp_path, tmp_path / "part-1.jsonl.gz", tmp_path / "part-2.log", "--ranks", _ranks(tmp_path))
    assert res.exit_code == 0 and len(read_workload(out).adapters) == 2, res.output


def test_the_reader_holds_counts_not_requests(tmp_path, monkeypatch):
    """Memory is bounded by the chunk read and the counts kept, not by the log: with 64 KiB chunks, reading
    a log ten times longer (same hours, same models) peaks no higher, and what it returns is sized by models
    and hours."""
    monkeypatch.setattr(log_files, "CHUNK", 1 << 16)
    peaks, shapes = [], []
    read_logs([_synthetic(tmp_path / "warm.jsonl", 1000)])  # compile first
    for n in (20_000, 200_000):
        log = _synthetic(tmp_path / f"{n}.jsonl", n)
        tracemalloc.start()
        traffic = read_logs([log])
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        shapes.append(traffic.counts.shape)
        assert traffic.requests == n
    assert shapes[0] == shapes[1] == (50, 25)
    assert peaks[1] < 1.5 * peaks[0] + (1 << 20) and peaks[1] < 16 << 20, peaks  # the log itself is 20 MB


def _synthetic(path, n: int):
    rng = np.random.default_rng(n)
    t = T0 + np.sort(rng.uniform(0, 86400, n))
    models = rng.integers(0, 50, n)
    with open(path, "w") as f:
        f.writelines(f'{{"timestamp": {x:.3f}, "model": "adapter-{m}", "usage": {{"prompt_tokens": 812, '
                     f'"completion_tokens": 95}}}}\n' for x, m in zip(t, models))
    return path


def test_default_rank_without_a_base_model_is_refused(tmp_path):
    """--default-rank alone would plan the base model's own requests as an adapter of that rank; with
    --base-model NAME they are left out, with --base-model none the logs are said to name adapters only."""
    log = tmp_path / "gw.jsonl"
    base = "meta-llama/Llama-3.1-8B-Instruct"
    _write_log(log, [(T0 + k, m, 10, 10) for k in range(600) for m in ("a", base)])
    res, out = _from_log(tmp_path, log, "--default-rank", "16")
    assert res.exit_code == 2 and "--base-model" in res.output and not out.exists(), res.output
    res, out = _from_log(tmp_path, log, "--default-rank", "16", "--base-model", base)
    assert res.exit_code == 0 and [a.adapter_id for a in read_workload(out).adapters] == ["a"], res.output
    res, out = _from_log(tmp_path, log, "--default-rank", "16", "--base-model", "none")  # the user's word for it
    assert res.exit_code == 0 and len(read_workload(out).adapters) == 2, res.output
    res, out = _from_log(tmp_path, log, "--ranks", _ranks(tmp_path))
    assert res.exit_code == 2 and f"--base-model {base}" in res.output, res.output


def test_a_model_without_a_rank_stops_the_read_at_its_line(tmp_path, monkeypatch):
    """Line 3 names an adapter --ranks does not, line 100,000 is garbage: the error is the rank's, naming
    line 3, and the read stops in the first chunk; options are checked before any log is opened."""
    rows = [(T0 + k, "a", 10, 10) for k in range(100_000)]
    rows[2] = (T0 + 2, "unranked", 10, 10)
    log = tmp_path / "gw.jsonl"
    _write_log(log, rows)
    with log.open("a") as f:
        f.write("{garbage\n")
    monkeypatch.setattr(log_files, "CHUNK", 1 << 16)
    res, _ = _from_log(tmp_path, log, "--ranks", _ranks(tmp_path))
    assert res.exit_code == 2 and "gw.jsonl:3: no rank for the adapter 'unranked'" in res.output, res.output
    chunks = []

    def counted(*args):
        for chunk in log_files.line_chunks(*args):
            chunks.append(chunk)
            yield chunk

    monkeypatch.setattr("planner.traffic.line_chunks", counted)
    with pytest.raises(BadInputError, match="no rank"):
        read_logs([log], ranks=Ranks({"a": (8, None)}, None, None))
    assert len(chunks) == 1
    res, _ = _from_log(tmp_path, log, "--ranks", tmp_path / "missing.csv")
    assert res.exit_code == 2 and "missing.csv" in res.output


@pytest.mark.parametrize("content, message", [
    (b'{"timestamp": 1733000000, "model": "a"}\n' + b"x" * (70 << 10), "log.jsonl:2: a line longer than"),
    (b'{"timestamp": 1733000000, "model": "a"}\n{"timestamp": 1e12000, "model": "a"}\n', "log.jsonl:2: the time"),
    (b'{"timestamp": 1733000000, "model": "a"}\n' * 3 + b'{"timestamp": 4000000000, "model": "a"}\n',
     "log.jsonl:4: the time 2096-10-02T07:06:40 would make the logs span too long"),
    (b"\x1f\x8b\x08\x00garbage", "cannot read the log"),
    (b'{"timestamp": 1733000000, "model": "a", "prompt_tokens": 1' + b"0" * 400 + b"}\n", "not a token count"),
    (b'{"timestamp": 1733000000, "model": "a\\u0000"}\n', "is not an adapter id"),
])
def test_hostile_logs_are_one_line_errors_naming_the_line(tmp_path, monkeypatch, content, message):
    monkeypatch.setattr(log_files, "CHUNK", 1 << 16)
    monkeypatch.setattr(log_files, "MAX_LINE", 1 << 16)
    monkeypatch.setattr("planner.log_tally.MAX_CELLS", 1 << 12)
    log = tmp_path / "log.jsonl"
    log.write_bytes(content)
    res, out = _from_log(tmp_path, log, "--ranks", _ranks(tmp_path))
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and message in res.output and len(lines) == 1, res.output
    assert not out.exists()
