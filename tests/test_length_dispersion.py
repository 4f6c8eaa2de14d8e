"""Request-length dispersion and the reserved-slot LoRA cost: the profile terms the real Qwen runs
called for (serving_harness/published_profiles.py)."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import LLAMA_HASH, STEP_10MS, make_profile_dict

from models.surrogate import simulation_hash
from planner.cli import main as planner_cli
from twin import Adapter, LengthModel, ProfileError, SimConfig, Workload, load_profile, simulate
from twin.core import step_ms
from twin.profile import profile_from_dict, step_latency_to_dict


def test_long_tailed_lengths_hold_slots_longer(make_profile):
    """64 adapters, 2 GPU slots, a client holding at most 128 requests (the real runs' port limit):
    an adapter keeps its slot until its last request ends. Constant lengths let a slot's batch end
    together; log-normal ones leave the slot held by the longest request, so fewer requests run."""
    prof = make_profile(step_latency_ms=STEP_10MS, **{"defaults.length_cv": 0.9, "engine.max_num_batched_tokens": 2048})
    wl = Workload(tuple(Adapter(f"a{i}", 8, 0.5, 10, 50) for i in range(64)))
    dispersed = simulate(wl, prof, SimConfig(a_max=2, duration_s=120, max_in_flight=128))
    constant = simulate(wl, prof, SimConfig(a_max=2, duration_s=120, max_in_flight=128, lengths=LengthModel()))
    assert dispersed.lengths == "lognormal cv=0.9/0.9" and constant.lengths == "constant"
    assert constant.starved and dispersed.total_throughput_tok_s < 0.8 * constant.total_throughput_tok_s


def test_length_cv_is_validated_and_defaults_to_constant(make_profile):
    assert make_profile().default_lengths() == LengthModel()
    with pytest.raises(ProfileError, match="length_cv must be >= 0"):
        profile_from_dict(make_profile_dict(**{"defaults.length_cv": -0.5}))


def test_slot_term_folds_into_the_servers_step():
    d = make_profile_dict(step_latency_ms={**STEP_10MS, "l3_ms_per_slot_rank": 0.003})
    lat = profile_from_dict(d).step_latency
    assert profile_from_dict({**d, "step_latency_ms": step_latency_to_dict(lat)}).step_latency == lat
    server = np.array(lat.for_server(128, 32).as_array())
    assert step_ms(server, 4, 0, 3) == pytest.approx(10.0 + 0.003 * 128 * 32)
    assert step_ms(server, 4, 0, 0) == pytest.approx(10.0)  # no LoRA in the batch, no LoRA cost
    d["step_latency_ms"]["l3_ms_per_slot_rank"] = -1.0
    with pytest.raises(ProfileError, match="l3_ms_per_slot_rank must be >= 0"):
        profile_from_dict(d)


def test_both_h100_profiles_carry_the_real_run_terms_with_their_own_k7():
    qwen, llama = load_profile("h100-64gb-qwen2.5-7b"), load_profile("h100-64gb-llama-3.1-8b")
    for p in (qwen, llama):
        assert p.default_length_cv == 0.9 and p.step_latency.l3 == 0.003 and p.step_latency.k7 == 100.0
        assert p.step_latency.l0 == 3.4
        assert p.with_latency_variant("eq1").step_latency.k7 > 150  # the study's multiplicative form, kept
    # l1 matches each model's own eq. 1 LoRA share at the profiling batch of 220
    for p in (qwen, llama):
        eq1 = p.with_latency_variant("eq1").step_latency
        assert 3.4 + p.step_latency.l1 * 220 == pytest.approx((eq1.k7 / 100 - 1) * (eq1.k5 + eq1.k4 * 220))
    assert llama.step_latency.l1 > qwen.step_latency.l1  # Llama's K7 (200 %) is above Qwen's (178 %)
    assert simulation_hash(llama) == LLAMA_HASH


def test_simulate_cli_length_options(tmp_path):
    wl = tmp_path / "w.csv"
    wl.write_text("adapter_id,rank,rate_rps\na,8,0.5\n")
    run = CliRunner().invoke
    out = run(planner_cli, ["simulate", str(wl), "--a-max", "1", "--duration", "20", "--profile", "h100-64gb-qwen2.5-7b",
                            "--json"])
    assert out.exit_code == 0 and '"lengths": "lognormal cv=0.9/0.9"' in out.output
    out = run(planner_cli, ["simulate", str(wl), "--a-max", "1", "--duration", "20", "--length-cv", "0.5", "--json"])
    assert out.exit_code == 0 and '"lengths": "lognormal cv=0.5/0.5"' in out.output
    out = run(planner_cli, ["simulate", str(wl), "--a-max", "1", "--lengths", "constant", "--length-cv", "1"])
    assert out.exit_code == 2 and "--length-cv needs log-normal lengths" in out.output
