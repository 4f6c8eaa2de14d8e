"""`planner margin`: a profile's safety margin sized from its real runs, as the shipped profiles' margins are."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner.cli import main
from twin import load_profile

CPU = "cpu-2core-tiny-llama"
RUNS = Path("datasets/measured") / CPU
#: The held-apart run sets the shipped CPU profile's margin rests on (benchmarks/fidelity/edge_margin.py).
SHIPPED_SETS = ("day4a", "day4b", "rerun", "repeat-a", "repeat-b")


def _runs(*names: str) -> list[str]:
    return [arg for name in names for arg in ("--runs", str(RUNS / f"validation-{name}"))]


def _own_profile(tmp_path: Path) -> Path:
    """The CPU profile as a file of the user's own, with no margin."""
    data = json.loads(Path(f"artifacts/profiles/{CPU}.json").read_text(encoding="utf-8"))
    del data["planning"]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_the_shipped_margin_is_what_the_command_sizes_from_the_same_runs(tmp_path):
    res = CliRunner().invoke(main, ["margin", "--profile", CPU, *_runs(*SHIPPED_SETS), "--json"])
    assert res.exit_code == 0, res.output
    figures = json.loads(res.output)
    again = CliRunner().invoke(main, ["margin", "--profile", CPU, *_runs(*SHIPPED_SETS),
                                      "--runs", f"./{RUNS}/validation-day4a", "--json"])
    assert json.loads(again.output) == figures  # a run set given twice counts once
    shipped = load_profile(CPU).planning
    assert (figures["slowdown"], figures["runs"]) == (shipped["slowdown"], shipped["real_runs"]) == (1.804, 160)
    assert figures["starved_runs"] == 8 and figures["runs_slower_than_the_slowed_twin"] == 0


def test_a_margin_written_into_a_profile_of_your_own_makes_its_plans_plan_grade(tmp_path):
    path = _own_profile(tmp_path)
    assert load_profile(path).plan_grade_note() is not None and load_profile(path).planning_slowdown() == 1.0
    res = CliRunner().invoke(main, ["margin", "--profile", str(path), *_runs("probed", "niced"), "--out", str(path)])
    assert res.exit_code == 0, res.output
    assert f"wrote {path} (plan-grade)" in res.output and "14 of 64 runs they could not keep up with" in res.output
    mine = load_profile(path)
    assert mine.plan_grade_note() is None and mine.planning["real_runs"] == 64
    assert mine.planning_slowdown("slo") == mine.planning_slowdown("throughput") > 1.5
    assert mine.planning["command"].startswith("planner ") and "validation-probed" in mine.planning["evidence"]
    # a smaller risk asks for a wider margin; nothing is written without --out
    before = path.read_bytes()
    wide = json.loads(CliRunner().invoke(main, ["margin", "--profile", str(path), *_runs("probed", "niced"),
                                                "--risk", "0.001", "--json"]).output)
    assert wide["slowdown"] > mine.planning["slowdown"] and path.read_bytes() == before


def test_runs_that_cannot_size_a_margin_are_refused(tmp_path):
    res = CliRunner().invoke(main, ["margin", "--profile", CPU, "--runs", str(RUNS / "calibration-30")])
    assert res.exit_code == 2 and "was calibrated on; a safety margin needs held-apart ones" in res.output
    one_starved = tmp_path / "one-starved"
    shutil.copytree(RUNS / "validation-rerun2", one_starved)
    for case in sorted((one_starved / "cases").glob("*.json")):
        if json.loads(case.read_text(encoding="utf-8")).get("real", {}).get("starved"):
            case.unlink()
            break
    res = CliRunner().invoke(main, ["margin", "--profile", CPU, "--runs", str(one_starved)])
    assert res.exit_code == 2 and "31 real run(s), 1 of them starved" in res.output, res.output
    for risk in ("0", "0.5", "nan"):
        assert CliRunner().invoke(main, ["margin", "--profile", CPU, *_runs("day4a"), "--risk", risk]).exit_code == 2


@pytest.mark.parametrize("profile", ["h100-80gb-llama-3.1-8b"])
def test_the_measured_gpu_profile_margin_is_reproduced(profile):
    lean = sorted((Path("datasets/measured") / profile / "lean").glob("validation*"))
    res = CliRunner().invoke(main, ["margin", "--profile", profile, *[a for d in lean for a in ("--runs", str(d))]])
    assert res.exit_code == 0, res.output
    assert f"{load_profile(profile).planning['slowdown']:g}x slower" in res.output and "not plan-grade" in res.output
