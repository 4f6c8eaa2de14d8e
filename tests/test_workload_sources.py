"""Tomorrow's workload from observed traffic: the forecast, the log readers, Prometheus (a real server)."""

from __future__ import annotations

import csv
import json
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import needs_program

from planner.cli import main
from planner.forecast import DAY, HOUR, Series, forecast
from planner.workload_csv import read_workload
from tests.synthetic_traffic import hourly_counts, requests, true_peak

BASE = np.array([0.5, 1.0, 2.0, 4.0])


@pytest.mark.parametrize("days, weekend", [(9, False), (12, True)])
def test_the_seasonal_forecast_recovers_tomorrows_peak(days, weekend):
    """Nine (twelve) days of hourly counts of a daily and weekly cycle: the next day is a weekday (a weekend
    day); the seasonal forecast finds each adapter's peak within 8 %; the busiest hour of the past week
    (quantile 1) over-plans the weekend by the weekday/weekend ratio."""
    counts, start = hourly_counts(BASE, days, seed=3)
    series = Series([f"a{k}" for k in range(len(BASE))], counts / HOUR, start, HOUR)
    truth = true_peak(BASE, start + days * DAY, 24)
    rates, method = forecast(series, "next-day")
    assert method == "seasonal"
    error = np.abs(rates / truth - 1.0)
    assert error.max() < 0.08, (rates, truth)
    busiest, _ = forecast(series, "next-day", "quantile", 1.0)
    assert (busiest >= 0.95 * truth).all()
    if weekend:
        assert (busiest > 1.4 * truth).all()  # planned for a weekday on a weekend day


def test_short_history_falls_back_to_the_quantile_and_next_hour_uses_the_last_day():
    counts, start = hourly_counts(BASE, 3, seed=4)
    series = Series(["a", "b", "c", "d"], counts / HOUR, start, HOUR)
    assert forecast(series, "next-day")[1] == "quantile"
    rates, method = forecast(series, "next-hour", "seasonal")
    assert method == "seasonal" and rates.shape == (4,)
    truth = BASE * np.array([(series.rates[k, -24] / BASE[k]) for k in range(4)])  # the same hour yesterday
    assert np.allclose(rates, truth, rtol=0.3)


NAMES = ["support-bot", "legal/summariser", "code-review", "sql-gen"]


def _log(tmp_path: Path, fmt: str, base=BASE / 20, days=1.0) -> Path:
    rows = requests(base, days, seed=5, names=NAMES)
    if fmt == "jsonl":
        path = tmp_path / "gateway.jsonl"
        path.write_text("".join(json.dumps({"timestamp": t, "model": m, "usage": {"prompt_tokens": p,
                                                                                  "completion_tokens": c}}) + "\n"
                                for t, m, p, c in rows) + json.dumps({"timestamp": rows[0][0], "model": "base-llama",
                                                                      "prompt_tokens": 10, "completion_tokens": 10}))
    elif fmt == "csv":
        path = tmp_path / "gateway.csv"
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["timestamp", "model", "prompt_tokens", "completion_tokens"])
            import datetime as dt

            w.writerows([(dt.datetime.fromtimestamp(t, dt.UTC).isoformat(), m, p, c) for t, m, p, c in rows])
    elif fmt == "litellm":
        path = tmp_path / "spend-logs.json"
        import datetime as dt

        path.write_text(json.dumps([{"request_id": f"r{k}", "startTime": dt.datetime.fromtimestamp(t, dt.UTC).isoformat(),
                                     "model": f"hosted_vllm/{m}", "model_group": m, "prompt_tokens": p,
                                     "completion_tokens": c, "total_tokens": p + c, "api_base": "http://vllm:8000"}
                                    for k, (t, m, p, c) in enumerate(rows)]))
    else:
        from serving_harness.loadgen import RunRecords

        path = tmp_path / "run.requests.parquet"
        n = len(rows)
        t0 = rows[0][0]
        RunRecords(request=np.arange(n), adapter=np.array([r[1] for r in rows], dtype=object),
                   arrival_s=np.array([r[0] - t0 for r in rows]), sent_s=np.array([r[0] - t0 for r in rows]),
                   first_token_s=np.full(n, np.nan), finish_s=np.full(n, np.nan),
                   input_tokens=np.array([r[2] for r in rows], float), output_tokens=np.array([r[3] for r in rows], float),
                   output_tokens_received=np.array([r[3] for r in rows], float),
                   error=np.array([""] * n, dtype=object)).to_parquet(path)
    return path


def _ranks(tmp_path: Path) -> Path:
    path = tmp_path / "adapters.csv"
    path.write_text("adapter_id,rank,path\n" + "".join(f"{n},{[8, 16, 32, 8][k]},/srv/{n}\n" for k, n in enumerate(NAMES)))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "litellm", "loadgen"])
