"""Dataset builds: the paper grid, resumable and reproducible builds, memory-error rows, the CLI."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import needs

needs("pyarrow")
import pyarrow.parquet as pq

from models.dataset import GridSpec, build_dataset, read_dataset, run_scenario, work_dir_for
from planner.cli import main
from twin import load_profile
from twin.errors import BadInputError

LLAMA = "h100-64gb-llama-3.1-8b"
TINY = {"served": [2, 4], "a_max": [2, 4], "rates": [0.5, 0.2, 0.05], "rates_per_scenario": 2,
        "ranks": [8, 16], "ranks_per_scenario": 1, "duration_s": 30.0}


def test_paper_grid_is_the_studys():
    pts = GridSpec.paper().points()
    assert len(pts) == 66 * 120 * 10  # (served, A_max <= served) pairs x rate triples x rank triples
    assert all(a <= s for s, a, _, _ in pts)
    assert len({rc for _, _, rc, _ in pts}) == 120 and len({kc for _, _, _, kc in pts}) == 10
    small = GridSpec.small().points()
    assert len(set(small)) == 300 and set(small) <= set(pts)  # a sample of the study's scenarios


def test_resumed_build_equals_a_fresh_one(tmp_path):
    prof = load_profile(LLAMA)
    grid = GridSpec.from_dict({"name": "tiny", **TINY})
    total = len(grid.points())
    part = build_dataset(prof, grid, tmp_path / "a.parquet", limit=4, progress=False)
    assert (part.done, part.complete) == (4, False) and work_dir_for(tmp_path / "a.parquet").is_dir()
    assert pq.read_table(tmp_path / "a.parquet").num_rows == 4
    rest = build_dataset(prof, grid, tmp_path / "a.parquet", jobs=2, progress=False)
    assert (rest.done, rest.new_rows, rest.complete) == (total, total - 4, True)
    assert not work_dir_for(tmp_path / "a.parquet").exists()
    fresh = build_dataset(prof, grid, tmp_path / "b.parquet", progress=False)
    a, b = pq.read_table(tmp_path / "a.parquet"), pq.read_table(fresh.out)
    assert a.drop(["sim_wall_s"]).equals(b.drop(["sim_wall_s"]))
    row = a.slice(0, 1).to_pylist()[0]
    assert len(row["ranks"]) == row["served_adapters"] == len(row["rates_rps"]) and row["profile_id"] == LLAMA
    ds = read_dataset([tmp_path / "a.parquet"], prof)
    assert len(ds) == total and np.all(ds.throughput > 0)
    with pytest.raises(BadInputError, match="built for profile"):
        read_dataset([tmp_path / "a.parquet"], load_profile("h100-64gb-qwen2.5-7b"))


def test_memory_errors_are_rows_not_simulations(tmp_path):
    grid = GridSpec.from_dict({**TINY, "served": [128], "a_max": [128], "ranks": [32], "name": "oom"})
    res = build_dataset(load_profile(LLAMA), grid, tmp_path / "m.parquet", progress=False)
    t = pq.read_table(res.out).to_pydict()
    assert res.memory_errors == res.done == 3 and all(t["memory_error"]) and set(t["sim_wall_s"]) == {0.0}
    assert all(s is None for s in t["starved"])


def test_a_work_dir_of_another_build_is_refused(tmp_path):
    prof = load_profile(LLAMA)
    out = tmp_path / "x.parquet"
    build_dataset(prof, GridSpec.from_dict({"name": "a", **TINY}), out, limit=1, progress=False)
    with pytest.raises(BadInputError, match="unfinished build"):
        build_dataset(prof, GridSpec.from_dict({"name": "a", **TINY, "duration_s": 31.0}), out, progress=False)


def test_ray_backend_without_ray_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed: `import ray` fails
    with pytest.raises(BadInputError, match="pip install 'ray"):
        build_dataset(load_profile(LLAMA), GridSpec.from_dict({"name": "a", **TINY}), tmp_path / "r.parquet",
                      backend="ray", progress=False)


def test_cli_build_with_a_grid_file_and_bad_grids(tmp_path):
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps(TINY))
    out = tmp_path / "d.parquet"
    res = CliRunner().invoke(main, ["dataset", "build", "--profile", LLAMA, "--grid", str(grid), "--out", str(out),
                                    "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output)
    assert summary["complete"] and summary["rows"] == len(GridSpec.from_dict(TINY | {"name": "g"}).points())
    grid.write_text(json.dumps({**TINY, "ranks": [0]}))
    res = CliRunner().invoke(main, ["dataset", "build", "--profile", LLAMA, "--grid", str(grid), "--out", str(out)])
    assert res.exit_code == 2 and "positive integers" in res.output
    grid.write_text(json.dumps({**TINY, "colour": 1}))
    res = CliRunner().invoke(main, ["dataset", "build", "--profile", LLAMA, "--grid", str(grid), "--out", str(out)])
    assert res.exit_code == 2 and "unknown grid keys" in res.output


def test_length_scale_widens_the_lengths_drawn_and_is_recorded(tmp_path):
    """--length-scale replaces the grid's range (both kinds of grid, as --duration and --max-in-flight do); the
    dataset's metadata records it, so the rows rebuild; a reversed range is refused before any scenario runs."""
    from models.fleet_grid import FleetGrid

    prof = load_profile(LLAMA)
    fleet = GridSpec.load("fleet", 600, (1.0, 3.0), 100)
    assert isinstance(fleet, FleetGrid) and (fleet.duration_s, fleet.length_scale, fleet.max_in_flight) == (600.0, (1.0, 3.0), 100)
    for name in ("fleet", "small"):
        grid = GridSpec.load(name, length_scale=(4.0, 8.0))
        assert grid.length_scale == (4.0, 8.0) and isinstance(grid, FleetGrid) == (name == "fleet")
        own = [sid for sid in range(30) if name == "fleet" and grid.families[sid % len(grid.families)] == "mixed-lengths"]
        outs = [grid.spec(prof, sid, pt)["output_tokens"] for sid, pt in enumerate(grid.points()[:30]) if sid not in own]
        assert min(outs) > 2.0 * prof.default_output_tokens  # the default range [0.5, 2] never reaches it
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps(TINY))
    out = tmp_path / "d.parquet"
    res = CliRunner().invoke(main, ["dataset", "build", "--profile", LLAMA, "--grid", str(grid), "--out", str(out),
                                    "--length-scale", "3", "5", "--json"])
    assert res.exit_code == 0, res.output
    meta = json.loads(pq.read_schema(out).metadata[b"lora_planner"])
    assert meta["grid"]["length_scale"] == [3.0, 5.0]
    lo, hi = 3.0 * prof.default_input_tokens, 5.0 * prof.default_input_tokens
    assert all(lo <= x <= hi for x in pq.read_table(out).column("input_tokens").to_pylist())
    res = CliRunner().invoke(main, ["dataset", "build", "--profile", LLAMA, "--grid", "fleet",
                                    "--out", str(tmp_path / "f.parquet"), "--length-scale", "2", "1"])
    assert res.exit_code == 2 and "length_scale" in res.output and not (tmp_path / "f.parquet").exists()


