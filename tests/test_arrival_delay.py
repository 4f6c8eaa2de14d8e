"""The step latency's arrival delay, its calibration and the offline re-calibration / re-scoring of
stored runs (no vLLM)."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import LLAMA_HASH, QWEN_HASH, STEP_10MS, make_profile_dict

from models.surrogate import simulation_hash
from planner.cli import main as planner_cli
from serving_harness import calibration
from serving_harness.loadgen import RunRecords, summarise
from twin import Adapter, ProfileError, SimConfig, Workload, draw_requests, load_profile, simulate, trace_requests
from twin.policies import policy_from_name
from twin.profile import profile_from_dict, step_latency_to_dict


def test_arrival_delay_follows_the_model(make_profile):
    """Two requests arrive at 0 (prompt 10; 2 and 4 outputs), seen by the engine 20 ms later.
    Step 1 admits both: first tokens at 30 ms; A ends at 40 ms, B's tokens 3 and 4 come at 50 and 60 ms."""
    prof = make_profile(step_latency_ms={**STEP_10MS, "arrival_delay_ms": 20.0})
    wl = Workload((Adapter("a", 8, 0.0),))
    res = simulate(wl, prof, SimConfig(a_max=1, duration_s=100), trace_requests(wl, [0.0, 0.0], ["a", "a"], [10, 10], [2, 4]))
    assert res.ttft_ms_mean == pytest.approx(30.0)
    assert res.itl_ms_mean == pytest.approx(10.0)
    assert res.finished_requests == 2


def test_profiles_without_arrival_delay_keep_their_array_hash_and_json():
    for profile_id, digest in (("h100-64gb-llama-3.1-8b", LLAMA_HASH), ("h100-64gb-qwen2.5-7b", QWEN_HASH)):
        prof = load_profile(profile_id)
        assert len(prof.step_latency.as_array()) == 8 and simulation_hash(prof) == digest
        assert "arrival_delay_ms" not in step_latency_to_dict(prof.step_latency)
        with_delay = replace(prof, step_latency=replace(prof.step_latency, arrival_delay=1.0))
        assert with_delay.step_latency.as_array()[8:] == [1.0] and simulation_hash(with_delay) != digest


def test_arrival_delay_round_trips_and_must_not_be_negative():
    d = make_profile_dict(step_latency_ms={**STEP_10MS, "arrival_delay_ms": 2.5})
    lat = profile_from_dict(d).step_latency
    assert lat.arrival_delay == 2.5
    assert profile_from_dict({**d, "step_latency_ms": step_latency_to_dict(lat)}).step_latency == lat
    d["step_latency_ms"]["arrival_delay_ms"] = -1.0
    with pytest.raises(ProfileError, match="arrival_delay_ms must be >= 0"):
        profile_from_dict(d)


def test_policies_take_the_arrival_delay(make_profile):
    wl = Workload((Adapter("a", 8, 1.0, 10, 2),))
    config = SimConfig(a_max=1, duration_s=10, policy=policy_from_name("chameleon"))
    delayed = make_profile(step_latency_ms={**STEP_10MS, "arrival_delay_ms": 20.0})
    plain = make_profile(step_latency_ms=STEP_10MS)
    assert simulate(wl, delayed, config).ttft_ms_mean == pytest.approx(simulate(wl, plain, config).ttft_ms_mean + 20.0)


BASE_LATENCY = {"k4_ms_per_request": 0.5, "k5_ms": 8.0, "kp_ms_per_prompt_token": 0.02}
#: The "real" engine of the synthetic runs: 1.2x the fixed term and a 30 ms arrival delay.
TRUTH = np.array([np.log(1.2), 0.0, 0.0, 30.0])


def synthetic_runs(prof, seed0: int) -> list[calibration.RecordedRun]:
    truth = replace(prof, step_latency=calibration.calibrated(prof.step_latency, TRUTH))
    runs = []
    for i, rate in enumerate((5.0, 20.0, 60.0)):
        wl = Workload((Adapter("a", 8, rate, 50, 20), Adapter("b", 8, rate / 2, 80, 10)))
        req = draw_requests(wl, 20.0, seed=seed0 + i)
        real = simulate(wl, truth, SimConfig(a_max=2, duration_s=20.0, warmup_s=2.0, request_times=True),
                        requests=req)
        runs.append(calibration.RecordedRun(f"c{i}", 2, 8, wl, req, {**real.to_dict(), "times": real.request_times}))
    return runs


def test_calibration_recovers_an_arrival_delay(make_profile):
    prof = make_profile(**{"step_latency_ms": BASE_LATENCY, "engine.max_num_batched_tokens": 512})
    fit = calibration.calibrate(prof, synthetic_runs(prof, 0), 20.0, 2.0)
    assert fit.loss_after < 0.01 * fit.loss_scales_only
    assert np.exp(fit.theta[0]) == pytest.approx(1.2, rel=0.05) and fit.theta[3] == pytest.approx(30.0, abs=2.0)


