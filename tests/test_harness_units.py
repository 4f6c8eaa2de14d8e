"""Serving harness pieces that need no vLLM: synthesis, Prometheus parsing, launcher, load generator."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import needs, needs_program

from serving_harness import engine, metrics, synth
from twin import Adapter, Workload, draw_requests
from twin.errors import BadInputError


def test_prometheus_parser_reads_labels_escapes_and_special_values():
    text = (
        "# HELP vllm:x help text\n# TYPE vllm:x gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_waiting_by_reason{reason="deferred",model_name="a \\"q\\" b\\\\c\\nd"} 2\n'
        'vllm:num_requests_waiting_by_reason{reason="capacity"} 5 1700000000000\n'
        "plain_metric NaN\n"
        'vllm:kv_cache_usage_perc{engine="0",} +Inf\n'
        "\n"
    )
    s = metrics.parse_prometheus(text)
    assert [x.name for x in s] == ["vllm:num_requests_running", "vllm:num_requests_waiting_by_reason",
                                   "vllm:num_requests_waiting_by_reason", "plain_metric", "vllm:kv_cache_usage_perc"]
    assert s[1].labels["model_name"] == 'a "q" b\\c\nd'
    assert s[2].value == 5 and math.isnan(s[3].value) and s[4].value == math.inf
    values = metrics.series_values(s)
    assert values["running"] == 3 and values["waiting_deferred"] == 2 and values["waiting_capacity"] == 5
    assert math.isnan(values["preemptions"])


@pytest.mark.parametrize("bad", ['m{a="x} 1', "m", 'm{a=x} 1', "m abc", "{a=\"b\"} 1"])
def test_prometheus_parser_rejects_malformed_lines(bad):
    with pytest.raises(ValueError, match="not a Prometheus text page"):
        metrics.parse_prometheus(bad)


def test_metrics_series_keeps_cache_config_and_writes_parquet(tmp_path):
    pq = needs("pyarrow.parquet")
    page = metrics.parse_prometheus('vllm:cache_config_info{block_size="128",num_gpu_blocks="64"} 1\n'
                                    'vllm:num_preemptions_total{engine="0"} 4\n')
    series = metrics.MetricsSeries()
    series.add(0.5, page)
    series.add(1.5, page)
    assert series.cache_config["num_gpu_blocks"] == "64"
    series.to_parquet(tmp_path / "m.parquet")
    table = pq.read_table(tmp_path / "m.parquet")
    assert table.column("preemptions").to_pylist() == [4.0, 4.0]
    assert table.schema.metadata[b"cache_config.block_size"] == b"128"
    back = metrics.MetricsSeries.from_parquet(tmp_path / "m.parquet")
    assert back.t_s == [0.5, 1.5] and back.cache_config == series.cache_config
    assert back.values["preemptions"] == [4.0, 4.0] and math.isnan(back.values["running"][0])


def _finished_page(decode_s: float, tokens: int, requests: int) -> list:
    return metrics.parse_prometheus(f'vllm:request_decode_time_seconds_sum{{engine="0"}} {decode_s}\n'
                                    f'vllm:request_generation_tokens_sum{{engine="0"}} {tokens}\n'
                                    f'vllm:request_generation_tokens_count{{engine="0"}} {requests}\n')


def test_engine_timed_itl_counts_the_requests_finished_between_the_scrapes_inside_the_window():
    series = metrics.MetricsSeries()
    # Scrapes at 0, 1, ..., 5 s; between those at 1 and 4 s, 3 requests finish with 44 tokens in 1.5 s of decoding.
    for t, page in enumerate([(0.0, 0, 0), (0.2, 11, 1), (0.4, 22, 2), (1.0, 33, 3), (1.7, 55, 4), (2.0, 66, 5)]):
        series.add(float(t), _finished_page(*page))
    assert series.engine_itl_ms(0.5, 4.2) == pytest.approx(1.5 / (55 - 11 - 3) * 1000.0)
    assert series.engine_itl_ms(0.0, 5.0) == pytest.approx(2.0 / (66 - 5) * 1000.0)
    assert math.isnan(series.engine_itl_ms(2.5, 3.5))  # one scrape: no interval
    older = metrics.MetricsSeries()  # scraped before these series were kept
    for t in (0.0, 1.0, 2.0):
        older.add(t, metrics.parse_prometheus('vllm:num_requests_running{engine="0"} 1\n'))
    assert math.isnan(older.engine_itl_ms(0.0, 2.0))


def test_synthetic_model_tokenizer_and_adapter(tmp_path):
    needs("safetensors")
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    shape = synth.ModelShape(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=32)
    model = synth.write_model(tmp_path / "m", shape, seed=3)
    weights = load_file(model / "model.safetensors")
    assert weights["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (64, 96)
    assert weights["lm_head.weight"].shape == (300, 64)
    assert synth.model_shape(model) == shape
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert tok.encode("w5 w299 w300").ids == [5, 299, 0]
    assert tok.get_vocab_size() == 300
    assert json.loads((model / "tokenizer_config.json").read_text())["eos_token"] == "</s>"

    paths = synth.write_adapters(tmp_path / "ad", shape, {"x": 4, "y": 16})
    lora = load_file(paths["y"] / "adapter_model.safetensors")
    assert lora["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (16, 64)
    assert lora["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"].shape == (96, 16)
    assert len(lora) == 2 * 7 * shape.num_hidden_layers
    assert synth.read_adapter_rank(paths["x"]) == 4
    config_only = synth.write_model(tmp_path / "d", synth.SHAPES["tiny"], weights=False)
    assert not (config_only / "model.safetensors").exists() and (config_only / "config.json").exists()


def test_synthesis_rejects_bad_shapes_and_adapters(tmp_path):
    with pytest.raises(BadInputError, match="head_dim"):
        synth.ModelShape(head_dim=16)
    with pytest.raises(BadInputError, match="multiple"):
        synth.ModelShape(num_attention_heads=3, num_key_value_heads=2)
    with pytest.raises(BadInputError, match="rank"):
        synth.write_adapter(tmp_path, synth.ModelShape(), 0)
    with pytest.raises(BadInputError, match="adapter_config"):
        synth.read_adapter_rank(tmp_path)
    with pytest.raises(BadInputError, match="shape name"):
        synth.model_shape(tmp_path / "nope")


def test_engine_argv_is_a_list_with_lora_and_kv_settings():
    cfg = engine.EngineConfig(model="/m", adapters=(("a b;rm -rf", "/p q"), ("c", "/r")), max_loras=2,
                              max_lora_rank=32, kv_cache_bytes=1 << 20, device="cuda", gpu=3)
    argv = cfg.argv(1234, python="py")
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    i = argv.index("--lora-modules")
    assert [json.loads(v) for v in argv[i + 1:i + 3]] == [{"name": "a b;rm -rf", "path": "/p q"},
                                                          {"name": "c", "path": "/r"}]
    assert argv[argv.index("--max-cpu-loras") + 1] == "2"
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(1 << 20)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert cfg.environment()["CUDA_VISIBLE_DEVICES"] == "3" and cfg.environment()["HF_HUB_OFFLINE"] == "1"
    with pytest.raises(BadInputError, match="device"):
        engine.EngineConfig(model="/m", device="tpu")
    with pytest.raises(BadInputError, match="unique"):
        engine.EngineConfig(model="/m", adapters=(("a", "/x"), ("a", "/y")))


def test_startup_failures_are_classified_from_the_log():
    memory = ("(EngineCore pid=5) ERROR 11-22 02:57:48 [core.py:1] ValueError: To serve at least one request "
              "with the model's max seq len (2048), (0.0 GiB KV cache is needed, which is larger than the "
              "available KV cache memory (0.0 GiB).")
    assert engine.classify_failure("INFO start\n" + memory) == (
        "memory_error", memory[memory.index("ValueError"):][:300])
    status, msg = engine.classify_failure("x\nValueError: LoRA rank 64 is greater than max_lora_rank 16.\n")
    assert status == "bad_config" and "max_lora_rank 16" in msg
    assert engine.classify_failure("boom\nRuntimeError: weird\nshutting down\n") == ("crashed", "RuntimeError: weird")
    pydantic = ("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
                "  Value error, User-specified max_model_len (5000) is greater than the derived max_model_len "
                "(max_position_embeddings=4096 in model's config.json). [type=value_error]\n"
                "    For further information visit https://errors.pydantic.dev/2.12/v/value_error\n")
    status, msg = engine.classify_failure(pydantic)
    assert status == "bad_config" and "for ModelConfig: Value error, User-specified max_model_len (5000)" in msg
    assert engine.kv_tokens_from_log("[x] CPU KV cache size: 131,072 tokens, Maximum") == 131072


def test_engine_that_exits_at_once_is_a_crashed_result_and_leaves_no_process(tmp_path):
    false = needs_program("false")
    # `false -m vllm...` exits at once with no output: a process that dies during start-up.
    with engine.Engine(engine.EngineConfig(model=str(tmp_path)), tmp_path / "log.txt", python=false) as e:
        result = e.start()
        assert not e.running
    assert result.status == "crashed" and result.message == "no output" and not result.ok


def test_an_engine_gives_vllm_a_temp_dir_it_removes_when_stopped(tmp_path):
    """vLLM leaves IPC sockets and rendezvous files in the temp dir when stopped; the engine gives it a temp dir
    of its own, and keeps torch's compile cache where it was."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "$VLLM_RPC_BASE_PATH $TMPDIR $TORCHINDUCTOR_CACHE_DIR" > "$0.dirs"\n'
                    '[ -n "$TMPDIR" ] && touch "$TMPDIR/vllm_dist_x"\nsleep 30\n')
    fake.chmod(0o755)
    with engine.Engine(engine.EngineConfig(model=str(tmp_path)), tmp_path / "log.txt", startup_timeout_s=1.5,
                       python=str(fake)) as e:
        assert e.start().status == "timeout"
    rpc, tmp, inductor = (tmp_path / "python.dirs").read_text().split()
    assert rpc == tmp and Path(tmp).name.startswith("vllm-tmp-") and not Path(tmp).exists()
    assert Path(inductor).name.startswith("torchinductor_") and Path(inductor).parent != Path(tmp)