def test_sigterm_stops_cleanly_and_keeps_the_rows(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    grid = tmp_path / "grid.json"
    # ~10 s of work on 2 cores: the first chunks are done well within the second waited below, the grid is not.
    grid.write_text(json.dumps({**TINY, "served": [2, 4, 8, 16, 32, 64], "a_max": [2, 4, 8, 16, 32, 64],
                                "duration_s": 3600.0}))
    out = tmp_path / "s.parquet"
    proc = subprocess.Popen([sys.executable, "-m", "planner.cli", "dataset", "build", "--profile", LLAMA,
                             "--grid", str(grid), "--out", str(out)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(work_dir_for(out).glob("build.json")) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(60) == 130, proc.stderr.read()
    rows = pq.read_table(out).num_rows
    assert 0 < rows < len(GridSpec.from_dict(json.loads(grid.read_text()) | {"name": "g"}).points())
    assert work_dir_for(out).is_dir()


def test_a_client_cap_is_recorded_and_binds_only_where_requests_pile_up():
    prof = load_profile(LLAMA)
    grid = GridSpec.from_dict({"name": "tiny", **TINY})
    assert "max_in_flight" not in grid.to_dict()  # uncapped builds keep their old build state
    capped = GridSpec.from_dict({**grid.to_dict(), "max_in_flight": 40})
    assert capped.to_dict()["max_in_flight"] == 40
    with pytest.raises(BadInputError, match="max_in_flight"):
        GridSpec.from_dict({"name": "bad", **TINY, "max_in_flight": -1})
    overload = (4, 2, (100.0, 100.0), (16,))  # ~800 requests/s against one GPU
    free, cap = (run_scenario(g, prof, 0, overload) for g in (grid, capped))
    # the same arrivals; with at most 40 in flight the batch, and so ITL and throughput, stay small
    assert cap["arrived_requests"] == free["arrived_requests"]
    assert 0 < cap["throughput_tok_s"] < free["throughput_tok_s"]
    assert cap["itl_ms"] < free["itl_ms"]
    light = (2, 2, (0.5, 0.2), (8,))
    a, b = (run_scenario(g, prof, 1, light) for g in (grid, capped))
    a.pop("sim_wall_s"), b.pop("sim_wall_s")
    assert a == b


def test_a_capped_build_records_its_cap_and_resumes_only_with_it(tmp_path):
    prof = load_profile(LLAMA)
    out, grid = tmp_path / "c.parquet", tmp_path / "tiny.json"
    grid.write_text(json.dumps(TINY))
    res = CliRunner().invoke(main, ["dataset", "build", "--profile", LLAMA, "--grid", str(grid), "--limit", "2",
                                    "--max-in-flight", "100", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(pq.read_schema(out).metadata[b"lora_planner"])["grid"]["max_in_flight"] == 100
    capped = GridSpec.from_dict({"name": "tiny", **TINY, "max_in_flight": 100})
    with pytest.raises(BadInputError, match=r"differs in grid\.max_in_flight"):
        build_dataset(prof, GridSpec.from_dict({"name": "tiny", **TINY}), out, limit=3, progress=False)
    assert build_dataset(prof, capped, out, limit=3, progress=False).new_rows == 1
    free = build_dataset(prof, GridSpec.from_dict({"name": "tiny", **TINY}), tmp_path / "f.parquet", limit=2,
                         progress=False)
    with pytest.raises(BadInputError, match="client cap of 0 requests in flight"):
        read_dataset([out, free.out], prof)


def test_a_capped_dataset_never_trains_or_serves_the_planners_surrogate(tmp_path, monkeypatch):
    import shutil

    from models.surrogate import artifact_metadata, surrogate_dir
    from models.train import train_surrogates
    from twin.errors import ProfileError

    prof, qwen = load_profile(LLAMA), load_profile("h100-64gb-qwen2.5-7b")
    build_dataset(prof, GridSpec.from_dict({"name": "tiny", **TINY, "max_in_flight": 100}), tmp_path / "c.parquet",
                  limit=3, progress=False)
    shipped_qwen = surrogate_dir(qwen.profile_id)
    monkeypatch.setenv("LORA_PLANNER_ARTIFACTS", str(tmp_path / "artifacts"))
    with pytest.raises(BadInputError, match="client cap of 100"):
        train_surrogates([tmp_path / "c.parquet"], prof, surrogate_dir(LLAMA))
    assert not surrogate_dir(LLAMA).exists()
    # an artifact trained on a capped dataset, put where the planner looks
    shutil.copytree(shipped_qwen, surrogate_dir(qwen.profile_id))
    meta_path = surrogate_dir(qwen.profile_id) / "surrogate.json"
    meta = json.loads(meta_path.read_text())
    meta["dataset"]["files"][0]["grid"]["max_in_flight"] = 28232
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ProfileError, match="client cap of 28232"):
        artifact_metadata(qwen)
    assert artifact_metadata(qwen, surrogate_dir(qwen.profile_id))["dataset"]["files"][0]["grid"]["max_in_flight"]
