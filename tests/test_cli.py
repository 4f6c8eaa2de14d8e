"""The planner CLI: profiles and simulate, human and --json output."""

from __future__ import annotations

import json

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
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    prompt = "$ planner plan datasets/workloads/mixed-ranks-128-adapters.csv\n"
    shown = readme[readme.index(prompt) + len(prompt):].split("```", 1)[0]
    res = CliRunner().invoke(main, ["plan", str(Path(__file__).resolve().parents[1] / "datasets" / "workloads"
                                                / "mixed-ranks-128-adapters.csv")])
    assert res.exit_code == 0
    assert res.output == shown