def test_from_log_writes_a_workload_that_plans(tmp_path, fmt):
    log = _log(tmp_path, fmt)
    out = tmp_path / "next-day.csv"
    args = ["workload", "from-log", str(log), "--ranks", str(_ranks(tmp_path)), "--out", str(out), "--quantile", "1"]
    if fmt == "jsonl":
        args += ["--base-model", "base-llama"]
    if fmt == "litellm":
        args += ["--format", "litellm"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    wl = read_workload(out)
    by_id = {a.adapter_id: a for a in wl.adapters}
    assert set(by_id) == set(NAMES) and by_id["legal/summariser"].rank == 16 and by_id["sql-gen"].path == "/srv/sql-gen"
    rows = {r["adapter_id"]: r for r in csv.DictReader(out.open())}
    for k, name in enumerate(NAMES):  # the busiest hour of the day: the daily peak, Poisson noise aside
        assert 0.7 < by_id[name].rate_rps / (BASE[k] / 20 * 1.6) < 1.3
        assert 250 < by_id[name].input_tokens < 350 and 120 < by_id[name].output_tokens < 180
        assert float(rows[name]["input_tokens_cv"]) == pytest.approx(0.5, abs=0.1)
        assert rows[name]["rate_method"] == "quantile" and float(rows[name]["requests_observed"]) > 100
    assert CliRunner().invoke(main, ["plan", str(out)]).exit_code == 0


@pytest.mark.parametrize("content, message", [
    ('{"timestamp": 1, "model": "a", "prompt_tokens": 1}\n{nope\n', "log.jsonl:2: not a JSON record"),
    ('{"timestamp": "yesterday", "model": "a"}\n', "not an ISO 8601 time"),
    ('{"model": "a", "prompt_tokens": 3}\n', "has no time"),
    ('{"timestamp": 5, "model": "../x"}\n', "log.jsonl:1: '../x' is not an adapter id"),
    ('{"timestamp": 5, "model": "a", "prompt_tokens": -3}\n', "not a token count"),
    ('{"timestamp": 5, "model": "a"}\n{"timestamp": 5, "model": "unranked"}\n', "log.jsonl:2: no rank for the adapter 'unranked'"),
    ("", "log.jsonl: no request for an adapter in the log"),
])
def test_bad_logs_are_one_line_errors(tmp_path, content, message):
    log = tmp_path / "log.jsonl"
    log.write_text(content)
    ranks = tmp_path / "r.csv"
    ranks.write_text("adapter_id,rank\na,8\n")
    res = CliRunner().invoke(main, ["workload", "from-log", str(log), "--ranks", str(ranks), "--out",
                                    str(tmp_path / "w.csv")])
    assert res.exit_code == 2 and message in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "w.csv").exists()


def test_a_log_given_twice_is_refused_rather_than_counted_twice(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"timestamp": 5, "model": "a"}\n{"timestamp": 3605, "model": "a"}\n')
    res = CliRunner().invoke(main, ["workload", "from-log", str(log), str(tmp_path / "." / "log.jsonl"), "--out",
                                    str(tmp_path / "w.csv")])
    assert res.exit_code == 2 and "given again" in res.output, res.output
    assert not (tmp_path / "w.csv").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prometheus_binary():
    """Debian's Prometheus server (.ci/run installs it where it is missing)."""
    return needs_program("prometheus")


RATES = {"support-bot": 6.0, "sql-gen": 2.0}  # req/s the exporter counts
TOKENS = {"support-bot": (300, 100), "sql-gen": (800, 40)}  # prompt, completion tokens per request


def test_from_prometheus_reads_a_real_server_scraping_a_real_exporter(tmp_path, prometheus_binary):
    from prometheus_client import CollectorRegistry, Counter, start_http_server

    registry = CollectorRegistry()
    reqs = Counter("router_requests", "requests per adapter", ["model"], registry=registry)
    prompt = Counter("router_prompt_tokens", "prompt tokens per adapter", ["model"], registry=registry)
    completion = Counter("router_completion_tokens", "completion tokens per adapter", ["model"], registry=registry)
    exporter_port = _free_port()
    server, _thread = start_http_server(exporter_port, addr="127.0.0.1", registry=registry)
    stop = threading.Event()

    def traffic():
        tick = 0.05
        while not stop.wait(tick):
            for name, rate in RATES.items():
                reqs.labels(name).inc(rate * tick)
                prompt.labels(name).inc(rate * tick * TOKENS[name][0])
                completion.labels(name).inc(rate * tick * TOKENS[name][1])

    threading.Thread(target=traffic, daemon=True).start()
    config = tmp_path / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: router\n    static_configs:\n"
                      f"      - targets: ['127.0.0.1:{exporter_port}']\n")
    port = _free_port()
    prom = subprocess.Popen([prometheus_binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        time.sleep(25)  # about 25 scrapes
        out = tmp_path / "w.csv"
        ranks = tmp_path / "r.csv"
        ranks.write_text("adapter_id,rank\nsupport-bot,16\nsql-gen,8\n")
        res = CliRunner().invoke(main, [
            "workload", "from-prometheus", f"http://127.0.0.1:{port}", "--label", "model",
            "--requests-query", "sum by (model) (rate(router_requests_total[5s]))",
            "--prompt-tokens-query", "sum by (model) (rate(router_prompt_tokens_total[5s]))",
            "--completion-tokens-query", "sum by (model) (rate(router_completion_tokens_total[5s]))",
            "--range", "12s", "--step", "1s", "--end", str(time.time() - 2), "--method", "quantile", "--quantile", "0.5",
            "--window", "12s", "--for", "next-hour", "--ranks", str(ranks), "--out", str(out)])
        assert res.exit_code == 0, res.output
        wl = {a.adapter_id: a for a in read_workload(out).adapters}
        assert set(wl) == set(RATES)
        for name, rate in RATES.items():
            assert wl[name].rate_rps == pytest.approx(rate, rel=0.2)
            assert wl[name].input_tokens == pytest.approx(TOKENS[name][0], rel=0.05)
            assert wl[name].output_tokens == pytest.approx(TOKENS[name][1], rel=0.05)
        res = CliRunner().invoke(main, ["workload", "from-prometheus", f"http://127.0.0.1:{port}", "--requests-query",
                                        "sum(rate(nothing_total[5s]))", "--default-rank", "8", "--base-model", "none",
                                        "--out", str(out)])
        assert res.exit_code == 2 and "gave no series" in res.output
    finally:
        stop.set()
        prom.terminate()
        prom.wait(timeout=30)
        server.shutdown()
