"""Shipped profiles load and say where they come from; bad profiles are refused clearly."""

from __future__ import annotations

import json

import pytest
from conftest import make_profile_dict

from twin import ProfileError, list_profiles, load_profile
from twin.profile import admission_rule_for_version, profile_from_dict


def test_shipped_profiles_reproduce_the_study_tables():
    shipped, problems = list_profiles()
    ids = {p.profile_id for p in shipped}
    assert not problems
    assert {"h100-64gb-llama-3.1-8b", "h100-64gb-qwen2.5-7b"} <= ids
    llama = load_profile("h100-64gb-llama-3.1-8b")
    assert llama.kv.tokens_for(64, 16) == 256640  # Mem_max table, study notes §2.5
    assert {r: llama.kv.max_a_max(r) for r in (8, 16, 32)} == {8: 384, 16: 224, 32: 96}
    assert llama.step_latency.k4 == pytest.approx(0.0437994, rel=1e-6)
    assert llama.step_latency.k5 == pytest.approx(10.54174836, rel=1e-8)
    qwen = load_profile("h100-64gb-qwen2.5-7b")
    assert qwen.kv.no_lora_tokens == 711200 and qwen.kv.max_a_max(32) == 224
    assert qwen.engine.admission_rule == "first_chunk"  # vLLM 0.8.5
    for p in (llama, qwen):
        assert "command" in p.provenance and "study" in p.step_latency_variants


def test_admission_rule_follows_engine_version():
    assert admission_rule_for_version("0.8.5") == "first_chunk"
    assert admission_rule_for_version("0.32.0+cpu") == "full_prompt"


@pytest.mark.parametrize("change,expect", [
    ({"schema_version": 99}, "schema_version is 99"),
    ({"engine.block_size": 0}, "engine.block_size must be > 0"),
    ({"kv_capacity.tokens": {"8": [100, 200]}}, "must list 1 values"),
    ({"kv_capacity.a_max_points": [8, 16], "kv_capacity.tokens": {"8": [100, 200]}}, "must not increase"),
    ({"step_latency_ms": {"k5_ms": 1.0}}, "step_latency_ms.k4_ms_per_request is missing"),
    ({"provenance": {}}, "provenance must say how"),
    ({"adapter_load_ms": {"by_max_lora_rank": {"8": {"8": 1.0}}}}, "lacks ranks [16]"),
    ({"engine.prefix_caching": True}, "prefix_caching"),
])
def test_bad_profiles_name_the_key(change, expect):
    with pytest.raises(ProfileError) as exc:
        profile_from_dict(make_profile_dict(**change), where="bad.json")
    assert expect in str(exc.value) and str(exc.value).startswith("bad.json")


def test_unknown_profile_and_unreadable_file(tmp_path):
    with pytest.raises(ProfileError, match="unknown profile 'nope'.*shipped profiles"):
        load_profile("nope")
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="cannot read profile JSON"):
        load_profile(bad)
    good = tmp_path / "q.json"
    good.write_text(json.dumps(make_profile_dict()))
    assert load_profile(good).profile_id == "test-profile"


@pytest.mark.parametrize("planning, words", [
    (None, "its safety margin is not measured against real runs"),
    ({"slowdown": 1.1, "real_runs": 5}, "its safety margin rests on 5 real runs (plan-grade from 10"),
    ({"slowdown": 1.1, "real_runs": 10}, None),
])
def test_a_profile_is_plan_grade_once_its_margin_rests_on_ten_real_runs(planning, words):
    d = make_profile_dict()
    if planning is not None:
        d["planning"] = planning
    note = profile_from_dict(d).plan_grade_note()
    assert note == words if words is None else words in note


def test_the_shipped_profiles_say_which_are_plan_grade_and_plans_of_the_others_say_so(tmp_path):
    from click.testing import CliRunner

    from planner.cli import main

    grade = {p["profile_id"]: p["plan_grade"] for p in json.loads(CliRunner().invoke(main, ["profiles", "--json"]).output)}
    assert grade == {"h100-64gb-llama-3.1-8b": True, "h100-64gb-qwen2.5-7b": True, "cpu-2core-tiny-llama": True,
                     "h100-80gb-llama-3.1-8b": False}
    res = CliRunner().invoke(main, ["plan", "datasets/workloads/small-8-adapters.csv", "--profile",
                                    "h100-80gb-llama-3.1-8b"])
    assert res.exit_code == 0 and "note: profile h100-80gb-llama-3.1-8b is not plan-grade: its safety margin rests " \
                                  "on 5 real runs" in res.output, res.output


def test_an_install_without_the_shipped_profiles_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("LORA_PLANNER_ARTIFACTS", str(tmp_path))
    for call in (list_profiles, lambda: load_profile("h100-64gb-llama-3.1-8b")):
        with pytest.raises(ProfileError, match=f"no shipped profiles: {tmp_path}/profiles is not there"):
            call()


def test_one_unreadable_file_among_the_profiles_is_named_and_the_rest_listed(tmp_path, monkeypatch):
    import shutil

    from click.testing import CliRunner

    from planner.cli import main
    from twin.profile import profiles_dir

    shutil.copytree(profiles_dir(), tmp_path / "profiles")
    (tmp_path / "profiles" / "half-written.json").write_text('{"profile_id": ', encoding="utf-8")
    monkeypatch.setenv("LORA_PLANNER_ARTIFACTS", str(tmp_path))
    res = CliRunner().invoke(main, ["profiles", "--json"])
    assert res.exit_code == 0, res.output
    assert {p["profile_id"] for p in json.loads(res.stdout)} >= {"h100-64gb-llama-3.1-8b", "h100-64gb-qwen2.5-7b"}
    assert "warning: skipped" in res.stderr and "half-written.json: cannot read profile JSON" in res.stderr
