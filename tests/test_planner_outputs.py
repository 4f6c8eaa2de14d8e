"""Placement JSON, renderers, re-planning and the plan/evaluate/replan commands."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner.cli import main
from planner.placement import read_placement
from planner.plan import PlanOptions, make_plan, pack_request
from planner.render import render_table, render_vllm
from planner.replan import AlreadyRunningError, exclusive, replan
from planner.verdict import DEFAULT_BAR, DEFAULT_RUN
from tests.planner_helpers import CapacityPredictor, workload
from twin import BadInputError, load_profile
from twin.families import family_workload, write_workload_csv
from twin.workload import Adapter, Workload

SMALL = "datasets/workloads/small-8-adapters.csv"


@pytest.fixture(scope="module")
def profile():
    return load_profile("h100-64gb-llama-3.1-8b")


def write_csv(path, rows):
    path.write_text("adapter_id,rank,rate_rps,input_tokens,output_tokens\n"
                    + "".join(f"{a},{r},{x},60,40\n" for a, r, x in rows))
    return path


def plan_for(tmp_path, profile, rates, name="w.csv"):
    csv = write_csv(tmp_path / name, [(f"ad-{i}", 8, x) for i, x in enumerate(rates)])
    from planner.workload_csv import read_workload

    wl = read_workload(csv, profile)
    return csv, make_plan(csv, wl, profile, CapacityPredictor(), CAPACITY_ONLY)


#: Plans by the capacity model alone (these tests check packing and its outputs, not serving fidelity).
CAPACITY_ONLY = PlanOptions(confirm=False, slowdown=1.0)


def capacity_request(wl, profile):
    """What `planner replan` asks of the capacity model (the plan's bar, as ``plan_for`` packs)."""
    return pack_request(wl, profile, CapacityPredictor(), CAPACITY_ONLY)


def test_placement_json_round_trip_and_router(tmp_path, profile):
    _, p = plan_for(tmp_path, profile, [1.0] * 25 + [25.0])
    d = p.to_dict()
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    back = read_placement(path)
    assert [(i.instance_id, i.a_max, i.adapters) for i in back.instances] == \
           [(i.instance_id, i.a_max, {k: round(v, 6) for k, v in i.adapters.items()}) for i in p.instances]
    assert set(d["router"]) == {f"ad-{i}" for i in range(26)}
    for routes in d["router"].values():
        assert sum(r["weight"] for r in routes) == pytest.approx(1.0, abs=1e-5)
    hot = next(a for a in d["adapters"] if a["adapter_id"] == "ad-25")
    assert len(hot["routes"]) > 1 and hot["instance_id"] in {r["instance_id"] for r in hot["routes"]}
    inst = d["instances"][0]
    assert inst["engine_args"]["enable_lora"] is True
    assert inst["engine_args"]["max_loras"] == inst["a_max"]
    assert inst["engine_args"]["max_cpu_loras"] >= len(inst["adapters"])
    assert d["inputs"]["profile_id"] == profile.profile_id and len(d["inputs"]["workload"]["sha256"]) == 64



def test_a_large_plan_file_has_one_adapter_per_line_and_reads_back_the_same(tmp_path, profile):
    from twin.atomic import ONE_PER_LINE_FROM, write_json_atomic

    _, p = plan_for(tmp_path, profile, [0.01] * (ONE_PER_LINE_FROM + 10) + [25.0])
    d = p.to_dict()
    path = tmp_path / "plan.json"
    write_json_atomic(path, d, one_per_line=True)
    assert json.loads(path.read_text()) == d
    lines = path.read_text().splitlines()
    ids = [a["adapter_id"] for a in d["adapters"]]
    assert sum(1 for line in lines if line.startswith('  {"adapter_id": ')) == len(ids)
    assert sum(1 for line in lines if line.startswith(tuple(f'  "{i}": [' for i in ids))) == len(ids)  # routes
    assert lines[1] == ' "schema_version": 1,' and '  "workload": {' in lines  # short sections indented
    back = read_placement(path)
    assert [i.adapters for i in back.instances] == [i.adapters for i in read_placement(_written(tmp_path, d)).instances]


def _written(tmp_path, d) -> Path:
    path = tmp_path / "indented.json"
    path.write_text(json.dumps(d, indent=1))
    return path

@pytest.mark.parametrize("content, message", [
    ("{", "not a valid placement: .*Invalid JSON"),
    ('{"schema_version": 99}', "schema_version: Input should be 1"),
    ('{"schema_version": 1, "instances": []}', "inputs: Field required"),
])
def test_bad_placement_files_are_clear_errors(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(BadInputError, match=message):
        read_placement(path)


def test_renderers(tmp_path, profile):
    _, p = plan_for(tmp_path, profile, [1.0] * 12)
    p.adapters[0]["path"] = "/srv/adapters/odd name;rm -rf"
    text = render_vllm(p, "/models/llama", port_base=9000, adapter_dir="/srv/adapters")
    cmds = [line for line in text.splitlines() if line.startswith("CUDA_VISIBLE_DEVICES")]
    assert len(cmds) == len(p.instances)
    argv = shlex.split(cmds[0].split(" ", 1)[1].rstrip(" &"))
    assert argv[:4] == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model=/models/llama"]
    assert argv[argv.index("--max-loras") + 1] == str(p.instances[0].a_max)
    assert "--enable-lora" in argv and "--no-enable-prefix-caching" in argv
    mods = argv[argv.index("--lora-modules") + 1:]
    assert len(mods) == len(p.instances[0].adapters) and all(m.startswith("{") for m in mods)
    specs = [json.loads(m) for c in cmds for m in shlex.split(c) if m.startswith("{")]
    assert {"name": "ad-0", "path": "/srv/adapters/odd name;rm -rf"} in specs
    table = render_table(p)
    assert "gpu-0" in table and "every GPU keeps up" in table


def test_replan_of_the_same_workload_changes_nothing(tmp_path, profile):
    csv, p = plan_for(tmp_path, profile, [1.0] * 25)
    req = capacity_request(workload([1.0] * 25), profile)
    new = replan(p, csv, req)
    ch = new.changes
    assert ch["moved_adapters"] == [] and ch["restarts"] == [] and ch["new_instances"] == []
    assert [i.adapters for i in new.instances] == [i.adapters for i in p.instances]


def test_replan_moves_little_and_reports_changes(tmp_path, profile):
    csv, p = plan_for(tmp_path, profile, [1.0] * 25)
    rates = [1.0] * 25
    rates[0] = 4.0  # ad-0's GPU no longer keeps up: one adapter has to go
    rates += [1.0] * 8  # 8 new adapters: 800 tok/s more
    new = replan(p, csv, capacity_request(workload(rates), profile))
    ch = new.changes
    assert set(ch["added_adapters"]) == {f"ad-{i}" for i in range(25, 33)}
    assert len(ch["moved_adapters"]) <= 2
    assert all(i.ok for i in new.instances)
    loaded = {a for c in ch["instances"] for a in c["load"]}
    assert set(ch["added_adapters"]) <= loaded
    before = {i.instance_id for i in p.instances}
    assert {c["instance_id"] for c in ch["instances"] if c["status"] == "kept"} <= before


def test_replan_merges_the_lightest_gpus_onto_fewer(tmp_path, profile):
    """The consolidation step that repacks several GPUs at once: on a day at a third of the traffic, the
    adapters of the lightest GPUs go onto fewer, each new group on the GPU it shares most traffic with;
    only adapters that changed GPU count as moves, and every adapter keeps its whole traffic."""
    from planner.replan import ChurnBudget, _Judge, _Replan

    _, p = plan_for(tmp_path, profile, [1.0] * 40)
    req = capacity_request(workload([1.0 / 3] * 40), profile)
    work = _Replan(p, req, _Judge(req, DEFAULT_RUN, DEFAULT_BAR, False), ChurnBudget(), True, None)
    before = {i: next(s.prev.instance_id for s in work.slots if i in s.shares) for i in range(40)}
    n = len(work.slots)
    assert n >= 4
    assert work.merge_lightest(1)
    assert len(work.slots) < n
    held = {}
    for s in work.slots:
        assert work.judge.check([s.group])[0].all()
        for i, share in s.shares.items():
            held[i] = held.get(i, 0.0) + share
    assert held == pytest.approx({i: 1.0 for i in range(40)})
    moved = {i for i in range(40) if not any(s.prev is not None and s.prev.instance_id == before[i] and i in s.shares
                                             for s in work.slots)}
    assert moved and set(work.moves) == moved
    assert all(why.startswith("consolidation") for why in work.moves.values())
    frozen = _Replan(p, req, _Judge(req, DEFAULT_RUN, DEFAULT_BAR, False), ChurnBudget(max_moves=0), True, None)
    assert not frozen.merge_lightest(1) and len(frozen.slots) == n  # no moves allowed: nothing changes


def test_replan_lays_the_fresh_plan_onto_the_gpus_when_merging_cannot_reach_it(tmp_path, profile, monkeypatch):
    """The last consolidation step: when neither emptying one GPU nor merging the lightest reaches the fresh
    plan's count, the fresh plan's groups take over the GPUs they share most traffic with (a GPU left over is
    emptied); every adapter keeps its whole traffic, moves carry the reason, and a zero moves budget refuses."""
    from planner.replan import ChurnBudget, _Judge, _Replan

    _, p = plan_for(tmp_path, profile, [1.0] * 40)
    req = capacity_request(workload([1.0 / 3] * 40), profile)
    judge = _Judge(req, DEFAULT_RUN, DEFAULT_BAR, False)
    work = _Replan(p, req, judge, ChurnBudget(), True, None)
    n = len(work.slots)
    fresh, rows = work.packed(None, req.max_gpus)
    assert len(fresh) < n
    monkeypatch.setattr(_Replan, "empty_one", lambda self: False)
    monkeypatch.setattr(_Replan, "merge_lightest", lambda self, excess: False)
    work.consolidate(fresh, rows)
    assert len(work.slots) == len(fresh)
    assert sorted(sorted(s.shares.items()) for s in work.slots) == sorted(sorted(g.shares.items()) for g in fresh)
    assert work.moves and set(work.moves.values()) == {"consolidation: the fresh plan of the day needs fewer GPUs"}
    frozen = _Replan(p, req, judge, ChurnBudget(max_moves=0), True, None)
    frozen.consolidate(fresh, rows)
    assert len(frozen.slots) == n


def test_replan_gives_an_emptied_gpu_to_a_new_group(tmp_path, profile):
    csv, p = plan_for(tmp_path, profile, [1.0] * 25)
    gone = set(p.instances[0].adapters)  # every adapter of the first GPU leaves the workload ...
    kept = [a for a in workload([1.0] * 25).adapters if a.adapter_id not in gone]
    fresh = [Adapter(f"new-{i}", 8, 1.0, 60.0, 40.0) for i in range(len(gone))]  # ... and as many new ones arrive
    req = capacity_request(Workload(tuple(kept + fresh)), profile)
    new = replan(p, csv, req)
    ch = new.changes
    first = p.instances[0].instance_id
    assert ch["removed_instances"] == [] and ch["new_instances"] == []  # a reload on the same GPU, not stop + start
    entry = next(c for c in ch["instances"] if c["instance_id"] == first)
    assert set(entry["unload"]) == gone and entry["load"]  # new adapters, after the others' spare room filled up
    assert {a for c in ch["instances"] for a in c["load"]} == {a.adapter_id for a in fresh}
    assert [i.instance_id for i in new.instances] == [i.instance_id for i in p.instances]
    assert all(i.ok for i in new.instances)


HOLD = """
import sys, time
from planner.replan import AlreadyRunningError, exclusive
try:
    with exclusive(sys.argv[1]):
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
except AlreadyRunningError:
    print("refused", flush=True)
"""


def _holders(out, n: int, seconds: float) -> list[str]:
    procs = [subprocess.Popen([sys.executable, "-c", HOLD, str(out), str(seconds)], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[1]) for _ in range(n)]
    return [p.communicate(timeout=60)[0].strip() for p in procs]


def test_replan_lock_is_held_by_one_process_and_a_leftover_file_blocks_nothing(tmp_path):
    out = tmp_path / "plan.json"
    assert sorted(_holders(out, 6, 6.0)) == ["held"] + ["refused"] * 5  # six at once: exactly one holds it
    (tmp_path / "plan.json.lock").write_text("12345")  # left by a process gone (even one killed with -9)
    with exclusive(out):
        pass
    link = tmp_path / "current.json"
    link.symlink_to(out)  # the lock sits beside the real file: two names of one plan share it
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out), "3"], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[1])
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(AlreadyRunningError, match="another re-plan") as err, exclusive(link):
        pass
    assert err.value.exit_code == 4
    holder.wait(timeout=30)
    with exclusive(link):
        pass