def _answering_server(model_ids):
    """A server on a free port answering every GET as an OpenAI /v1/models list of ``model_ids``."""
    import http.server
    import threading

    body = json.dumps({"object": "list", "data": [{"id": m, "object": "model"} for m in model_ids]}).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize(("ids", "status"), [(["base", "a1"], "ok"), (["other-model"], "timeout"), ([], "timeout")])
def test_an_engine_is_ready_only_when_its_port_serves_its_own_model(tmp_path, ids, status):
    """A server of another model on the engine's port (every path answering 200) is not the engine being ready."""
    sleeper = tmp_path / "python"
    sleeper.write_text("#!/bin/sh\nsleep 30\n")
    sleeper.chmod(0o755)
    server = _answering_server(ids)
    try:
        config = engine.EngineConfig(model=str(tmp_path))
        with engine.Engine(config, tmp_path / "log.txt", port=server.server_address[1], startup_timeout_s=1.5,
                           python=str(sleeper)) as e:
            result = e.start()
    finally:
        server.shutdown()
    assert result.status == status


def _stub_run(requests, names, window_s, **kwargs):
    needs("aiohttp")
    from aiohttp import web

    from serving_harness import loadgen, stub_server

    async def go():
        runner = web.AppRunner(stub_server.make_app(token_delay_ms=2.0))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", engine.free_port())
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await loadgen.measure_async(f"http://127.0.0.1:{port}", requests, names, window_s,
                                               vocab_size=100, scrape_interval_s=0.2, **kwargs)
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def test_load_generator_records_every_request_against_a_stub(tmp_path):
    from serving_harness import loadgen

    wl = Workload((Adapter("a", 8, 40.0, 5, 4), Adapter("b", 8, 20.0, 7, 30)))
    req = draw_requests(wl, 1.5, seed=2)
    records, series = _stub_run(req, ["a", "b"], 1.0, max_in_flight=0)
    assert len(records) == len(req)
    inside = req.arrival_s < 1.0
    assert set(records.error[~inside]) <= {"outside_window"}
    ok = records.error == ""
    assert ok.sum() > 0.8 * inside.sum()
    # Requests of adapter b need 30 tokens x 2 ms: those arriving in the last 50 ms cannot finish.
    late_b = inside & (records.adapter == "b") & (req.arrival_s > 0.95)
    assert all(records.error[late_b] == "unfinished_at_window_end")
    assert np.all(records.output_tokens_received[ok] == records.output_tokens[ok])
    assert np.all(records.first_token_s[ok] >= records.arrival_s[ok])
    assert np.all(records.finish_s[ok] > records.first_token_s[ok])
    assert len(series.t_s) >= 3 and series.cache_config["num_gpu_blocks"] == "100"
    records.to_parquet(tmp_path / "r.parquet")
    back = loadgen.RunRecords.from_parquet(tmp_path / "r.parquet")
    assert back.error.tolist() == records.error.tolist() and np.array_equal(back.arrival_s, records.arrival_s)
    s = loadgen.summarise(records, 1.0)
    assert s.arrived_requests == inside.sum() and s.finished_requests == (ok & (records.finish_s <= 1.0)).sum()
    assert s.itl_ms_mean >= 1.9  # the stub waits 2 ms before each token


