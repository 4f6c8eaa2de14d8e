"""The traffic readers and the outputs against hostile sources, as tests/test_hostile_inputs.py does for files.

A Prometheus server (a real HTTP server on 127.0.0.1) answers anything: JSON of any shape and type, +Inf and
NaN samples, slow, endless or non-HTTP answers; logs hold any line; --out names a device, a FIFO or a symlink;
float options get nan and inf. Every refusal is exit 2 with one line, no traceback, and nothing written; the
load generator's records and the reproducers that need no server are cases of tests/hostile_cases.py.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path

import click
import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import prometheus_source
from planner.cli import main
from planner.cli_common import FiniteFloat
from planner.replan import exclusive
from planner.workload_csv import read_workload
from tests.hostile_cases import GOOD_CSV, base_plan

END = 1_733_000_400.0  # --end of every query: the grid is END - 3600 k
STEPS = 3


def refused(res, out: Path, fragment: str = "") -> None:
    """Exit 2, one line of error naming ``fragment``, no traceback, ``out`` not written."""
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2, (res.exit_code, res.output[-500:], repr(res.exception))
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.output, res.output
    assert fragment in res.output, res.output
    assert not out.exists()


class _Handler(http.server.BaseHTTPRequestHandler):
    """Answers every GET as the server's ``answer`` does: bytes (a 200 with that body) or a function of the
    handler."""

    def do_GET(self) -> None:
        self.server.queries.append(self.path)
        answer = self.server.answer
        if callable(answer):
            answer(self)
        else:
            send(self, answer)

    def log_message(self, *args) -> None:
        pass


def send(handler, body: bytes, status: int = 200) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """Quiet: a client that gave up (as it should) breaks a slow answer, and CliRunner would read the trace."""


@pytest.fixture(scope="module")
def prometheus():
    server = _Server(("127.0.0.1", 0), _Handler)
    server.answer, server.queries = b"", []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def from_prometheus(server, out: Path, *extra: str):
    server.queries.clear()
    return CliRunner().invoke(main, [
        "workload", "from-prometheus", f"http://127.0.0.1:{server.server_port}", "--requests-query",
        "sum by (model) (rate(requests_total[1h]))", "--default-rank", "8", "--base-model", "none", "--range",
        f"{STEPS}h", "--step", "1h", "--end", str(END), "--timeout", "2", "--out", str(out), *extra])


def matrix(rates: dict[str, list], status: str = "success", result_type: str = "matrix") -> dict:
    """An answer of query_range: per adapter its samples on the grid, oldest first."""
    return {"status": status, "data": {"resultType": result_type, "result": [
        {"metric": {"model": name}, "values": [[END - 3600 * (len(v) - 1 - k), x] for k, x in enumerate(v)]}
        for name, v in rates.items()]}}


def body(doc) -> bytes:
    return doc if isinstance(doc, bytes) else json.dumps(doc).encode()


def test_a_good_answer_is_read(prometheus, tmp_path):
    prometheus.answer = body(matrix({"a": ["0.5", "1", "0.75"], "b": ["0", "0.25", "0.5"]}))
    res = from_prometheus(prometheus, tmp_path / "w.csv", "--method", "quantile", "--quantile", "1")
    assert res.exit_code == 0, res.output
    assert {a.adapter_id: a.rate_rps for a in read_workload(tmp_path / "w.csv").adapters} == {"a": 1.0, "b": 0.5}


GOOD = matrix({"a": ["0.5", "1", "0.75"]})
BAD_ANSWERS = {
    "a-string": "the answer",
    "a-list": [GOOD],
    "a-number": 42,
    "data-a-string": {"status": "success", "data": "matrix"},
    "data-a-list": {"status": "success", "data": [GOOD["data"]]},
    "result-a-dict": {"status": "success", "data": {"resultType": "matrix", "result": {"a": 1}}},
    "result-a-string": {"status": "success", "data": {"resultType": "matrix", "result": "a"}},
    "series-a-number": {"status": "success", "data": {"resultType": "matrix", "result": [7]}},
    "metric-a-list": {"status": "success", "data": {"resultType": "matrix", "result": [{"metric": ["a"],
                                                                                        "values": []}]}},
    "values-a-number": {"status": "success", "data": {"resultType": "matrix", "result": [{"metric": {"model": "a"},
                                                                                          "values": 5}]}},
    "sample-of-three": {"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": {"model": "a"}, "values": [[END, "1", "2"]]}]}},
    "value-plus-inf": matrix({"a": ["0.5", "+Inf", "1"]}),
    "value-minus-inf": matrix({"a": ["-Inf", "1", "1"]}),
    "value-nan": matrix({"a": ["NaN", "1", "1"]}),
    "value-a-word": matrix({"a": ["lots", "1", "1"]}),
    "value-negative": matrix({"a": ["-1", "1", "1"]}),
    "value-1e400": matrix({"a": ["1e400", "1", "1"]}),
    "time-inf": b'{"status": "success", "data": {"resultType": "matrix", "result": [{"metric": {"model": "a"}, '
                b'"values": [[1e999, "1"]]}]}}',
    "time-a-list": {"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": {"model": "a"}, "values": [[[END], "1"]]}]}},
    "vector": {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"model": "a"}, "value": [END, "1"]}]}},
    "matrix-of-vector-series": {"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": {"model": "a"}, "value": [END, "1"]}]}},
    "scalar": {"status": "success", "data": {"resultType": "scalar", "result": [END, "1"]}},
    "status-error": {"status": "error", "errorType": "bad_data", "error": "parse error at char 4"},
    "status-missing": {"data": GOOD["data"]},
    "not-json": b"<html>Prometheus</html>",
    "deeply-nested": b"[" * 100_000 + b"]" * 100_000,
    "empty": b"",
    "label-1M-chars": matrix({"m" * 1_000_000: ["1", "1", "1"]}),
    "label-with-newline": matrix({"a\nb": ["1", "1", "1"]}),
}


@pytest.mark.parametrize("name", BAD_ANSWERS)
def test_a_bad_answer_is_exit_2(prometheus, tmp_path, name):
    prometheus.answer = body(BAD_ANSWERS[name])
    refused(from_prometheus(prometheus, tmp_path / "w.csv"), tmp_path / "w.csv", "Prometheus" if "label" not in name
            else "")


def test_an_http_error_is_exit_2_with_the_servers_words(prometheus, tmp_path):
    prometheus.answer = lambda h: send(h, b'{"status":"error","error":"bad query\\nat 3"}' + b" " * 10_000, 400)
    refused(from_prometheus(prometheus, tmp_path / "w.csv"), tmp_path / "w.csv", "HTTP 400")


def test_an_answer_that_is_not_http_is_exit_2(prometheus, tmp_path):
    prometheus.answer = lambda h: h.wfile.write(b"SSH-2.0-OpenSSH\r\n\r\n")
    refused(from_prometheus(prometheus, tmp_path / "w.csv"), tmp_path / "w.csv", "cannot reach Prometheus")


@pytest.mark.parametrize("how", ["silent", "trickle"])
def test_a_slow_server_is_exit_2_within_the_timeout(prometheus, tmp_path, how):
    """No answer, or one byte at a time (each within a socket's timeout): the whole answer must come in time."""
    def trickle(h) -> None:
        h.send_response(200)
        h.send_header("Content-Length", "1000")
        h.end_headers()
        for _ in range(40):
            h.wfile.write(b" ")
            h.wfile.flush()
            time.sleep(0.1)

    prometheus.answer = (lambda h: time.sleep(4)) if how == "silent" else trickle
    t0 = time.monotonic()
    res = from_prometheus(prometheus, tmp_path / "w.csv", "--timeout", "0.5")
    assert time.monotonic() - t0 < 3
    refused(res, tmp_path / "w.csv", "did not answer")


def test_an_endless_answer_is_cut_at_the_cap(prometheus, tmp_path, monkeypatch):
    monkeypatch.setattr(prometheus_source, "MAX_RESPONSE_BYTES", 1 << 20)

    def endless(h) -> None:
        h.send_response(200)
        h.end_headers()
        h.wfile.write(b'{"status": "success", "data": {"resultType": "matrix", "result": [')
        try:
            for _ in range(1000):  # 64 MiB, if the client read it all
                h.wfile.write(b'{"metric": {"model": "a"}, "values": []},' * 1600)
        except OSError:  # the client has gone
            pass

    prometheus.answer = endless
    refused(from_prometheus(prometheus, tmp_path / "w.csv"), tmp_path / "w.csv", "over 1,048,576 bytes")


def test_an_unreachable_server_is_exit_2_naming_the_url(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    res = CliRunner().invoke(main, ["workload", "from-prometheus", f"http://127.0.0.1:{port}", "--requests-query", "x",
                                    "--default-rank", "8", "--base-model", "none", "--out", str(tmp_path / "w.csv")])
    refused(res, tmp_path / "w.csv", f"cannot reach Prometheus at http://127.0.0.1:{port}")


@pytest.mark.parametrize("args, fragment", [
    (("--range", "100000d", "--step", "1s"), "Prometheus answers at most 11,000"),
    (("--range", "infd"), "not a positive finite duration"),
    (("--step", "nans"), "not a positive finite duration"),
    (("--end", "inf"), "not a finite number"),
    (("--timeout", "nan"), "not a finite number"),
])
def test_a_query_too_large_or_unbounded_is_refused_before_it_is_sent(prometheus, tmp_path, args, fragment):
    prometheus.answer = body(GOOD)
    refused(from_prometheus(prometheus, tmp_path / "w.csv", *args), tmp_path / "w.csv", fragment)
    assert prometheus.queries == []


def test_series_beyond_the_cells_held_are_refused(prometheus, tmp_path, monkeypatch):
    monkeypatch.setattr(prometheus_source, "MAX_CELLS", 2 * STEPS)
    prometheus.answer = body(matrix({n: ["1", "1", "1"] for n in ("a", "b", "c")}))
    refused(from_prometheus(prometheus, tmp_path / "w.csv"), tmp_path / "w.csv", "3 series of 3 samples")


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)
SAMPLE = st.lists(st.one_of(st.sampled_from([END, END - 3600, END - 7200]), st.floats(), st.integers(), JSON),
                  min_size=2, max_size=2).map(lambda s: [s[0], s[1]]) | st.tuples(
    st.sampled_from([END, END - 3600, END - 7200]),
    st.sampled_from(["0.5", "1", "0", "NaN", "+Inf", "-Inf", "-1", "1e400", "", "x"]) | st.floats().map(str)).map(list)
SERIES = st.fixed_dictionaries({
    "metric": st.dictionaries(st.sampled_from(["model", "job"]), st.sampled_from(["a", "b", "x/y"]) | st.text(
        max_size=6), max_size=2) | JSON,
    "values": st.lists(SAMPLE, max_size=4) | JSON})
ANSWER = st.one_of(JSON, st.binary(max_size=60), st.fixed_dictionaries({
    "status": st.sampled_from(["success", "error"]) | JSON,
    "data": st.fixed_dictionaries({"resultType": st.sampled_from(["matrix", "vector", "scalar"]) | JSON,
                                   "result": st.lists(SERIES, max_size=3) | JSON}) | JSON}))


@settings(max_examples=150, deadline=None)
@given(ANSWER)
def test_any_answer_reads_or_is_exit_2(prometheus, answer):
    prometheus.answer = answer if isinstance(answer, bytes) else json.dumps(answer).encode()  # NaN, Infinity too
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "w.csv"
        res = from_prometheus(prometheus, out)
        if res.exit_code == 0:
            assert read_workload(out).adapters
        else:
            refused(res, out)


RECORD = st.fixed_dictionaries({
    "timestamp": st.one_of(st.floats(), st.integers(min_value=-10**30, max_value=10**30), st.text(max_size=25),
                           st.sampled_from([1733000000, 1733003600.5, "2024-12-01T10:00:00Z", "9999-12-31T23:59:59",
                                            1e300, 99999999999, 1733000000000])),
    "model": st.sampled_from(["a", "b", "x/y"]) | st.text(max_size=12),
    "prompt_tokens": st.one_of(st.none(), st.integers(-5, 10**9), st.floats(), st.text(max_size=5))})
LINE = st.one_of(RECORD.map(lambda r: json.dumps(r).encode()), st.binary(max_size=40))


@settings(max_examples=150, deadline=None)
@given(st.lists(LINE, min_size=1, max_size=6), st.sampled_from(["jsonl", "csv"]))
def test_any_log_reads_or_is_exit_2(lines, fmt):
    good = b"".join(json.dumps({"timestamp": 1733000000 + 60 * k, "model": "a"}).encode() + b"\n" for k in range(60))
    with tempfile.TemporaryDirectory() as tmp:
        log, out = Path(tmp) / f"log.{fmt}", Path(tmp) / "w.csv"
        if fmt == "csv":
            log.write_bytes(b"timestamp,model,prompt_tokens\n" + b"".join(
                b",".join(str(v).encode() for v in json.loads(line).values()) + b"\n" if line.startswith(b"{")
                else line + b"\n" for line in lines))
        else:
            log.write_bytes(good + b"\n".join(lines) + b"\n")
        res = CliRunner().invoke(main, ["workload", "from-log", str(log), "--default-rank", "8", "--base-model",
                                        "none", "--out", str(out)])
        if res.exit_code == 0:  # a workload (whose rates may all be 0: a stray time of 1970 spreads the hours)
            assert out.read_text().startswith("adapter_id,rank,rate_rps,")
        else:
            refused(res, out)


def _loadgen(path: Path, adapters: list[str]) -> Path:
    from serving_harness.loadgen import RunRecords

    n = len(adapters)
    RunRecords(request=np.arange(n), adapter=np.array(adapters, dtype=object), arrival_s=np.arange(n, dtype=float),
               sent_s=np.arange(n, dtype=float), first_token_s=np.full(n, np.nan), finish_s=np.full(n, np.nan),
               input_tokens=np.full(n, 100.0), output_tokens=np.full(n, 20.0), output_tokens_received=np.full(n, 20.0),
               error=np.array([""] * n, dtype=object)).to_parquet(path)
    return path


def test_a_long_model_name_in_load_generator_records_is_exit_2_at_its_request(tmp_path, monkeypatch):
    """10,000 requests, one of a model named with 1M characters: a fixed-width copy of every name was 37 GiB."""
    names = [f"a{k % 7}" for k in range(10_000)]
    names[5000] = "m" * 1_000_000
    log = _loadgen(tmp_path / "run.parquet", names)
    out = tmp_path / "w.csv"
    argv = ["workload", "from-log", str(log), "--default-rank", "8", "--base-model", "none", "--start", "1733000000",
            "--out", str(out)]
    refused(CliRunner().invoke(main, argv), out, "request 5001: the model is 1000000 characters long")
    monkeypatch.setattr("planner.traffic.MAX_LOADGEN_BYTES", 1000)
    refused(CliRunner().invoke(main, argv), out, "too large for the load generator's records (over 1,000 bytes)")


@pytest.mark.parametrize("device", ["/dev/full", "/dev/null"])
@pytest.mark.parametrize("command", ["plan", "replan", "from-log", "from-prometheus"])
def test_a_device_as_out_is_exit_2_and_stays_a_device(prometheus, tmp_path, monkeypatch, command, device):
    """As root, a write renamed over /dev/full would replace the device with a file; every --out refuses it."""
    before = os.stat(device)  # Linux has both devices
    monkeypatch.chdir(tmp_path)
    (tmp_path / "good.csv").write_text(GOOD_CSV)
    (tmp_path / "base.json").write_text(base_plan())
    (tmp_path / "log.jsonl").write_text("".join(json.dumps({"timestamp": 1733000000 + 60 * k, "model": "a"}) + "\n"
                                                for k in range(100)))
    prometheus.answer = body(GOOD)
    argv = {"plan": ["plan", "good.csv"], "replan": ["replan", "good.csv", "--previous", "base.json"],
            "from-log": ["workload", "from-log", "log.jsonl", "--default-rank", "8", "--base-model", "none"],
            "from-prometheus": ["workload", "from-prometheus", f"http://127.0.0.1:{prometheus.server_port}",
                                "--requests-query", "q", "--default-rank", "8", "--base-model", "none"]}[command]
    res = CliRunner().invoke(main, [*argv, "--out", device])
    refused(res, tmp_path / "nothing", "is a character device")
    after = os.stat(device)
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev
    assert not [p.name for p in Path("/dev").glob(f".{Path(device).name}.*")]  # no temporary file left there


def test_out_through_a_symlink_replaces_the_real_file_and_keeps_the_link(tmp_path):
    """The link stays a link, the file it names is the plan; a dangling link's target is made."""
    (tmp_path / "good.csv").write_text(GOOD_CSV)
    real, link, dangling = tmp_path / "real.json", tmp_path / "current.json", tmp_path / "next.json"
    real.write_text("old")
    link.symlink_to(real.name)
    dangling.symlink_to("made.json")
    for out, target in ((link, real), (dangling, tmp_path / "made.json")):
        res = CliRunner().invoke(main, ["plan", str(tmp_path / "good.csv"), "--out", str(out), "--jobs", "1"])
        assert res.exit_code == 0, res.output
        assert out.is_symlink() and json.loads(target.read_text())["instances"]


def test_replan_through_a_symlink_locks_and_writes_the_same_real_file(tmp_path):
    (tmp_path / "good.csv").write_text(GOOD_CSV)
    real, link = tmp_path / "plan.json", tmp_path / "current.json"
    real.write_text(base_plan())
    link.symlink_to(real.name)
    with exclusive(link):
        assert (tmp_path / "plan.json.lock").is_file() and not (tmp_path / "current.json.lock").exists()
    res = CliRunner().invoke(main, ["replan", str(tmp_path / "good.csv"), "--previous", str(real), "--out", str(link),
                                    "--jobs", "1"])
    assert res.exit_code == 0, res.output
    assert link.is_symlink() and json.loads(real.read_text())["changes"] is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current.json", "good.csv", "plan.json"]


def test_a_symlink_planted_at_the_lock_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "plan.json.lock").symlink_to(victim)
    with pytest.raises(Exception, match="is a symbolic link") as err, exclusive(tmp_path / "plan.json"):
        pass
    assert err.value.exit_code == 2 and victim.read_text() == "keep me"


def _commands(group: click.Group, path: tuple[str, ...] = ()):
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))
        else:
            yield " ".join((*path, name)), command


def test_every_float_option_of_every_command_refuses_nan_and_inf():
    floats = [(name, p.name, p.type) for name, command in _commands(main) for p in command.params
              if isinstance(p.type, click.types.FloatParamType)]
    assert len(floats) >= 30
    assert [(name, option) for name, option, kind in floats if not isinstance(kind, FiniteFloat)] == []
    for _, _, kind in floats:
        for text in ("nan", "inf", "-inf", "1e400"):
            with pytest.raises(click.BadParameter, match="not a finite number"):
                kind.convert(text, None, None)
    assert FiniteFloat(0, 1, min_open=True).convert("0.5", None, None) == 0.5
    with pytest.raises(click.BadParameter, match="not in the range"):
        FiniteFloat(0, 1, min_open=True).convert("0", None, None)
    assert np.isfinite(FiniteFloat().convert("-1e300", None, None))