def test_cli_plan_evaluate_replan_with_the_twin(tmp_path):
    r = CliRunner()
    out = tmp_path / "plan.json"
    res = r.invoke(main, ["plan", SMALL, "--predictor", "twin", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "every GPU meets the SLO" in res.output and out.exists()
    res = r.invoke(main, ["evaluate", str(out), SMALL, "--duration", "600", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["ok"] is True
    before = out.read_bytes()
    res = r.invoke(main, ["replan", SMALL, "--previous", str(out), "--out", str(out), "--gpus", "1",
                          "--predictor", "twin", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["changes"]["moved_adapters"] == []
    assert out.read_bytes() != before  # rewritten (new timestamps, changes section)


def test_cli_failures_leave_files_alone(tmp_path):
    r = CliRunner()
    out = tmp_path / "plan.json"
    out.write_text("previous plan")
    hot = write_csv(tmp_path / "hot.csv", [("x", 8, 500.0)])
    res = r.invoke(main, ["plan", str(hot), "--predictor", "twin", "--no-split-hot", "--out", str(out)])
    assert res.exit_code == 3 and "x is too hot" in res.output
    assert out.read_text() == "previous plan"
    bad = tmp_path / "bad.csv"
    bad.write_text("adapter_id,rank\nx,8\n")
    res = r.invoke(main, ["plan", str(bad), "--out", str(out)])
    assert res.exit_code == 2 and "rate_rps" in res.output
    res = r.invoke(main, ["replan", str(bad), "--previous", str(out), "--out", str(out)])
    assert res.exit_code == 2 and out.read_text() == "previous plan"
    res = r.invoke(main, ["plan", SMALL, "--algorithm", "dlora"])
    assert res.exit_code == 2 and "--gpus" in res.output


def _children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT])
def test_no_twin_worker_outlives_a_stopped_plan(tmp_path, sig):
    csv = tmp_path / "w.csv"
    write_workload_csv(family_workload("log-uniform", 3000, 0), csv)
    proc = subprocess.Popen([sys.executable, "-m", "planner.cli", "plan", str(csv), "--jobs", "2"],
                            cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    workers: list[int] = []
    while not workers and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        workers = _children(proc.pid)
    assert workers, "the plan ended before its twin workers started"
    proc.send_signal(sig)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30  # a loaded machine is slow to schedule the exiting workers
    while any(Path(f"/proc/{w}").exists() and _state(w) != "Z" for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [(w, _state(w), Path(f"/proc/{w}/cmdline").read_bytes()[:200]) for w in workers
             if Path(f"/proc/{w}").exists() and _state(w) != "Z"]
    assert not alive, (proc.returncode, alive, proc.stderr.read().decode()[-2000:])


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_the_shipped_json_schema_is_the_readers_and_plans_meet_it(tmp_path, profile):
    """docs/placement.schema.json, for router authors, is what `python -m planner.schema` prints, and a
    written plan (the one `plan_for` makes, and a re-plan of it) validates against it."""
    import jsonschema

    from planner.schema import json_schema

    shipped = json.loads((Path(__file__).resolve().parents[1] / "docs" / "placement.schema.json").read_text())
    assert shipped == json.loads(json.dumps(json_schema()))
    csv, p = plan_for(tmp_path, profile, [1.0] * 25)
    jsonschema.validate(p.to_dict(), shipped)
    jsonschema.validate(replan(p, csv, capacity_request(workload([1.0] * 30), profile)).to_dict(), shipped)