def test_real_latencies_count_from_when_a_request_was_sent():
    """Drawn at 1, 2, 9.9 s; the second sent 0.4 s late, the third after the 10 s window (not arrived)."""
    from serving_harness import loadgen

    records = loadgen.RunRecords(
        request=np.arange(3), adapter=np.array(["a"] * 3, dtype=object), arrival_s=np.array([1.0, 2.0, 9.9]),
        sent_s=np.array([1.0, 2.4, 10.1]), first_token_s=np.array([1.1, 2.5, np.nan]),
        finish_s=np.array([1.5, 2.9, np.nan]),
        input_tokens=np.array([10, 10, 10]), output_tokens=np.array([5, 5, 5]),
        output_tokens_received=np.array([5, 5, 0]), error=np.array(["", "", "unfinished_at_window_end"], dtype=object))
    s = loadgen.summarise(records, 10.0)
    assert s.ttft_ms_mean == pytest.approx(100.0) and s.itl_ms_mean == pytest.approx(100.0)
    assert s.arrived_requests == 2 and s.finished_requests == 2 and s.arriving_tok_s == pytest.approx(3.0)


def test_load_generator_client_cap_refuses_arrivals_beyond_it():
    wl = Workload((Adapter("a", 8, 200.0, 5, 50),))
    req = draw_requests(wl, 0.5, seed=0)
    records, _ = _stub_run(req, ["a"], 0.5, max_in_flight=3)
    assert (records.error == "client_cap").sum() > 0.5 * len(req)


