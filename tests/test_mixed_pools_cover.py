"""benchmarks/placement/mixed_pools_cover.py: the latest run of each case across result files."""

import json

from benchmarks.placement.mixed_pools_cover import case_line, latest_cases


def _pool(price_set: str, wall: float, **extra) -> dict:
    return {"price_set": price_set, "exit": 0, "wall_over_singles_sum": wall, "saving": 0.1, "holds": True,
            "evaluate_exit": 0, "evaluate_failing": 0, **extra}


def _write(path, date: str, seed: int, pools: list[dict], kinds=("a", "b"), refused: bool = False) -> None:
    singles = {k: {"exit": 2 if refused and k == kinds[-1] else 0} for k in kinds}
    path.write_text(json.dumps({
        "benchmark": "mixed_pools", "run": {"commit": None, "date": date}, "kinds": {k: k for k in kinds},
        "cases": [{"adapters": 10, "family": "zipf", "seed": seed, "singles": singles, "pools": pools}]}))


def test_the_latest_run_of_a_case_wins_and_other_cases_stay(tmp_path):
    _write(tmp_path / "old.json", "2026-01-01T00:00:00Z", 0, [_pool("list", 1.9)])
    _write(tmp_path / "new.json", "2026-02-01T00:00:00Z", 0, [_pool("list", 1.2, wall_over_kinds_sum=1.1)])
    _write(tmp_path / "other.json", "2026-01-15T00:00:00Z", 1, [_pool("list", 1.5)])
    (tmp_path / "unrelated.json").write_text(json.dumps({"benchmark": "fleet_plans", "cases": []}))
    rows = latest_cases(sorted(tmp_path.glob("*.json")))
    assert [(r["seed"], r["file"]) for r in rows] == [(0, "new.json"), (1, "other.json")]
    assert rows[0]["pools"][0]["wall_over_kinds_sum"] == 1.1
    assert rows[1]["pools"][0]["wall_over_kinds_sum"] == 1.5  # no kind refused: the same ratio


def test_an_older_run_with_a_refusing_kind_has_no_kinds_sum_ratio(tmp_path):
    _write(tmp_path / "cpu.json", "2026-01-01T00:00:00Z", 0, [_pool("list", 3.1)], kinds=("a", "cpu"),
           refused=True)
    (row,) = latest_cases([tmp_path / "cpu.json"])
    assert row["pools"][0]["wall_over_kinds_sum"] is None
    line = case_line(row)
    assert line["max_wall_ratio"] is None and line["exit_0"] == 1 and line["code_changes_since"] is None
