"""The planner CLI: profiles and simulate, human and --json output."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from planner.cli import main

WL = "datasets/workloads/small-8-adapters.csv"
KEYS = {"total_throughput_tok_s", "input_throughput_tok_s", "output_throughput_tok_s", "arriving_tok_s", "starved",
        "itl_ms_mean", "ttft_ms_mean", "ttft_ms_p99", "arrived_requests", "finished_requests", "preemptions",
        "sim_wall_s"}


def test_simulate_json_has_the_documented_keys():
    res = CliRunner().invoke(main, ["simulate", WL, "--a-max", "8", "--duration", "600", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert KEYS <= out.keys()
    assert out["starved"] is False and out["finished_requests"] > 0


def test_simulate_multi_turn_chat_recomputes_history_in_stock_vllm_and_reuses_it_in_elora():
    args = ["simulate", WL, "--a-max", "8", "--duration", "600", "--turns", "4", "--think-time", "20"]
    stock = json.loads(CliRunner().invoke(main, [*args, "--json"]).output)
    elora = CliRunner().invoke(main, [*args, "--policy", "elora"])
    assert elora.exit_code == 0, elora.output
    assert stock["conversations"] == "4 turns, think 20 s" and stock["policy_stats"] is None
    assert "history KV (4 turns, think 20 s)" in elora.output and "of history tokens reused" in elora.output
    single = json.loads(CliRunner().invoke(main, [*args[:6], "--json"]).output)
    # Each turn carries its conversation so far: more prompt tokens arrive at the same request rate.
    assert stock["arriving_tok_s"] > 1.5 * single["arriving_tok_s"]
    assert single["conversations"] is None


def test_simulate_overload_and_unpredictable_and_human_output():
    res = CliRunner().invoke(main, ["simulate", "datasets/workloads/high-rate-64-adapters.csv", "--a-max", "16",
                                    "--profile", "h100-64gb-qwen2.5-7b", "--duration", "300",
                                    "--arrivals", "unpredictable", "--seed", "3"])
    assert res.exit_code == 0, res.output
    assert "STARVED" in res.output and "throughput" in res.output


def test_memory_error_exits_3():
    res = CliRunner().invoke(main, ["simulate", "datasets/workloads/mixed-ranks-128-adapters.csv", "--a-max", "128",
                                    "--duration", "10"])
    assert res.exit_code == 3
    assert "memory error" in res.output and "at most --max-loras 96" in res.output


def test_profiles_lists_provenance():
    res = CliRunner().invoke(main, ["profiles", "--json"])
    assert res.exit_code == 0
    items = json.loads(res.output)
    assert any(i["default"] for i in items) and all(i["provenance"] for i in items)


def test_the_readme_example_is_what_the_readme_command_prints():
    """The README shows a real plan: the output of its own first command, as it is today."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    prompt = "$ planner plan datasets/workloads/mixed-ranks-128-adapters.csv\n"
    shown = readme[readme.index(prompt) + len(prompt):].split("```", 1)[0]
    res = CliRunner().invoke(main, ["plan", str(Path(__file__).resolve().parents[1] / "datasets" / "workloads"
                                                / "mixed-ranks-128-adapters.csv")])
    assert res.exit_code == 0
    assert res.output == shown


def test_commands_that_judge_a_plan_again_say_its_objective_is_the_plans_unless_given():
    for command in ("replan", "evaluate"):
        res = CliRunner().invoke(main, [command, "--help"])
        assert "queues allowed. [the plan's]" in " ".join(res.output.split()), command
    assert "queues allowed. [slo]" in " ".join(CliRunner().invoke(main, ["plan", "--help"]).output.split())


def test_a_throughput_plan_is_judged_again_by_its_objective_and_says_no_ttft_limit(tmp_path):
    plan = tmp_path / "plan.json"
    res = CliRunner().invoke(main, ["plan", WL, "--objective", "throughput", "--out", str(plan)])
    assert res.exit_code == 0, res.output
    assert "no latency bound" in res.output and "TTFT limit" not in res.output
    ev = CliRunner().invoke(main, ["evaluate", str(plan), WL])
    assert ev.exit_code == 0 and "p99 TTFT <=" not in ev.output.splitlines()[0] and "TTFT limit" not in ev.output


def test_evaluate_says_which_of_the_plans_adapters_the_workload_lacks(tmp_path):
    plan = tmp_path / "plan.json"
    assert CliRunner().invoke(main, ["plan", WL, "--out", str(plan)]).exit_code == 0
    fewer = tmp_path / "fewer.csv"
    lines = Path(WL).read_text().splitlines()
    fewer.write_text("\n".join(lines[:-2]) + "\n")
    res = CliRunner().invoke(main, ["evaluate", str(plan), str(fewer)])
    gone = [line.split(",")[0] for line in lines[-2:]]
    assert res.exit_code == 0 and f"not in {fewer}: 2 of the plan's adapters, judged with no traffic: " \
                                  f"{', '.join(sorted(gone))}" in res.output, res.output


def test_an_adapter_its_own_slo_leaves_no_gpu_for_is_refused_naming_that_slo(tmp_path):
    wl = tmp_path / "w.csv"
    wl.write_text("adapter_id,rank,rate_rps,max_ttft_s\nx,8,1,0.01\nb,8,1,\n")
    res = CliRunner().invoke(main, ["plan", str(wl)])
    assert res.exit_code == 3 and "adapter x cannot be served" in res.output
    assert "within its own max_ttft_s 0.01 (loosen it in the workload)" in res.output, res.output


def test_unknown_predictors_and_policy_parameters_are_refused_with_what_is_allowed():
    res = CliRunner().invoke(main, ["plan", WL, "--predictor", "nope"])
    assert res.exit_code == 2 and "choose one of auto, small-tree, surrogate, twin" in res.output, res.output
    res = CliRunner().invoke(main, ["plan", WL, "--policy", "chameleon", "--policy-param", "queues=abc"])
    assert res.exit_code == 2 and "queues must be a whole number" in res.output, res.output


def test_evaluate_at_another_load_shows_the_traffic_it_simulated(tmp_path):
    plan = tmp_path / "plan.json"
    assert CliRunner().invoke(main, ["plan", WL, "--out", str(plan)]).exit_code == 0
    arriving = json.loads(plan.read_text())["instances"][0]["arriving_tok_s"]
    res = CliRunner().invoke(main, ["evaluate", str(plan), WL, "--load", "2", "--seed", "1"])
    assert f"of {2 * arriving:,.0f} tok/s (2 x {arriving:,.0f})" in res.output, res.output