def test_planner_synth_writes_model_and_adapters(tmp_path):
    from click.testing import CliRunner

    from planner import cli_harness

    res = CliRunner().invoke(cli_harness.synth, ["--out", str(tmp_path), "--adapter-ranks", "8,32",
                                                 "--adapters-per-rank", "2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert set(out["adapters"]) == {"r8-0", "r8-1", "r32-0", "r32-1"}
    assert synth.read_adapter_rank(out["adapters"]["r32-1"]) == 32
    assert (tmp_path / "model" / "model.safetensors").is_file()
    bad = CliRunner().invoke(cli_harness.synth, ["--out", str(tmp_path), "--adapter-ranks", "8,x"])
    assert bad.exit_code == 2 and "comma-separated" in bad.output


def test_planner_validate_and_profile_reject_bad_input_in_one_line(tmp_path):
    from click.testing import CliRunner

    from planner import cli_harness

    res = CliRunner().invoke(cli_harness.validate, ["--profile", "no-such-profile"])
    assert res.exit_code == 2 and "unknown profile" in res.output and "Traceback" not in res.output
    model = synth.write_model(tmp_path / "m", synth.ModelShape(), weights=False)
    res = CliRunner().invoke(cli_harness.profile, ["--model", str(model), "--out", str(tmp_path / "p.json"),
                                                   "--ranks", "8,-4"])
    assert res.exit_code == 2 and "--ranks" in res.output


def test_validate_reruns_another_work_dirs_workloads_and_keeps_records_held_apart(tmp_path):
    from click.testing import CliRunner

    from planner import cli_harness
    from serving_harness.validation import Validator, stored_workloads
    from twin.profile import load_profile

    prof = load_profile("cpu-2core-tiny-llama")
    model = synth.write_model(tmp_path / "m", synth.ModelShape(), weights=False)
    Validator(prof, str(model), tmp_path / "first").workload_set(3, 11)
    stored = stored_workloads(tmp_path / "first")
    stored["cases"][0]["adapters"][0]["rate_rps"] *= 2  # sized by an earlier profile: not what a new draw gives
    (tmp_path / "first" / "workloads.json").write_text(json.dumps(stored))
    again = Validator(prof, str(model), tmp_path / "again")
    again.adopt_workloads(stored_workloads(tmp_path / "first"), tmp_path / "first")
    rerun = again.workload_set(3, 11)
    assert rerun[0].adapters[0].rate_rps == stored["cases"][0]["adapters"][0]["rate_rps"]
    assert rerun != Validator(prof, str(model), tmp_path / "fresh").workload_set(3, 11)
    again.adopt_workloads(stored, tmp_path / "first")  # a rerun of the same command resumes
    other = Validator(prof, str(model), tmp_path / "other")
    other.workload_set(3, 12)
    with pytest.raises(BadInputError, match="other workloads"):
        other.adopt_workloads(stored, tmp_path / "first")
    with pytest.raises(BadInputError, match="no workloads.json"):
        stored_workloads(tmp_path / "m")

    def validate(*args):
        return CliRunner().invoke(cli_harness.validate, ["--profile", "cpu-2core-tiny-llama", "--model", str(model),
                                                         *args])

    res = validate("--workloads-of", str(tmp_path / "first"), "--cases", "5", "--work-dir", str(tmp_path / "x"))
    assert res.exit_code == 2 and "--cases 5" in res.output and not (tmp_path / "x").exists()
    # the calibration workloads (or a rerun of them) cannot become the profile's validation record
    seed = prof.provenance["calibration"]["seed"]
    res = validate("--seed", str(seed), "--record", "--work-dir", str(tmp_path / "c"))
    assert res.exit_code == 2 and "calibrated" in res.output and not (tmp_path / "c").exists()
    rerun_of_calibration = tmp_path / "calibration-copy"
    rerun_of_calibration.mkdir()
    (rerun_of_calibration / "workloads.json").write_text(json.dumps({**stored, "seed": seed}))
    res = validate("--workloads-of", str(rerun_of_calibration), "--record", "--work-dir", str(tmp_path / "c"))
    assert res.exit_code == 2 and "calibrated" in res.output and not (tmp_path / "c").exists()
    res = CliRunner().invoke(cli_harness.rescore, ["--profile", "cpu-2core-tiny-llama", "--work-dir",
                                                   str(rerun_of_calibration), "--record"])
    assert res.exit_code == 2 and "calibrated" in res.output
    res = validate("--duration", "5", "--warmup", "5", "--work-dir", str(tmp_path / "w"))
    assert res.exit_code == 2 and "must be longer than --warmup" in res.output and not (tmp_path / "w").exists()


def test_validate_workloads_of_a_dir_run_on_fewer_engines_takes_its_engines(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from planner import cli_harness
    from serving_harness.validation import Validator
    from twin.profile import load_profile

    model = synth.write_model(tmp_path / "m", synth.ModelShape(), weights=False)
    Validator(load_profile("cpu-2core-tiny-llama"), str(model), tmp_path / "first", engines=2).workload_set(3, 11)

    class Ran(Exception):
        pass

    def run(self, cases):
        raise Ran(self.engines, len(cases))

    monkeypatch.setattr(Validator, "run", run)

    def validate(*args):
        return CliRunner().invoke(cli_harness.validate, ["--profile", "cpu-2core-tiny-llama", "--model", str(model),
                                                         "--workloads-of", str(tmp_path / "first"), *args])

    res = validate("--work-dir", str(tmp_path / "fresh"))  # was refused: "holds runs of 3 workloads"
    assert isinstance(res.exception, Ran) and res.exception.args == (2, 3), res.output
    res = validate("--engines", "3", "--work-dir", str(tmp_path / "other"))
    assert res.exit_code == 2 and "--engines 3" in res.output


def test_stored_runs_are_scored_in_the_window_they_record(tmp_path):
    from click.testing import CliRunner

    from planner import cli_harness
    from serving_harness.window import UNRECORDED, run_window

    assert run_window([{"a": 1}], None, None, "d") == UNRECORDED  # runs made before they recorded it
    assert run_window([{"a": 1}], 10.0, 2.0, "d") == (10.0, 2.0)
    made = [{"duration_s": 10.0, "warmup_s": 2.0}] * 2
    assert run_window(made, None, None, "d") == (10.0, 2.0) == run_window(made, 10.0, None, "d")
    with pytest.raises(BadInputError, match="were made with --duration 10; leave --duration out"):
        run_window(made, 30.0, None, "d")
    with pytest.raises(BadInputError, match="different windows"):
        run_window([*made, {"duration_s": 30.0, "warmup_s": 5.0}], None, None, "d")
    with pytest.raises(BadInputError, match="must be longer than --warmup"):
        run_window([{"a": 1}], 30.0, 30.0, "d")
    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / "v00.json").write_text(json.dumps({"case_id": "v00", **made[0]}))
    res = CliRunner().invoke(cli_harness.rescore, ["--profile", "cpu-2core-tiny-llama", "--work-dir", str(tmp_path),
                                                   "--duration", "30"])
    assert res.exit_code == 2 and "were made with --duration 10" in res.output


def test_cuda_engines_skip_the_flashinfer_sampler_unless_told():
    cuda = engine.EngineConfig(model="/m", device="cuda")
    assert cuda.environment()["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    told = engine.EngineConfig(model="/m", device="cuda", env=(("VLLM_USE_FLASHINFER_SAMPLER", "1"),))
    assert told.environment()["VLLM_USE_FLASHINFER_SAMPLER"] == "1"
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in engine.EngineConfig(model="/m").environment()


def test_a_cuda_profile_is_validated_on_the_engine_it_was_measured_on(tmp_path):
    from serving_harness.validation import Validator
    from twin.profile import profile_from_dict

    model = synth.write_model(tmp_path / "m", synth.ModelShape(), weights=False)
    doc = json.loads((Path(__file__).parents[1] / "artifacts/profiles/cpu-2core-tiny-llama.json").read_text())
    cpu = Validator(profile_from_dict(doc), str(model), tmp_path / "v").engine_config(8, 16)
    assert (cpu.device, cpu.load_format, cpu.gpu_memory_utilization) == ("cpu", "auto", None)
    doc["engine"]["kv_cache_bytes"] = None
    spec = doc["provenance"]["spec"]
    spec.update(device="cuda", gpu=1, load_format="dummy", gpu_memory_utilization=0.9, kv_cache_bytes=None)
    cfg = Validator(profile_from_dict(doc), str(model), tmp_path / "v").engine_config(8, 16)
    assert (cfg.device, cfg.gpu, cfg.load_format, cfg.gpu_memory_utilization) == ("cuda", 1, "dummy", 0.9)
    argv = cfg.argv(1)
    assert argv[argv.index("--load-format") + 1] == "dummy" and "--kv-cache-memory-bytes" not in argv
    assert cfg.environment()["CUDA_VISIBLE_DEVICES"] == "1"
    assert Validator(profile_from_dict(doc), str(model), tmp_path / "v", gpu=3).engine_config(8, 16).gpu == 3


def test_an_explicit_kv_cache_makes_a_memory_limited_workload_set(tmp_path):
    """`planner validate --kv-cache-memory-bytes`: the engines get the flag, the work dir records the KV cache
    (bytes and the tokens they hold), the workloads go to the engine with the most slots with longer requests,
    and in the twin with that KV some of them preempt where the profile's own KV cache never binds."""
    from serving_harness.validation import Validator
    from twin import SimConfig, load_profile, simulate

    h100 = load_profile("h100-80gb-llama-3.1-8b")
    v = Validator(h100, "llama-3.1-8b", tmp_path / "kv", kv_cache_bytes=2 << 30, engines=1)
    cases = v.workload_set(4, 2025)
    saved = json.loads((tmp_path / "kv" / "workloads.json").read_text())
    assert saved["kv_cache"] == {"bytes": 2 << 30, "tokens": 16384}  # 128 KiB a token (32 layers, 8 KV heads)
    assert {(c.a_max, c.max_lora_rank) for c in cases} == {(8, 32)}
    # the engines get the flag (a tiny model: engine_config writes its adapter pool)
    tiny = synth.write_model(tmp_path / "m", synth.ModelShape(), weights=False)
    argv = Validator(load_profile("cpu-2core-tiny-llama"), str(tiny), tmp_path / "t",
                     kv_cache_bytes=3 << 20).engine_config(8, 16).argv(1)
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(3 << 20)
    small = v.sized_profile()
    assert small.kv.tokens_for(8, 32) == small.kv.tokens_for(256, 16) == 16384

    def preemptions(profile):
        return [simulate(c.workload, profile, SimConfig(a_max=8, duration_s=30.0, max_lora_rank=32,
                                                        seed=c.seed)).preemptions for c in cases]

    assert max(preemptions(small)) > 0 and max(preemptions(h100)) == 0
    with pytest.raises(BadInputError, match="2147483648-byte KV cache"):
        replace(v, kv_cache_bytes=4 << 30).workload_set(4, 2025)
    with pytest.raises(BadInputError, match="fewer than one 8192-token sequence"):
        Validator(h100, "llama-3.1-8b", tmp_path / "tiny", kv_cache_bytes=1 << 29).workload_set(4, 2025)


def test_profile_on_cuda_sizes_its_batches_for_a_gpu(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from planner import cli_harness
    from serving_harness import profiling

    seen = {}

    def fake_profile_engine(spec, *args, **kwargs):
        seen["spec"] = spec
        raise SystemExit(0)

    monkeypatch.setattr(profiling, "profile_engine", fake_profile_engine)
    monkeypatch.setattr(engine, "check_device", lambda device: None)  # as on a machine with a GPU
    model = synth.write_model(tmp_path / "m", synth.ModelShape(max_position_embeddings=8192), weights=False)
    common = ["--model", str(model), "--out", str(tmp_path / "p.json"), "--work-dir", str(tmp_path / "w")]

    def spec(*args):
        seen.clear()
        res = CliRunner().invoke(cli_harness.profile, [*common, *args])
        return res, seen.get("spec")

    res, cuda = spec("--engine", "cuda")
    assert res.exit_code == 0 and cuda.batch_sizes == (1, 8, 32, 64, 128, 256, 512)
    assert cuda.lora_batch_sizes == (8, 128, 512)  # spans the batches: no extrapolation of the LoRA term
    assert (cuda.device, cuda.max_num_seqs, cuda.max_num_batched_tokens) == ("cuda", 512, 2048)
    assert cuda.max_model_len == 8192
    assert (cuda.gpu_memory_utilization, cuda.kv_cache_bytes) == (0.9, None)  # vLLM sizes the KV cache
    assert (cuda.prompt_lengths, cuda.decode_tokens) == ((256, 512, 1024, 2048), 240)  # compute-bound prompts
    res, cpu = spec()
    assert res.exit_code == 0 and cpu.batch_sizes == (1, 2, 4, 8, 16, 32, 48) and cpu.lora_batch_sizes == (8, 32, 48)
    assert (cpu.prompt_lengths, cpu.decode_tokens) == ((16, 128, 256, 512), 80)
    assert (cpu.max_num_seqs, cpu.kv_cache_bytes, cpu.gpu_memory_utilization) == (64, 4 << 20, None)
    res, explicit = spec("--engine", "cuda", "--kv-cache-bytes", "1000000", "--batch-sizes", "16,8,16")
    assert (explicit.kv_cache_bytes, explicit.gpu_memory_utilization, explicit.batch_sizes) == (1000000, None, (8, 16))
    assert explicit.lora_batch_sizes == (8, 16)
    res, _ = spec("--engine", "cuda", "--max-num-seqs", "64")
    assert res.exit_code == 2 and "--batch-sizes go up to 512, above --max-num-seqs 64" in res.output
    for one_lora_batch in ("1,2,4", "1,8"):  # the LoRA slope needs two batches
        res, _ = spec("--batch-sizes", one_lora_batch)
        assert res.exit_code == 2 and "two batches of at least 8" in res.output
    res, _ = spec("--max-model-len", "500")
    assert res.exit_code == 2 and "requests of 514 tokens, above --max-model-len 500" in res.output
    res, _ = spec("--decode-tokens", "600", "--max-model-len", "600")
    assert res.exit_code == 2 and "--decode-tokens makes requests of 616 tokens" in res.output
    res, _ = spec("--prompt-lengths", "128,1024")
    assert res.exit_code == 2 and "above --max-num-batched-tokens 512" in res.output
    res, _ = spec("--prompt-lengths", "64,64")
    assert res.exit_code == 2 and "two lengths or more" in res.output
    res, mine = spec("--prompt-lengths", "64,32", "--decode-tokens", "30")
    assert res.exit_code == 0 and (mine.prompt_lengths, mine.decode_tokens) == ((32, 64), 30)
    # Refused before any engine starts, where they failed after (or every engine did):
    for args, words in ((["--max-model-len", "9000"], "above the 8192 tokens the model allows"),
                        (["--a-max-points", "32,8,1"], "--a-max-points must increase"),
                        (["--duration", "5", "--warmup", "5"], "must be longer than --warmup 5 s"),
                        (["--out", "/dev/null"], "is a character device"),
                        (["--out", str(model / "config.json" / "p.json")], "a file stands where its directory")):
        res, ran = spec(*args)
        assert res.exit_code == 2 and words in res.output and ran is None, (args, res.output)


def test_machine_facts_name_the_gpu_nvidia_smi_reports(tmp_path, monkeypatch):
    from serving_harness.machine import machine_facts

    monkeypatch.setenv("PATH", str(tmp_path))
    assert machine_facts("cuda")["accelerator"] == "CUDA GPU (nvidia-smi unavailable)"
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 81559, 580.159.04'\n")
    smi.chmod(0o755)
    facts = machine_facts("cuda", 2)
    assert (facts["accelerator"], facts["gpu_index"], facts["memory_gib"]) == ("NVIDIA H100 80GB HBM3", 2, 79.65)
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, [N/A], 580.159.04'\n")
    assert machine_facts("cuda")["accelerator"] == "CUDA GPU (nvidia-smi unavailable)"
    assert machine_facts("cpu")["accelerator"] == "none (CPU)"


def test_calibrate_a_profile_measured_without_calibration_from_runs_made_later(tmp_path):
    """The first H100 profile was measured with --calibration-cases 0; its four real runs calibrate a copy."""
    from click.testing import CliRunner

    from planner import cli_harness

    root = Path(__file__).parents[1]
    copy = tmp_path / "h100.json"
    first = root / "datasets/measured/h100-80gb-llama-3.1-8b/profile-2026-11-23.json"
    copy.write_text(first.read_text())
    res = CliRunner().invoke(cli_harness.calibrate, ["--profile", str(copy)])
    assert res.exit_code == 2 and "has not been calibrated: pass --runs" in res.output
    runs = root / "datasets/measured/h100-80gb-llama-3.1-8b/validation"
    study = tmp_path / "study.json"  # a published profile has no micro-benchmark fit to calibrate
    study.write_text((root / "artifacts/profiles/h100-64gb-llama-3.1-8b.json").read_text())
    res = CliRunner().invoke(cli_harness.calibrate, ["--profile", str(study), "--runs", str(runs)])
    assert res.exit_code == 2 and "not measured by `planner profile`" in res.output
    res = CliRunner().invoke(cli_harness.calibrate, ["--profile", str(copy), "--runs", str(runs)])
    assert res.exit_code == 0, res.output
    before, after = (json.loads(p.read_text()) for p in (first, copy))
    fit = after["provenance"]["calibration"]
    assert after["step_latency_variants"]["microbenchmarks"] == before["step_latency_ms"]
    assert (fit["workloads"], fit["seed"], fit["duration_s"], fit["warmup_s"]) == (4, 2024, 30.0, 5.0)
    assert fit["loss_after"] < fit["loss_before"] and "validation" not in after
    res = CliRunner().invoke(cli_harness.calibrate, ["--profile", str(copy)])  # refit to the same runs
    assert res.exit_code == 0 and json.loads(copy.read_text())["provenance"]["calibration"]["scales"] == fit["scales"]


def test_a_lean_kv_grid_from_one_engine_matches_the_h100_grid():
    """The KV grid a lean profile derives from its one LoRA engine (A_max 8, rank 32) against the grid
    measured point by point on the H100 80GB (datasets/measured/h100-80gb-llama-3.1-8b/raw)."""
    from serving_harness.profiling import ProfileSpec, lean_kv_tokens
    from serving_harness.synth import SHAPES

    raw = Path(__file__).resolve().parents[1] / "datasets/measured/h100-80gb-llama-3.1-8b/raw"
    measured = {(a, r): json.loads((raw / f"kv-a{a}-r{r}.json").read_text())["kv_tokens"]
                for a in (8, 128) for r in (16, 32)}
    spec = ProfileSpec("h100", "unused", device="cuda", kv_cache_bytes=None, gpu_memory_utilization=0.9,
                       max_model_len=8192, lora_ranks=(16, 32), a_max_points=(8, 128), latency_rank=32, lean=True)
    grid = lean_kv_tokens(SHAPES["llama-3.1-8b"], spec, measured[(8, 32)], 16)
    for r in (16, 32):
        for a, tokens in zip((8, 128), grid[str(r)]):
            assert tokens == pytest.approx(measured[(a, r)], rel=0.005), (a, r)
    explicit = lean_kv_tokens(SHAPES["llama-3.1-8b"], replace(spec, kv_cache_bytes=1 << 30), 100_000, 16)
    assert explicit == {"16": [100_000, 100_000], "32": [100_000, 100_000]}  # slots take nothing from it
    tiny = lean_kv_tokens(SHAPES["llama-3.1-8b"], replace(spec, a_max_points=(8, 400)), measured[(8, 32)], 16)
    assert tiny["32"][1] is None  # 400 slots leave no room for one max_model_len sequence: it cannot start


def test_offline_harness_commands_refuse_bad_files_in_one_line(tmp_path):
    """What raised tracebacks: a profile file that is no profile, runs without cases or requests, a table
    directory that is a file, a model config that is no object."""
    from click.testing import CliRunner

    from planner import cli_harness

    (tmp_path / "empty.json").write_text("")
    (tmp_path / "list.json").write_text("[1]")
    for bad, words in (("empty.json", "cannot read profile JSON"), ("list.json", "is an object, not list")):
        res = CliRunner().invoke(cli_harness.calibrate, ["--profile", str(tmp_path / bad)])
        assert res.exit_code == 2 and words in res.output, res.output
    shipped = Path(__file__).resolve().parents[1] / "artifacts" / "profiles" / "cpu-2core-tiny-llama.json"
    mine = tmp_path / "mine.json"
    mine.write_text(shipped.read_text())
    (tmp_path / "runs" / "cases").mkdir(parents=True)
    res = CliRunner().invoke(cli_harness.calibrate, ["--profile", str(mine), "--runs", str(tmp_path / "runs")])
    assert res.exit_code == 2 and "no stored calibration runs" in res.output, res.output
    (tmp_path / "runs" / "cases" / "v00.json").write_text(json.dumps({"case_id": "v00", "adapter_ids": ["a"]}))
    res = CliRunner().invoke(cli_harness.rescore, ["--profile", str(mine), "--work-dir", str(tmp_path / "runs"),
                                                   "--out-dir", str(tmp_path / "t")])
    assert res.exit_code == 2 and "case v00 has no v00-requests.parquet in runs/" in res.output, res.output
    res = CliRunner().invoke(cli_harness.rescore, ["--profile", str(mine), "--work-dir", str(tmp_path / "runs"),
                                                   "--out-dir", "/dev/null"])
    assert res.exit_code == 2 and "not a directory" in res.output, res.output
    with pytest.raises(BadInputError, match="a model config is a JSON object, not list"):
        synth.model_shape(tmp_path / "list.json")


def test_a_table_without_the_record_goes_to_the_work_dir_not_over_the_profiles(tmp_path):
    """The table under artifacts/validation/ID is the one the profile's recorded summary points to: only --record
    writes there by default."""
    from planner.cli_harness import _table_dir
    from twin.profile import artifacts_dir, load_profile

    prof = load_profile("cpu-2core-tiny-llama")
    assert _table_dir(prof, None, False, tmp_path / "w") == tmp_path / "w" / "table"
    assert _table_dir(prof, None, True, tmp_path / "w") == artifacts_dir() / "validation" / prof.profile_id
    assert _table_dir(prof, str(tmp_path / "mine"), True, tmp_path / "w") == tmp_path / "mine"
