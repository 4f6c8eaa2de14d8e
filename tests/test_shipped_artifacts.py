"""The shipped datasets and surrogates still describe today's twin.

A dataset row is a twin run, so a change to the twin's code (not only to a profile's numbers, which the
simulation hash covers) silently makes every shipped dataset and the surrogates trained on it wrong.
Re-simulating the cheapest rows of each shipped dataset catches that in seconds: they must come out
identical, bit for bit. When this fails after a deliberate twin change, rebuild the datasets and retrain
(docs/surrogates.md says how).
"""

from __future__ import annotations

import hashlib
import json
import math
import shlex
from pathlib import Path

import pytest

from models.dataset import METADATA_KEY, TARGETS, GridSpec, run_scenario
from models.fleet_grid import FleetGrid
from models.surrogate import simulation_hash
from twin import load_profile
from twin.policies.spec import policy_from_record

ROOT = Path(__file__).resolve().parents[1]
DATASETS = sorted(p for p in (ROOT / "datasets").glob("*/*.parquet") if p.parent.name != "measured")
SURROGATES = sorted((ROOT / "artifacts" / "surrogates").glob("**/surrogate.json"))
ROWS_PER_DATASET = 3


def _metadata(path: Path) -> dict:
    import pyarrow.parquet as pq

    return json.loads(pq.read_schema(path).metadata[METADATA_KEY])


def _grid(meta: dict) -> GridSpec | FleetGrid:
    raw = dict(meta["grid"])
    return FleetGrid.from_dict(raw) if raw.get("kind") == "fleet" else GridSpec.from_dict(raw)


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def test_every_shipped_dataset_is_checked():
    assert {p.parent.name for p in DATASETS} >= {"h100-64gb-llama-3.1-8b", "h100-64gb-qwen2.5-7b"}


@pytest.mark.parametrize("path", DATASETS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_dataset_rows_resimulate_identically(path):
    import pyarrow.parquet as pq

    meta = _metadata(path)
    profile = load_profile(meta["profile_id"])
    policy = policy_from_record(meta.get("policy"))
    assert meta["profile_hash"] == simulation_hash(profile, policy), f"{path.name} was built with another profile"
    grid = _grid(meta)
    table = pq.read_table(path).to_pylist()
    live = sorted((r for r in table if not r["memory_error"]), key=lambda r: r["sim_wall_s"])
    rows = [*live[:ROWS_PER_DATASET], *[r for r in table if r["memory_error"]][:1]]
    points = grid.points()
    for stored in rows:
        sid = int(stored["scenario_id"])
        fresh = run_scenario(grid, profile, sid, points[sid], policy=policy)
        for key in ("seed", "served_adapters", "a_max", "kv_tokens", "arrived_requests", "finished_requests",
                    "preemptions", *TARGETS):
            if key not in stored:  # a schema-1 file: no SLO targets
                continue
            assert _same(fresh[key], stored[key]), f"{path.name} scenario {sid}: {key} {fresh[key]!r} != {stored[key]!r}"
        assert fresh["rates_rps"] == list(stored["rates_rps"])


@pytest.mark.parametrize("path", SURROGATES, ids=lambda p: str(p.parent.relative_to(ROOT / "artifacts" / "surrogates")))
def test_shipped_surrogates_were_trained_on_the_shipped_datasets(path):
    """Same profile, and the very bytes of the datasets its recorded command names."""
    meta = json.loads(path.read_text())
    profile = load_profile(meta["profile_id"])
    policy = policy_from_record(meta.get("policy"))
    assert meta["profile_simulation_hash"] == simulation_hash(profile, policy)
    args = shlex.split(meta["command"])
    named = [ROOT / args[i + 1] for i, a in enumerate(args) if a == "--dataset"]
    assert named, meta["command"]
    digest = hashlib.sha256()
    for dataset in named:
        digest.update(dataset.read_bytes())
    assert digest.hexdigest() == meta["dataset"]["sha256"], f"{path}: retrain it on the shipped datasets"


def test_the_study_profiles_rebuild_from_the_repository_alone(tmp_path):
    """The command in their provenance, run on the study's files shipped in datasets/measured/, gives the
    shipped files byte for byte (their ``planning`` section, which benchmarks/fidelity/edge_margin.py writes, kept)."""
    from serving_harness import published_profiles

    shipped = ROOT / "artifacts" / "profiles"
    for prof in published_profiles.build(published_profiles.REFERENCE_DATA).values():
        (tmp_path / f"{prof['profile_id']}.json").write_bytes((shipped / f"{prof['profile_id']}.json").read_bytes())
    published_profiles.main(["--out-dir", str(tmp_path)])
    for path in tmp_path.glob("*.json"):
        assert path.read_bytes() == (shipped / path.name).read_bytes(), path.name
    assert "--data" not in load_profile("h100-64gb-qwen2.5-7b").provenance["command"]
