"""Profile fitting, calibration and the validation table on synthetic measurements (no vLLM)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from serving_harness import calibration, profiling, synth, validation
from twin import Adapter, Workload, draw_requests
from twin.metrics import group_log_ratios, smape_within_groups
from twin.profile import profile_from_dict
from twin.simulate import SimConfig, simulate

K4, K5, KP, L0, L1, L2 = 0.3, 4.0, 0.1, 2.0, 0.05, 0.2


def synthetic_raw(spec: profiling.ProfileSpec) -> dict:
    """Raw results as the experiments would record them for a known latency model."""
    def kv(a, r, ok=True):
        row = {"a_max": a, "max_lora_rank": r, "enable_lora": True, "status": "ok" if ok else "memory_error",
               "message": "" if ok else "KV cache is needed", "startup_s": 30.0}
        return {**row, "block_size": 128, "num_gpu_blocks": 64, "kv_tokens": 8192} if ok else row

    raw = {"kv-nolora": kv(1, 16), **{f"kv-a{a}-r{r}": kv(a, r, ok=not (r == 32 and a == 32))
                                      for r in spec.lora_ranks for a in spec.a_max_points}}
    raw["backbone"] = {"rows": [{"batch": b, "step_ms": K5 + K4 * b} for b in spec.batch_sizes]}
    raw["prefill"] = {"rows": [{"prompt_tokens": p, "ttft_ms": 20 + KP * p} for p in spec.prompt_lengths]}
    raw["lora"] = {"rows": [{"batch": b, "adapters": a, "step_ms": K5 + K4 * b + L0 + L1 * b + L2 * a}
                            for b in spec.lora_batch_sizes for a in spec.adapter_counts]}
    for r in spec.lora_ranks:
        raw[f"load-r{r}"] = {"rows": [
            row for ar in spec.lora_ranks if ar <= r
            for row in ({"adapter_rank": ar, "pattern": "same", "ttft_ms": [20.0, 21.0, 22.0]},
                        {"adapter_rank": ar, "pattern": "alternate", "ttft_ms": [20.0 + ar / 8, 21.0 + ar / 8, 30.0]})]}
    raw[f"sched-r{spec.latency_rank}"] = {"rows": [{"waiting": w, "itl_ms": 8.0 + 0.02 * w}
                                                   for w in spec.waiting_counts]}
    return raw


@pytest.fixture
def spec(tmp_path):
    model = synth.write_model(tmp_path / "model", synth.ModelShape(), weights=False)
    return profiling.ProfileSpec(profile_id="fit-test", model_dir=str(model))


def test_fit_recovers_every_term_and_marks_failed_grid_points(spec):
    raw = synthetic_raw(spec)
    prov = {"kind": "test", "machine": {"cpu": "x"}, "vllm_version": "0.32.0"}
    d = profiling.fit_profile(spec, raw, prov)
    lat = d["step_latency_ms"]
    assert lat["k4_ms_per_request"] == pytest.approx(K4) and lat["k5_ms"] == pytest.approx(K5)
    assert lat["kp_ms_per_prompt_token"] == pytest.approx(KP)
    assert (lat["l0_ms"], lat["l1_ms_per_request"], lat["l2_ms_per_adapter"]) == pytest.approx((L0, L1, L2))
    assert d["scheduler_overhead_us"]["k2_us_per_waiting"] == pytest.approx(20.0)
    assert d["adapter_load_ms"]["by_max_lora_rank"]["32"] == {"8": 1.0, "16": 2.0, "32": 4.0}
    assert d["kv_capacity"]["tokens"]["32"] == [8192, 8192, None]
    assert "memory_error" in d["kv_capacity"]["failures"]["32"]
    prof = profile_from_dict(d)
    assert prof.kv.max_a_max(32) == 8 and prof.kv.tokens_for(4, 8) == 8192
    assert prof.engine.block_size == 128 and prof.engine.version == "0.32.0"


def test_a_negative_fitted_cost_is_clipped_and_reported(spec):
    raw = synthetic_raw(spec)
    raw["backbone"]["rows"] = [{"batch": b, "step_ms": -1.0 + K4 * b} for b in spec.batch_sizes]
    d = profiling.fit_profile(spec, raw, {"kind": "test", "machine": {"cpu": "x"}, "vllm_version": "0.32.0"})
    lat = d["step_latency_ms"]
    assert lat["k5_ms"] == 0.0 and lat["k4_ms_per_request"] == pytest.approx(K4)
    # The LoRA terms sit on the clipped backbone: together they still give the measured LoRA steps.
    assert lat["l0_ms"] == pytest.approx(K5 + L0) and lat["l1_ms_per_request"] == pytest.approx(L1)
    [warning] = d["provenance"]["fit_warnings"]
    assert warning.startswith("k5_ms fitted as -1, clipped to 0")
    assert "fit_warnings" not in profiling.fit_profile(spec, synthetic_raw(spec), {
        "kind": "test", "machine": {"cpu": "x"}, "vllm_version": "0.32.0"})["provenance"]


def test_experiment_names_cover_the_grid(spec):
    names = profiling.Profiler(spec, "unused").experiment_names()
    assert len(names) == len(set(names)) == 1 + 9 + 3 + 3 + 1
    assert set(synthetic_raw(spec)) == set(names)


def test_timed_experiments_follow_untimed_requests_and_done_ones_start_nothing(spec, tmp_path, monkeypatch):
    """The first requests after start-up pay one-off costs: each engine serves untimed ones first."""
    events = []

    class FakeEngine:
        base_url = "http://engine"

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            events.append("stop")

        def start(self):
            events.append("start")
            return profiling.StartResult("ok", "", 1.0)

    monkeypatch.setattr(profiling, "run_trace", lambda url, items, *a, **k: events.append(("untimed", len(items))))
    profiler = profiling.Profiler(spec, tmp_path / "w")
    monkeypatch.setattr(profiler, "_engine", lambda config, name: FakeEngine())
    config = profiler.engine_config(1, 16, {"x": "/adapters/x", "y": "/adapters/y"})
    profiler._with_engine("latency", config, {"backbone": lambda url: events.append("timed") or {"rows": []}})
    assert events[0] == "start" and events[-2:] == ["timed", "stop"]
    assert ("untimed", 1) in events[1:-2] and ("untimed", 8 + 2) in events[1:-2]  # a burst and each adapter
    events.clear()
    profiler._with_engine("latency", config, {"backbone": lambda url: events.append("timed")})
    assert events == []  # backbone.json is there: no engine


def test_a_kv_point_keeps_an_out_of_memory_start_and_stops_at_any_other_failure(spec, tmp_path, monkeypatch):
    """Out of memory at a KV point is its measurement; a crash is not (the next engine would crash alike), so it
    is neither saved (a rerun tries it again) nor followed by more starts."""
    outcome = {}

    class FakeEngine:
        base_url = "http://engine"

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def start(self):
            return profiling.StartResult(outcome["status"], "why", 1.0, "kv.log")

    profiler = profiling.Profiler(spec, tmp_path / "w")
    (tmp_path / "w" / "raw").mkdir(parents=True)
    monkeypatch.setattr(profiler, "_engine", lambda config, name: FakeEngine())
    lora = profiler.engine_config(32, 16, {"x": "/adapters/x"})
    outcome["status"] = "memory_error"
    assert profiler.kv_point("kv-a32-r16", lora)["status"] == "memory_error"
    assert (tmp_path / "w" / "raw" / "kv-a32-r16.json").is_file()
    for status in ("crashed", "bad_config", "timeout"):
        outcome["status"] = status
        with pytest.raises(profiling.EngineStartError, match=f"engine kv-a8-r16 did not start \\({status}\\)"):
            profiler.kv_point("kv-a8-r16", profiler.engine_config(8, 16, {"x": "/adapters/x"}))
        assert not (tmp_path / "w" / "raw" / "kv-a8-r16.json").exists()
    outcome["status"] = "memory_error"  # the engine without LoRA must start: every point is measured against it
    with pytest.raises(profiling.EngineStartError, match="kv-nolora"):
        profiler.kv_point("kv-nolora", replace(lora, enable_lora=False))
    (tmp_path / "w" / "raw" / "kv-a8-r16.json").write_text('{"status": "crashed"}')  # saved by older code
    outcome["status"] = "ok"
    monkeypatch.setattr(profiler, "kv_size", lambda url: {"kv_tokens": 4096})
    assert profiler.kv_point("kv-a8-r16", profiler.engine_config(8, 16, {"x": "/adapters/x"}))["kv_tokens"] == 4096


def test_a_work_dir_resumes_only_measurements_of_the_same_settings(spec, tmp_path):
    work = tmp_path / "w"
    (work / "raw").mkdir(parents=True)
    profiling.Profiler(spec, work).check_resumable()
    moved = synth.write_model(tmp_path / "elsewhere", synth.ModelShape(), weights=False)  # same shape
    profiling.Profiler(replace(spec, profile_id="renamed", model_dir=str(moved)), work).check_resumable()
    with pytest.raises(profiling.BadInputError, match=r"decode_tokens: 80 there, 240 now.*another --work-dir"):
        profiling.Profiler(replace(spec, decode_tokens=240), work).check_resumable()
    deeper = synth.write_model(tmp_path / "deeper", synth.ModelShape(num_hidden_layers=3), weights=False)
    with pytest.raises(profiling.BadInputError, match="model_shape"):
        profiling.Profiler(replace(spec, model_dir=str(deeper)), work).check_resumable()
    copied = tmp_path / "copied"  # a KV grid copied from another run, without spec.json: taken
    (copied / "raw").mkdir(parents=True)
    (copied / "raw" / "kv-nolora.json").write_text("{}")
    profiling.Profiler(replace(spec, decode_tokens=240), copied).check_resumable()
    assert (copied / "spec.json").is_file()
    unknown = tmp_path / "unknown"  # latency results of unknown settings: refused
    (unknown / "raw").mkdir(parents=True)
    (unknown / "raw" / "backbone.json").write_text("{}")
    with pytest.raises(profiling.BadInputError, match="backbone.json but no spec.json"):
        profiling.Profiler(spec, unknown).check_resumable()
    assert not (unknown / "spec.json").exists()


def test_a_work_dir_of_a_version_without_a_newer_setting_resumes_at_its_default(spec, tmp_path):
    work = tmp_path / "w"
    (work / "raw").mkdir(parents=True)
    profiling.Profiler(spec, work).check_resumable()
    older = json.loads((work / "spec.json").read_text())
    del older["lean"]  # written before --lean existed
    (work / "spec.json").write_text(json.dumps(older))
    profiling.Profiler(spec, work).check_resumable()
    with pytest.raises(profiling.BadInputError, match="lean: False there, True now"):
        profiling.Profiler(replace(spec, lean=True, latency_rank=max(spec.lora_ranks)), work).check_resumable()


def test_synth_refuses_ranks_it_cannot_write_before_writing_anything(tmp_path):
    from click.testing import CliRunner

    from planner import cli_harness

    for ranks in ("0", "", "8,-1"):
        res = CliRunner().invoke(cli_harness.synth, ["--out", str(tmp_path / "s"), "--adapter-ranks", ranks])
        assert res.exit_code == 2 and "--adapter-ranks must list positive ranks" in res.output, res.output
    assert not (tmp_path / "s").exists()


def test_validation_cases_span_regimes_and_differ_by_seed(make_profile):
    prof = make_profile(**{"kv_capacity.a_max_points": [1, 8, 32],
                           "kv_capacity.tokens": {str(r): [8192] * 3 for r in (8, 16, 32)},
                           "adapter_load_ms": {"by_max_lora_rank": {str(r): {str(r): 0.01} for r in (8, 16, 32)}},
                           "step_latency_ms": {"k4_ms_per_request": 0.3, "k5_ms": 4.0}})
    cases = validation.validation_cases(prof, 10, seed=1)
    assert len(cases) == 10 and {c.case_id for c in cases} == {f"v{i:02d}" for i in range(10)}
    assert min(c.load_factor for c in cases) == pytest.approx(0.3) and max(c.load_factor for c in cases) == 1.8
    for c in cases:
        assert max(a.rank for a in c.adapters) == c.max_lora_rank
        assert len({a.adapter_id for a in c.adapters}) == len(c.adapters)
    other = validation.validation_cases(prof, 10, seed=2)
    assert [c.adapters for c in other] != [c.adapters for c in cases]


def test_smape_and_summary_table():
    assert validation.smape(np.array([110.0, 90.0]), np.array([100.0, 100.0])) == pytest.approx(
        100 * np.mean([20 / 210, 20 / 190]))
    assert np.isnan(validation.smape(np.array([np.nan]), np.array([1.0])))
    row = {"a_max": 1, "max_lora_rank": 8,
           "real": {"starved": True, "total_throughput_tok_s": 100.0, "itl_ms_mean": 10.0, "ttft_ms_mean": 50.0},
           "twin": {"starved": False, "total_throughput_tok_s": 100.0, "itl_ms_mean": 10.0, "ttft_ms_mean": 50.0}}
    t = validation.summary_table([row, {**row, "twin": {**row["twin"], "starved": True}}])
    assert t["cases"] == 2 and t["starved_agreement_pct"] == 50.0 and t["throughput_smape_pct_all"] == 0.0
    assert np.isnan(t["itl_smape_pct_not_starved"])
    assert t["itl_smape_pct_within_engines"] == 0.0
    assert t["itl_engine_cases"] == 0 and np.isnan(t["itl_engine_smape_pct_all"])


def test_itl_within_engines_allows_each_engine_one_scale():
    """Engine a1-r8 runs 1.2x slower than the twin on both its cases, a2-r8 exactly as fast but with
    a +-10 % spread: one scale per engine removes the first error, not the second."""
    slow = {"a_max": 1, "max_lora_rank": 8, "twin": {"itl_ms_mean": 10.0}}
    rows = [{**slow, "real": {"itl_ms_mean": 12.0}}, {**slow, "real": {"itl_ms_mean": 12.0}},
            *({"a_max": 2, "max_lora_rank": 8, "twin": {"itl_ms_mean": 10.0}, "real": {"itl_ms_mean": v}}
              for v in (11.0, 10.0 / 1.1))]
    twin, real = ([r[s]["itl_ms_mean"] for r in rows] for s in ("twin", "real"))
    labels = [validation.engine_label(r) for r in rows]
    assert labels == ["a1-r8", "a1-r8", "a2-r8", "a2-r8"]
    ratios = group_log_ratios(twin, real, labels)
    assert ratios["a1-r8"] == pytest.approx(np.log(10 / 12)) and ratios["a2-r8"] == pytest.approx(0.0, abs=1e-12)
    left = smape_within_groups(twin, real, labels)
    assert left == pytest.approx(validation.smape([10.0, 10.0], [11.0, 10.0 / 1.1]) / 2)
    assert left < validation.smape(twin, real)


def test_calibration_recovers_a_known_slowdown(make_profile):
    """Real runs made by the twin with a 1.5x slower step: the search finds the scale back."""
    prof = make_profile(**{"step_latency_ms": {"k4_ms_per_request": 0.5, "k5_ms": 8.0, "kp_ms_per_prompt_token": 0.02},
                           "engine.max_num_batched_tokens": 512})
    slow = calibration.calibrated(prof.step_latency, np.array([*np.log([1.5, 1.5, 1.5]), 0.0]))
    runs = []
    for i, rate in enumerate((5.0, 20.0, 60.0)):
        wl = Workload((Adapter("a", 8, rate, 50, 20), Adapter("b", 8, rate / 2, 80, 10)))
        req = draw_requests(wl, 20.0, seed=i)
        real = simulate(wl, replace(prof, step_latency=slow), SimConfig(a_max=2, duration_s=20.0, warmup_s=2.0),
                        requests=req)
        runs.append(calibration.RecordedRun(f"c{i}", 2, 8, wl, req, real.to_dict()))
    fit = calibration.calibrate(prof, runs, 20.0, 2.0)
    assert fit.loss_after <= fit.loss_scales_only < 0.1 * fit.loss_before
    assert np.exp(fit.theta[0]) == pytest.approx(1.5, rel=0.15)


def test_itl_within_engines_skips_engines_with_one_case():
    """An engine with a single case is scored exactly by its own ratio: it is left out, and with only
    such engines there is nothing to report."""
    assert np.isnan(smape_within_groups([10.0, 20.0], [12.0, 15.0], ["a", "b"]))
    left = smape_within_groups([10.0, 10.0, 20.0], [11.0, 10.0 / 1.1, 15.0], ["a", "a", "b"])
    assert left == pytest.approx(smape_within_groups([10.0, 10.0], [11.0, 10.0 / 1.1], ["a", "a"]))


def test_probed_speed_rescales_the_twin(make_profile):
    """A case run by the twin on a machine 1.4x as slow, with probes of that machine around it: the probe
    ratio finds the speed, and the twin at that speed scores the case (nearly) exactly."""
    from serving_harness import speed_probe

    prof = make_profile(**{"step_latency_ms": {"k4_ms_per_request": 0.5, "k5_ms": 8.0, "kp_ms_per_prompt_token": 0.02},
                           "engine.max_num_batched_tokens": 512})
    slow = prof.slowed(1.4)
    wl = Workload((Adapter("a", 8, 20.0, 50, 20), Adapter("b", 8, 10.0, 80, 10)))
    req = draw_requests(wl, 20.0, seed=3)
    real = simulate(wl, slow, SimConfig(a_max=2, duration_s=20.0, warmup_s=2.0), requests=req).to_dict()
    run = calibration.RecordedRun("c0", 2, 8, wl, req, real)
    probe = speed_probe.twin_probe_itl_ms(slow, "a", 8, 2, 8)
    row = {"a_max": 2, "max_lora_rank": 8, "probe": {"adapter": "a", "rank": 8, "itl_ms": [probe * 0.9, probe / 0.9]}}
    out = validation.at_probe_speed(prof, row, run, 20.0, 2.0)
    assert out["speed"]["factor"] == pytest.approx(1.4, rel=1e-3)
    assert out["twin_at_speed"]["itl_ms_mean"] == pytest.approx(real["itl_ms_mean"], rel=1e-3)
    scored = {**row, **out, "real": real, "twin": calibration.twin_result(prof, run, 20.0, 2.0)}
    t = validation.summary_table([scored])
    assert t["probe_cases"] == 1 and t["itl_smape_pct_at_probe_speed"] < 0.1 < t["itl_smape_pct_all"]
    assert validation.probed(row) and not validation.probed({**row, "probe": {**row["probe"], "itl_ms": [None, 9.0]}})
    [flat] = validation.table_rows([{**scored, "case_id": "c0", "adapters": 2, "input_tokens": 50, "output_tokens": 20,
                                     "lengths": "constant", "load_factor": 1.0, "real_preemptions": 0.0}])
    assert flat["probe_speed_factor"] == pytest.approx(1.4, rel=1e-3)
    assert flat["twin_itl_at_probe_speed"] == out["twin_at_speed"]["itl_ms_mean"]
    unprobed = validation.summary_table([{k: v for k, v in scored.items() if k != "twin_at_speed"}])
    assert unprobed["probe_cases"] == 0 and "itl_smape_pct_at_probe_speed" not in unprobed


def test_the_lora_fit_keeps_every_term_a_cost():
    """The LoRA terms are least squares with each term >= 0: the plain fit where it is non-negative, else the
    best fit among the non-negative ones (a noisy CPU fit once gave l0 = -23 ms, a one-request step costing
    less than the backbone's)."""
    from scipy.optimize import nnls

    from serving_harness.profiling import _nonnegative_ols, _ols

    b = np.array([8.0, 8, 16, 16, 32, 32])
    a = np.array([1.0, 4, 2, 8, 4, 8])
    cols = [np.ones_like(b), b, a]
    clean = 2.0 + 0.5 * b + 1.5 * a
    assert _nonnegative_ols(cols, clean) == pytest.approx([2.0, 0.5, 1.5])
    noisy = -20.0 + 1.2 * b + 4.5 * a + np.array([0.3, -0.2, 0.1, 0.4, -0.3, 0.2])
    assert _ols(cols, noisy)[0] < 0
    fit = _nonnegative_ols(cols, noisy)
    assert (fit >= 0).all() and fit[0] == 0.0
    assert fit == pytest.approx(nnls(np.column_stack(cols), noisy)[0])  # SciPy's NNLS, the reference