def store_runs(work, runs: list[calibration.RecordedRun]) -> None:
    """Save runs as `planner validate` does: a case JSON and a request parquet per run."""
    for run in runs:
        names = [a.adapter_id for a in run.workload.adapters]
        req, (first, finish) = run.requests, run.real["times"].T
        RunRecords(np.arange(len(req)), np.array([names[a] for a in req.adapter], dtype=object), req.arrival_s,
                   req.arrival_s, first, finish, req.input_tokens.astype(np.int64), req.output_tokens.astype(np.int64),
                   req.output_tokens.astype(np.int64), np.full(len(req), "", dtype=object),
                   ).to_parquet(work / "runs" / f"{run.case_id}-requests.parquet")
        case = {"case_id": run.case_id, "a_max": run.a_max, "max_lora_rank": run.max_lora_rank,
                "adapters": len(names), "adapter_ids": names, "ranks": [a.rank for a in run.workload.adapters],
                "rates_rps": [a.rate_rps for a in run.workload.adapters], "input_tokens": 50.0,
                "output_tokens": 20.0, "lengths": "constant", "load_factor": 1.0,
                "real": {k: v for k, v in run.real.items() if k != "times"},
                "real_preemptions": 0.0}
        (work / "cases").mkdir(parents=True, exist_ok=True)
        (work / "cases" / f"{run.case_id}.json").write_text(json.dumps(case), encoding="utf-8")


def test_stored_runs_replay_what_was_sent_when_it_was_sent(tmp_path, make_profile):
    """A load generator short of CPU sends late; the twin replays the send times (a request never sent keeps
    its drawn time), each with its own adapter and lengths."""
    prof = make_profile(step_latency_ms=BASE_LATENCY)
    (run,) = synthetic_runs(prof, 0)[:1]
    store_runs(tmp_path, [run])
    path = tmp_path / "runs" / "c0-requests.parquet"
    rec = RunRecords.from_parquet(path)
    rec.sent_s = rec.sent_s.copy()
    late = (rec.arrival_s > 5.0) & (rec.arrival_s < 5.5)  # a 0.5 s stall: all sent at its end
    rec.sent_s[late] = 5.5
    rec.sent_s[-1] = np.nan
    rec.to_parquet(path)
    row = json.loads((tmp_path / "cases" / "c0.json").read_text(encoding="utf-8"))
    recorded = calibration.recorded_run(tmp_path, row, 20.0, 2.0)
    replayed = recorded.requests
    assert recorded.real == {**asdict(summarise(rec, 20.0, 2.0)), "itl_ms_engine": pytest.approx(np.nan, nan_ok=True)}
    sent = np.where(np.isfinite(rec.sent_s), rec.sent_s, rec.arrival_s)
    order = np.argsort(sent, kind="stable")
    assert late.sum() >= 2 and np.array_equal(replayed.arrival_s, sent[order])
    assert np.all(np.diff(replayed.arrival_s) >= 0) and replayed.arrival_s[-1] == rec.arrival_s[-1]
    names = [a.adapter_id for a in run.workload.adapters]
    assert [names[i] for i in replayed.adapter] == list(rec.adapter[order])
    assert np.array_equal(replayed.input_tokens, rec.input_tokens[order])


