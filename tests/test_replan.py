"""The nightly re-plan (planner.replan): idempotent, repairing, consolidating, explained, deployable."""

from __future__ import annotations

import json
import os
import shlex
import stat
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner.cli import main
from twin.families import family_workload, fleet_nights, write_workload_csv
from twin.workload import Workload

README = Path(__file__).resolve().parents[1] / "README.md"


def _run(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res


def _plan(tmp_path, wl: Workload, name="plan.json"):
    csv, out = tmp_path / "w.csv", tmp_path / name
    write_workload_csv(wl, csv)
    res = _run("plan", csv, "--out", out)
    assert res.exit_code == 0, res.output
    return csv, out


def test_the_same_workload_changes_nothing(tmp_path):
    csv, plan = _plan(tmp_path, family_workload("zipf", 300, 0))
    res = _run("replan", csv, "--previous", plan, "--out", tmp_path / "same.json", "--json")
    assert res.exit_code == 0, res.output
    ch = json.loads(res.stdout)["changes"]
    assert ch["moved_adapters"] == [] and ch["restarts"] == [] and ch["new_instances"] == []
    assert ch["removed_instances"] == [] and all(not c["load"] and not c["unload"] for c in ch["instances"])


def test_a_plan_with_headroom_is_re_planned_with_it_unless_told_otherwise(tmp_path):
    """The nightly line names no --headroom: the previous plan's holds (the same workload changes nothing), not
    0, which would empty the GPUs the headroom paid for; --headroom 0 says so and consolidates."""
    wl = family_workload("zipf", 300, 0)
    csv, out = tmp_path / "w.csv", tmp_path / "plan.json"
    write_workload_csv(wl, csv)
    res = _run("plan", csv, "--headroom", "0.5", "--out", out)
    assert res.exit_code == 0, res.output
    gpus = json.loads(out.read_text())["summary"]["gpus"]
    res = _run("replan", csv, "--previous", out, "--out", tmp_path / "same.json", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["inputs"]["headroom"] == 0.5 and doc["summary"]["gpus"] == gpus
    assert doc["changes"]["moved_adapters"] == [] and doc["changes"]["new_instances"] == []
    res = _run("replan", csv, "--previous", out, "--out", tmp_path / "none.json", "--json", "--headroom", "0")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["inputs"]["headroom"] == 0 and doc["summary"]["gpus"] < gpus and doc["changes"]["moved_adapters"]


def test_a_plan_with_one_latency_limit_is_re_planned_by_that_limit_alone(tmp_path):
    """`--objective throughput --max-tpot 400` records a bar with a TPOT limit and no TTFT one: the re-plan judges
    by it, not by the default SLO's 2 s TTFT as well (which moved a hot adapter's replica off a GPU whose queue the
    plan allows)."""
    wl = family_workload("hot", 80, 131)
    csv, out = tmp_path / "w.csv", tmp_path / "plan.json"
    write_workload_csv(wl, csv)
    res = _run("plan", csv, "--objective", "throughput", "--max-tpot", "400", "--out", out)
    assert res.exit_code == 0, res.output
    res = _run("replan", csv, "--previous", out, "--out", tmp_path / "same.json", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert {i["twin"]["max_ttft_ms"] for i in doc["instances"]} == {None}
    assert {i["twin"]["max_tpot_ms"] for i in doc["instances"]} == {400.0}
    assert doc["changes"]["moved_adapters"] == [] and doc["changes"]["new_instances"] == []


def test_the_fresh_plan_a_re_plan_measures_itself_by_is_not_bound_by_the_gpus_allowed(tmp_path, monkeypatch):
    """A pool plan packs a kind's share otherwise than a fresh greedy plan of it, which can take more GPUs than
    the kind's count (2,000 adapters over 30 reserved GPUs: 31); that yardstick then saves no GPU, and must not
    fail the re-plan of the same workload (it did: exit 3, not enough GPUs), nor a plan within --gpus."""
    import planner.replan
    from planner.packing import not_enough_gpus

    packed = planner.replan._Replan.packed

    def fresh_needs_one_more(self, entries, max_gpus):  # entries None: the fresh plan of the day
        groups, rows = packed(self, entries, max_gpus)
        if entries is not None:
            return groups, rows
        if len(groups) >= max_gpus:
            raise not_enough_gpus(self.req, [0], max_gpus)
        return groups + groups[:1], rows + rows[:1]

    monkeypatch.setattr(planner.replan._Replan, "packed", fresh_needs_one_more)
    csv, plan = _plan(tmp_path, family_workload("zipf", 300, 0))
    gpus = json.loads(plan.read_text())["summary"]["gpus"]
    res = _run("replan", csv, "--previous", plan, "--out", tmp_path / "same.json", "--json", "--gpus", gpus)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["changes"]["moved_adapters"] == [] and doc["summary"]["gpus"] == gpus
    assert doc["changes"]["fresh_plan_gpus"] == gpus + 1


def test_the_same_workload_with_a_hot_adapter_in_thirds_changes_nothing(tmp_path):
    """Three replicas of a third are written as 0.333333 each: read back they serve the adapter in full, not
    leave a 0.000001 share to place on a fourth GPU."""
    from twin.workload import Adapter

    wl = Workload((Adapter("hot", 8, 66.0), *family_workload("log-uniform", 30, 0).adapters))
    csv, plan = _plan(tmp_path, wl)
    shares = [a["share"] for i in json.loads(plan.read_text())["instances"] for a in i["adapters"]
              if a["adapter_id"] == "hot"]
    assert len(shares) == 3 and sum(shares) < 1.0
    res = _run("replan", csv, "--previous", plan, "--out", tmp_path / "same.json", "--json")
    assert res.exit_code == 0, res.output
    ch = json.loads(res.stdout)["changes"]
    assert ch["moved_adapters"] == [] and ch["new_instances"] == []
    assert all(not c["load"] and not c["unload"] for c in ch["instances"])


def test_replicas_written_as_slightly_more_than_the_whole_read_back_as_the_whole(tmp_path):
    """Halves written rounded as 0.500005 and 0.499996 (as a repaired split can be) sum to 1.000001: merged on one
    GPU they were written as a share above 1, a placement `planner evaluate` refused. Read back, they sum to 1."""
    from models.predictor import load_predictor
    from planner.placement import read_placement
    from planner.plan import PlanOptions, pack_request
    from planner.replan import ChurnBudget, _Judge, _Replan
    from planner.verdict import DEFAULT_BAR, DEFAULT_RUN
    from twin import load_profile
    from twin.workload import Adapter

    wl = Workload((Adapter("hot", 8, 40.0), *family_workload("log-uniform", 30, 0).adapters))
    csv, plan = _plan(tmp_path, wl)
    doc = json.loads(plan.read_text())
    halves = [a for i in doc["instances"] for a in i["adapters"] if a["adapter_id"] == "hot"]
    assert len(halves) == 2
    halves[0]["share"], halves[1]["share"] = 0.500005, 0.499996
    plan.write_text(json.dumps(doc))
    profile = load_profile()
    req = pack_request(wl, profile, load_predictor(profile, "surrogate"), PlanOptions())
    work = _Replan(read_placement(plan), req, _Judge(req, DEFAULT_RUN, DEFAULT_BAR, True), ChurnBudget(), True, None)
    shares = [s.shares[0] for s in work.slots if 0 in s.shares]
    assert abs(sum(shares) - 1.0) < 1e-12 and not work.pending
    res = _run("replan", csv, "--previous", plan, "--out", tmp_path / "again.json")
    assert res.exit_code == 0, res.output
    assert _run("evaluate", tmp_path / "again.json", csv).exit_code == 0


def test_a_busier_day_is_repaired_and_every_move_and_restart_says_why(tmp_path):
    """10 % of the adapters three times as busy, 5 % gone, 5 % new."""
    wl = family_workload("log-uniform", 400, 3)
    _csv, plan = _plan(tmp_path, wl)
    kept = [replace(a, rate_rps=a.rate_rps * (3 if k % 10 == 0 else 1)) for k, a in enumerate(wl.adapters[20:])]
    new = [replace(a, adapter_id=f"new-{k}") for k, a in enumerate(family_workload("log-uniform", 20, 4).adapters)]
    next_csv = tmp_path / "next.csv"
    write_workload_csv(Workload(tuple(kept + new)), next_csv)
    res = _run("replan", next_csv, "--previous", plan, "--out", plan, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    ch = doc["changes"]
    assert doc["summary"]["all_ok"] and doc["summary"]["gpus"] <= ch["fresh_plan_gpus"] + 1
    assert len(ch["dropped_adapters"]) == 20 and ch["added_adapters"]
    assert ch["moves"] and all(m["reason"].split(":")[0] in ("short", "consolidation", "new capacity")
                               for m in ch["moves"])
    for inst in ch["instances"]:
        assert inst["restart"] == bool(inst["restart_because"])
        assert all(why.startswith(("--max-loras", "--max-lora-rank", "--max-cpu-loras")) for why in inst["restart_because"])
    assert _run("evaluate", plan, next_csv, "--seed", 1).exit_code == 0
    table = _run("render", plan).output
    assert "re-plan:" in table and "a fresh plan of the same day" in table


def test_a_quieter_day_consolidates_to_a_fresh_plans_gpus_within_the_budget(tmp_path):
    wl = family_workload("log-uniform", 500, 5)
    _csv, plan = _plan(tmp_path, wl)
    half = Workload(tuple(replace(a, rate_rps=a.rate_rps / 2) for a in wl.adapters))
    quiet = tmp_path / "quiet.csv"
    write_workload_csv(half, quiet)
    frozen = json.loads(_run("replan", quiet, "--previous", plan, "--out", tmp_path / "frozen.json",
                             "--max-moves", "0", "--json").stdout)
    assert frozen["changes"]["moved_adapters"] == []  # no moves allowed, no GPU saved
    assert frozen["summary"]["gpus"] == len(json.loads(plan.read_text())["instances"])
    res = _run("replan", quiet, "--previous", plan, "--out", tmp_path / "quiet.json", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    ch = doc["changes"]
    assert doc["summary"]["gpus"] <= ch["fresh_plan_gpus"] < frozen["summary"]["gpus"]
    assert ch["removed_instances"] and all(m["reason"].startswith("consolidation") for m in ch["moves"])


def test_hot_adapters_that_cool_give_up_replicas_and_nothing_else_moves(tmp_path):
    """Two adapters hotter than a GPU cool by a third: the GPUs of their spare replicas are emptied into
    their other replicas, not by emptying GPUs full of other adapters (a replica's GPU that also holds a few
    small adapters gives those up with it)."""
    from twin.workload import Adapter

    base = family_workload("log-uniform", 200, 0).adapters
    _csv, plan = _plan(tmp_path, Workload((Adapter("hot", 8, 300.0), Adapter("warm", 16, 120.0), *base)))
    held = {i["instance_id"]: {a["adapter_id"] for a in i["adapters"]}
            for i in json.loads(Path(plan).read_text())["instances"]}
    cooler = tmp_path / "cooler.csv"
    write_workload_csv(Workload((Adapter("hot", 8, 200.0), Adapter("warm", 16, 80.0), *base)), cooler)
    res = _run("replan", cooler, "--previous", plan, "--out", plan, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    ch = doc["changes"]
    assert doc["summary"]["gpus"] <= ch["fresh_plan_gpus"] and ch["removed_instances"]
    emptied = [held[i] for i in ch["removed_instances"]]
    assert all(ids & {"hot", "warm"} and len(ids) <= 8 for ids in emptied)
    assert set(ch["moved_adapters"]) <= {"hot", "warm"}.union(*emptied)


def test_the_readme_crontab_line_thirty_nights_in_a_row(tmp_path, monkeypatch):
    """The README's nightly line, run on 30 nights of a small fleet (rates walk and cycle weekly, adapters
    come and go, one turns hot and cools), ends with a plan `planner evaluate` passes with a new seed."""
    line = next(ln for ln in README.read_text().splitlines() if "planner replan" in ln and "* * *" in ln)
    argv = shlex.split(line.split("&&", 1)[1].split(">>")[0])
    assert argv[:2] == ["planner", "replan"]
    monkeypatch.chdir(tmp_path)
    for night, wl in enumerate(fleet_nights("log-uniform", 150, 1, 30)):
        write_workload_csv(wl, tmp_path / "next-day.csv")
        if night == 0:
            assert _run("plan", "next-day.csv", "--out", "plan.json").exit_code == 0
            continue
        res = _run(*argv[1:])
        assert res.exit_code == 0, (night, res.output)
    res = _run("evaluate", "plan.json", "next-day.csv", "--seed", 7)
    assert res.exit_code == 0, res.output


def test_the_plan_keeps_its_file_mode_and_a_new_file_follows_the_umask(tmp_path):
    csv, plan = _plan(tmp_path, family_workload("zipf", 120, 2))
    plan.chmod(0o640)
    assert _run("replan", csv, "--previous", plan, "--out", plan).exit_code == 0
    assert stat.S_IMODE(plan.stat().st_mode) == 0o640
    old = os.umask(0o022)
    try:
        assert _run("replan", csv, "--previous", plan, "--out", tmp_path / "fresh.json").exit_code == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "fresh.json").stat().st_mode) == 0o644


@pytest.mark.parametrize("out", ["missing-dir/plan.json", "plan.json/x.json"])
def test_an_output_that_cannot_be_written_is_refused_before_any_work(tmp_path, out):
    csv, plan = _plan(tmp_path, family_workload("zipf", 60, 2))
    res = _run("replan", csv, "--previous", plan, "--out", tmp_path / out)
    assert res.exit_code == 2 and "--out" in res.output and "Traceback" not in res.output


def test_a_replan_renders_as_launch_commands(tmp_path):
    csv, plan = _plan(tmp_path, family_workload("zipf", 60, 2))
    res = _run("replan", csv, "--previous", plan, "--out", plan, "--format", "vllm", "--model", "/m")
    assert res.exit_code == 0 and res.output.count("vllm.entrypoints.openai.api_server") == len(
        json.loads(plan.read_text())["instances"])
    rendered = _run("render", plan, "--format", "vllm", "--model", "/m")  # the written plan launches as printed
    assert rendered.exit_code == 0 and rendered.stdout.strip() and rendered.stdout.strip() in res.stdout


def test_a_gpu_left_with_nothing_is_dropped_not_kept_empty(tmp_path):
    """A hot adapter split over replicas, each GPU serving one share of it: the next day it is twice as busy,
    every replica falls short and gives up its one adapter while every other GPU passes. The repair
    must drop those emptied GPUs (it once returned early, keeping them empty with their stale failing
    figures, and such a re-plan exited 0 with a GPU that serves nothing)."""
    from models.predictor import load_predictor
    from planner.placement import read_placement
    from planner.plan import PlanOptions, pack_request
    from planner.replan import ChurnBudget, _Judge, _Replan
    from planner.verdict import DEFAULT_BAR, DEFAULT_RUN
    from twin import load_profile
    from twin.workload import Adapter

    light = family_workload("log-uniform", 30, 0).adapters
    _csv, plan = _plan(tmp_path, Workload((Adapter("hot", 8, 70.0), *light)))
    previous = read_placement(plan)
    replicas = [i.instance_id for i in previous.instances if list(i.adapters) == ["hot"]]
    assert len(replicas) >= 2
    profile = load_profile()
    req = pack_request(Workload((Adapter("hot", 8, 140.0), *light)), profile, load_predictor(profile, "surrogate"),
                       PlanOptions())
    work = _Replan(previous, req, _Judge(req, DEFAULT_RUN, DEFAULT_BAR, True), ChurnBudget(), True, None)
    work.fix_short()
    assert all(s.shares for s in work.slots)
    assert {f.instance_id for f in work.freed} == set(replicas)  # free for new groups to take over


ENGINE_FLAGS = {"max_loras": "--max-loras", "max_lora_rank": "--max-lora-rank", "max_cpu_loras": "--max-cpu-loras"}


def _nights_of_hot_adapters(tmp_path, *cap):
    """Hot adapters come and go: GPUs serving one hot replica are freed and new groups need other settings.
    Yields each night's previous plan, new plan and changes."""
    nights = list(fleet_nights("hot", 150, 2, 4))
    write_workload_csv(nights[0], tmp_path / "w.csv")
    assert _run("plan", tmp_path / "w.csv", "--out", tmp_path / "plan.json").exit_code == 0
    for wl in nights[1:]:
        before = json.loads((tmp_path / "plan.json").read_text())
        write_workload_csv(wl, tmp_path / "n.csv")
        res = _run("replan", tmp_path / "n.csv", "--previous", tmp_path / "plan.json", "--out", tmp_path / "plan.json",
                   *cap, "--json")
        assert res.exit_code == 0, res.output
        after = json.loads(res.stdout)
        yield before, after, after["changes"]


def _engine_args(doc) -> dict[str, dict]:
    return {i["instance_id"]: {k: i["engine_args"][k] for k in ENGINE_FLAGS} for i in doc["instances"]}


def test_max_restarts_is_a_hard_limit_and_a_night_says_what_it_held_back(tmp_path):
    """With --max-restarts 0 no engine restarts, not even a freed GPU taken over by a new group of adapters
    with other settings (it stops and the group starts on a new GPU); the night says so."""
    held = []
    for before, after, ch in _nights_of_hot_adapters(tmp_path, "--max-restarts", "0"):
        assert ch["restarts"] == [] and not any(i["restart"] for i in ch["instances"])
        old, new = _engine_args(before), _engine_args(after)
        assert all(new[iid] == old[iid] for iid in new if iid in old)  # every GPU kept runs as started
        held += ch["held_back"]
        assert after["summary"]["all_ok"]
    assert any("--max-restarts" in why for why in held)


def test_every_restart_names_every_setting_that_changed_and_no_other(tmp_path):
    restarts = 0
    for before, after, ch in _nights_of_hot_adapters(tmp_path):
        old, new = _engine_args(before), _engine_args(after)
        for inst in ch["instances"]:
            iid = inst["instance_id"]
            if iid not in old:
                continue
            changed = {ENGINE_FLAGS[k] for k in ENGINE_FLAGS if old[iid][k] != new[iid][k]}
            named = {why.split(" ", 1)[0] for why in inst["restart_because"]}
            assert changed == named and inst["restart"] == bool(changed), (iid, old[iid], new[iid], inst)
            restarts += inst["restart"]
            for why in inst["restart_because"]:  # a GPU said to be emptied gave up adapters
                if "took adapters of gpu-" in why:
                    emptied = why.split("took adapters of ", 1)[1].split(",")[0]
                    assert any(emptied in m["from"] for m in ch["moves"]), why
    assert restarts  # the nights do restart engines when nothing caps them


def test_an_engine_change_names_a_host_slot_change():
    from planner.replan import engine_change

    settings, why = engine_change((1, 16, 2), 2, 16, 3, "it took more adapters")
    assert settings == (2, 16, 4)
    assert [w.split(":")[0] for w in why] == ["--max-loras 1 -> 2", "--max-cpu-loras 2 -> 4"]
    assert engine_change((4, 16, 10), 4, 16, 6, "x") == ((4, 16, 10), [])  # host slots that still hold all stay
