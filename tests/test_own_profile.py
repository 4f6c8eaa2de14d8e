"""A plan made with a profile file of the user's own is read back with that file: render, evaluate, replan."""

from __future__ import annotations

import json
import shutil

from click.testing import CliRunner

from planner.cli import main
from twin import load_profile
from twin.profile import profiles_dir

WL = "datasets/workloads/small-8-adapters.csv"
POOL_WL = "datasets/workloads/mixed-ranks-128-adapters.csv"


def run(*args):
    return CliRunner().invoke(main, [*map(str, args)])


def own_copy(tmp_path, shipped: str, new_id: str):
    """A shipped profile saved as the user's own file, under another id no shipped profile has."""
    raw = json.loads((profiles_dir() / f"{shipped}.json").read_text())
    raw["profile_id"] = new_id
    path = tmp_path / f"{new_id}.json"
    path.write_text(json.dumps(raw))
    return path


def test_a_plan_of_an_own_profile_file_is_rendered_evaluated_and_re_planned_with_it(tmp_path):
    mine = own_copy(tmp_path, "h100-64gb-llama-3.1-8b", "my-h100")
    res = run("plan", WL, "--profile", mine, "--out", tmp_path / "plan.json")
    assert res.exit_code == 0, res.output
    inputs = json.loads((tmp_path / "plan.json").read_text())["inputs"]
    assert inputs["profile_id"] == "my-h100" and inputs["profile_path"] == str(mine.resolve())
    for args in (["render", tmp_path / "plan.json"],
                 ["render", tmp_path / "plan.json", "--format", "k8s", "--model", "org/model"],
                 ["evaluate", tmp_path / "plan.json", WL],
                 ["replan", WL, "--previous", tmp_path / "plan.json", "--out", tmp_path / "again.json"]):
        res = run(*args)
        assert res.exit_code == 0, (args, res.output)
    assert json.loads((tmp_path / "again.json").read_text())["inputs"]["profile_path"] == str(mine.resolve())
    moved = shutil.move(mine, tmp_path / "elsewhere.json")
    res = run("render", tmp_path / "plan.json")
    assert res.exit_code == 2 and "which is not there any more" in res.output, res.output
    assert run("render", tmp_path / "plan.json", "--profile", moved).exit_code == 0


def test_a_shipped_profile_is_recorded_by_its_id_alone():
    assert load_profile("h100-64gb-llama-3.1-8b").path is None
    assert load_profile(profiles_dir() / "h100-64gb-llama-3.1-8b.json").path is None


def test_a_pool_kind_of_an_own_profile_file_is_rendered_and_evaluated_with_it(tmp_path):
    mine = own_copy(tmp_path, "cpu-2core-tiny-llama", "my-cpu")
    (tmp_path / "pool.yaml").write_text(
        "kinds:\n  - {name: h100, profile: h100-64gb-llama-3.1-8b, price_per_hour: 2.0}\n"
        f"  - {{name: mine, profile: {mine}, price_per_hour: 0.01}}\n")
    res = run("plan", POOL_WL, "--pool", tmp_path / "pool.yaml", "--out", tmp_path / "plan.json")
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "plan.json").read_text())
    kinds = {k["name"]: k for k in doc["inputs"]["pool"]["kinds"]}
    assert kinds["mine"]["profile_path"] == str(mine.resolve()) and "profile_path" not in kinds["h100"]
    assert doc["summary"]["gpus_by_kind"].get("mine")
    for args in (["render", tmp_path / "plan.json", "--format", "k8s", "--model", "org/model"],
                 ["evaluate", tmp_path / "plan.json", POOL_WL]):
        res = run(*args)
        assert res.exit_code == 0, (args, res.output)
    assert run("render", tmp_path / "plan.json", "--profile", mine).exit_code == 2