def test_offline_calibrate_and_rescore_from_stored_runs(tmp_path, make_profile):
    micro = make_profile_dict(**{"step_latency_ms": BASE_LATENCY, "engine.max_num_batched_tokens": 512})
    prof = profile_from_dict(micro)
    cal, val = tmp_path / "calibration", tmp_path / "validation"
    store_runs(cal, synthetic_runs(prof, 0))
    store_runs(val, synthetic_runs(prof, 10))
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({
        **micro, "step_latency_variants": {"microbenchmarks": micro["step_latency_ms"]},
        "provenance": {"kind": "test", "calibration": {"runs": str(cal), "seed": 7, "duration_s": 20.0, "warmup_s": 2.0}},
        "validation": {"itl_smape_pct_all": 99.0}}), encoding="utf-8")
    runner = CliRunner()

    out = runner.invoke(planner_cli, ["calibrate", "--profile", str(path)])
    assert out.exit_code == 0, out.output
    data = json.loads(path.read_text(encoding="utf-8"))
    fit = data["provenance"]["calibration"]
    assert fit["arrival_delay_ms"] == pytest.approx(30.0, abs=2.0)
    assert fit["command"].startswith("planner ") and "validation" not in data
    assert data["step_latency_ms"]["arrival_delay_ms"] == fit["arrival_delay_ms"]

    out = runner.invoke(planner_cli, ["rescore", "--profile", str(path), "--work-dir", str(val),
                                          "--out-dir", str(tmp_path / "out"), "--duration", "20", "--warmup", "2",
                                          "--record"])
    assert out.exit_code == 0, out.output
    summary = json.loads((tmp_path / "out" / "table.json").read_text(encoding="utf-8"))["summary"]
    assert summary["cases"] == 3 and summary["throughput_smape_pct_all"] < 2.0
    assert json.loads(path.read_text(encoding="utf-8"))["validation"]["itl_smape_pct_all"] == summary["itl_smape_pct_all"]

    out = runner.invoke(planner_cli, ["rescore", "--profile", str(path), "--work-dir", str(cal)])
    assert out.exit_code == 2 and "calibrated on" in out.output

    # refitted to another set of runs, the profile records that set's seed (the one `validate --record` refuses)
    other = tmp_path / "other-calibration"
    store_runs(other, synthetic_runs(prof, 20))
    (other / "workloads.json").write_text(json.dumps({"count": 3, "seed": 8, "cases": []}), encoding="utf-8")
    out = runner.invoke(planner_cli, ["calibrate", "--profile", str(path), "--runs", str(other), "--runs",
                                      str(other / "." / "")])  # one directory given twice counts once
    assert out.exit_code == 0, out.output
    fit = json.loads(path.read_text(encoding="utf-8"))["provenance"]["calibration"]
    assert fit["seed"] == 8 and fit["runs"] == str(other)
    unknown = tmp_path / "unknown-seed"  # runs without workloads.json: no seed recorded rather than another set's
    store_runs(unknown, synthetic_runs(prof, 30))
    out = runner.invoke(planner_cli, ["calibrate", "--profile", str(path), "--runs", str(unknown)])
    assert out.exit_code == 0 and json.loads(path.read_text(encoding="utf-8"))["provenance"]["calibration"]["seed"] is None


def test_calibrate_pools_runs_of_one_workload_set_from_several_work_dirs(tmp_path, make_profile):
    """The same calibration workloads run on two days are fitted as one set; both dirs are recorded and
    neither can be scored as validation; runs of another workload set are not pooled in."""
    micro = make_profile_dict(**{"step_latency_ms": BASE_LATENCY, "engine.max_num_batched_tokens": 512})
    prof = profile_from_dict(micro)
    days = [tmp_path / "monday", tmp_path / "tuesday", tmp_path / "other-set"]
    for i, (work, seed) in enumerate(zip(days, (8, 8, 9))):
        store_runs(work, synthetic_runs(prof, 10 * i))
        (work / "workloads.json").write_text(json.dumps({"count": 3, "seed": seed, "cases": []}), encoding="utf-8")
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**micro, "provenance": {"kind": "measured"}}), encoding="utf-8")
    runner = CliRunner()

    out = runner.invoke(planner_cli, ["calibrate", "--profile", str(path), "--runs", str(days[0]),
                                      "--runs", str(days[1]), "--duration", "20", "--warmup", "2"])
    assert out.exit_code == 0, out.output
    fit = json.loads(path.read_text(encoding="utf-8"))["provenance"]["calibration"]
    assert fit["runs"] == [str(days[0]), str(days[1])] and fit["workloads"] == 6 and fit["seed"] == 8
    assert fit["arrival_delay_ms"] == pytest.approx(30.0, abs=2.0)
    for work in days[:2]:
        out = runner.invoke(planner_cli, ["rescore", "--profile", str(path), "--work-dir", str(work),
                                          "--out-dir", str(tmp_path / "out")])
        assert out.exit_code == 2 and "calibrated on" in out.output

    out = runner.invoke(planner_cli, ["calibrate", "--profile", str(path), "--runs", str(days[0]),
                                      "--runs", str(days[2])])
    assert out.exit_code == 2 and "seeds 8, 9" in out.output
    # refitted without --runs: the pooled dirs recorded before
    out = runner.invoke(planner_cli, ["calibrate", "--profile", str(path)])
    assert out.exit_code == 0 and json.loads(path.read_text(encoding="utf-8"))["provenance"]["calibration"]["runs"] == fit["runs"]
    # a calibration that names no runs, and none given: a clear error, not a crash
    path.write_text(json.dumps({**micro, "step_latency_variants": {"microbenchmarks": micro["step_latency_ms"]},
                                "provenance": {"kind": "measured", "calibration": {"seed": 8}}}), encoding="utf-8")
    out = runner.invoke(planner_cli, ["calibrate", "--profile", str(path)])
    assert out.exit_code == 2 and "records no runs" in out.output
