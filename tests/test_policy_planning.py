"""Planning for servers that run another serving policy: plan/evaluate --policy, the packer's memory
rule under a unified pool, per-policy surrogates and datasets, and the stock paths left as they were."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import LLAMA_HASH, needs

from models.features import N_FEATURES
from models.predictor import default_predictor
from models.surrogate import load_artifact, save_artifact, simulation_hash, surrogate_dir
from models.trees import compile_sklearn
from planner.cli import main
from planner.packing import PackRequest, a_max_candidates, best_a_max
from tests.planner_helpers import CapacityPredictor, workload
from twin import load_profile
from twin.errors import BadInputError, ProfileError
from twin.policies import policy_from_name
from twin.policies.memory import kv_capacity
from twin.policies.spec import policy_record
from twin.profile import profiles_dir

LLAMA = "h100-64gb-llama-3.1-8b"
SMALL = str(Path(__file__).resolve().parents[1] / "datasets" / "workloads" / "small-8-adapters.csv")
CHAMELEON = policy_from_name("chameleon")


@pytest.fixture(scope="module")
def llama():
    return load_profile(LLAMA)


@pytest.fixture
def artifacts_root(tmp_path, monkeypatch):
    """An artifacts directory with the shipped profiles and no surrogate."""
    root = tmp_path / "artifacts"
    root.mkdir()
    (root / "profiles").symlink_to(profiles_dir())
    monkeypatch.setenv("LORA_PLANNER_ARTIFACTS", str(root))
    return root


def cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res.exit_code, res.output


def test_plan_with_chameleon_holds_in_its_twin_and_evaluate_reads_the_policy(tmp_path, llama):
    out = tmp_path / "plan.json"
    code, text = cli("plan", SMALL, "--policy", "chameleon", "--predictor", "twin", "--out", out)
    assert code == 0, text
    assert "policy chameleon" in text.splitlines()[0]
    doc = json.loads(out.read_text())
    assert doc["inputs"]["policy"] == {"name": "chameleon", "params": {}}
    assert all(i["kv_tokens"] == llama.kv.no_lora_tokens for i in doc["instances"])  # one pool, no slots carved
    code, text = cli("evaluate", out, SMALL, "--duration", 600, "--json")
    assert code == 0, text
    ev = json.loads(text)
    assert ev["policy"] == {"name": "chameleon", "params": {}}
    assert ev["ok"] and ev["starving"] == 0 and ev["memory_errors"] == 0
    code, text = cli("evaluate", out, SMALL, "--duration", 600, "--policy-param", "queues=2", "--json")
    assert code == 0 and json.loads(text)["policy"] == {"name": "chameleon", "params": {"queues": 2}}
    code, text = cli("evaluate", out, SMALL, "--duration", 600, "--policy", "vllm", "--json")
    assert code == 0 and "policy" not in json.loads(text)
    code, text = cli("plan", SMALL, "--policy", "chameleon", "--predictor", "twin", "--format", "vllm", "--model", "org/model")
    assert code == 0 and "stock vLLM does not implement it" in text
    code, text = cli("verify", out, "--engine", "cpu", "--synthesize")  # refused before any engine starts
    assert code == 2 and "real vLLM does not implement" in text


def test_stock_plan_records_no_policy(tmp_path):
    out = tmp_path / "plan.json"
    code, text = cli("plan", SMALL, "--predictor", "twin", "--out", out)
    assert code == 0, text
    assert "policy" not in json.loads(out.read_text())["inputs"] and "policy" not in text


@dataclass
class PolicyCapacityPredictor(CapacityPredictor):
    policy: object = None


def test_a_unified_pool_lets_the_packer_use_every_a_max(llama):
    assert a_max_candidates(llama.kv, [32], 200)[-1] == llama.kv.max_a_max(32) < 200
    assert a_max_candidates(kv_capacity(llama, CHAMELEON), [32], 200)[-1] == 200
    wl = workload([0.001] * 120, [32] * 120)
    group = {i: 1.0 for i in range(120)}
    stock = best_a_max(PackRequest.build(wl, llama, PolicyCapacityPredictor(1e6), 1), group)
    pooled = best_a_max(PackRequest.build(wl, llama, PolicyCapacityPredictor(1e6, policy=CHAMELEON), 1), group)
    assert (stock.a_max, pooled.a_max) == (llama.kv.max_a_max(32), 120)


def _tiny_artifact(directory, profile, policy):
    """A valid artifact with one-split trees (what it predicts does not matter here)."""
    from sklearn.tree import DecisionTreeClassifier, DecisionTreeRegressor

    X = np.random.default_rng(0).random((20, N_FEATURES))
    reg = compile_sklearn(DecisionTreeRegressor(max_depth=1).fit(X, X[:, 0]))
    clf = compile_sklearn(DecisionTreeClassifier(max_depth=1).fit(X, X[:, 0] > 0.5))
    record = policy_record(policy)
    save_artifact(directory, {"full_throughput": reg, "small_throughput": reg, "full_starved": clf,
                              "small_starved": clf},
                  {"profile_id": profile.profile_id, "profile_simulation_hash": simulation_hash(profile, policy),
                   **({} if record is None else {"policy": record})})


def test_surrogates_are_per_policy(artifacts_root, llama):
    needs("sklearn")
    code, text = cli("plan", SMALL, "--policy", "chameleon", "--predictor", "surrogate")
    assert code == 2 and text.count("\n") == 1 and "no surrogate" in text and "--policy chameleon" in text
    assert default_predictor(llama, CHAMELEON).kind == "twin"
    d = surrogate_dir(LLAMA, CHAMELEON)
    assert d == artifacts_root / "surrogates" / LLAMA / "chameleon" and surrogate_dir(LLAMA).name == LLAMA
    _tiny_artifact(d, llama, CHAMELEON)
    assert default_predictor(llama, CHAMELEON).kind == "surrogate"
    with pytest.raises(ProfileError, match="--predictor twin"):  # made for other parameters: said, not skipped
        default_predictor(llama, policy_from_name("chameleon", queues=2))
    assert default_predictor(llama).kind == "twin"  # the stock directory holds no surrogate
    with pytest.raises(ProfileError, match="trained for serving policy chameleon, not vllm"):
        load_artifact(llama, d)
    with pytest.raises(ProfileError, match=r"not chameleon \(queues=2\)"):
        load_artifact(llama, d, policy_from_name("chameleon", queues=2))
    _tiny_artifact(surrogate_dir(LLAMA), llama, None)
    with pytest.raises(ProfileError, match="trained for serving policy vllm, not slora"):
        load_artifact(llama, surrogate_dir(LLAMA), policy_from_name("slora"))


def test_stock_simulation_hash_is_unchanged_and_policies_have_their_own(llama):
    assert simulation_hash(llama) == LLAMA_HASH  # the hash the shipped llama datasets were built with
    hashes = {simulation_hash(llama, p) for p in (CHAMELEON, policy_from_name("chameleon", queues=2),
                                                 policy_from_name("elora"))}
    assert len(hashes) == 3 and simulation_hash(llama) not in hashes


TINY_GRID = {"name": "tiny", "served": [128], "a_max": [128], "rates": [0.5, 0.2, 0.05], "rates_per_scenario": 2,
             "ranks": [32], "ranks_per_scenario": 1, "duration_s": 20.0}


def test_dataset_build_records_the_policy(tmp_path, llama):
    pq = needs("pyarrow.parquet")
    from models.dataset import METADATA_KEY, read_dataset

    grid = tmp_path / "tiny.json"
    grid.write_text(json.dumps(TINY_GRID))
    out = tmp_path / "cham.parquet"
    code, text = cli("dataset", "build", "--profile", LLAMA, "--grid", grid, "--policy", "chameleon",
                     "--out", out, "--json")
    assert code == 0, text
    table = pq.read_table(out)
    meta = json.loads(table.schema.metadata[METADATA_KEY])
    assert meta["policy"] == {"name": "chameleon", "params": {}} and meta["profile_hash"] == simulation_hash(
        llama, CHAMELEON)
    # --max-loras 128 of rank 32 does not start on stock vLLM; in one pool it does, and is simulated
    assert not any(table.column("memory_error").to_pylist())
    assert set(table.column("kv_tokens").to_pylist()) == {llama.kv.no_lora_tokens}
    assert len(read_dataset([out], llama, CHAMELEON)) == 3
    with pytest.raises(BadInputError, match="built for serving policy chameleon, not vllm"):
        read_dataset([out], llama)


def test_work_dirs_resume_only_their_own_policy(tmp_path, llama):
    needs("pyarrow")
    from models.dataset import GridSpec, build_dataset, work_dir_for

    grid = GridSpec.from_dict({**TINY_GRID, "served": [4], "a_max": [4], "ranks": [8]})
    stock = tmp_path / "stock.parquet"
    build_dataset(llama, grid, stock, limit=1, progress=False)
    state = work_dir_for(stock) / "build.json"
    old = json.loads(state.read_text())
    assert "policy" not in old  # stock work dirs are written as before policies existed
    state.write_text(json.dumps({**old, "features": ["older", "keys"]}))  # as the shipped work dirs
    with pytest.raises(BadInputError, match="unfinished build"):
        build_dataset(llama, grid, stock, progress=False, policy=CHAMELEON)
    assert build_dataset(llama, grid, stock, progress=False).complete
    cham = tmp_path / "cham.parquet"
    build_dataset(llama, grid, cham, limit=1, progress=False, policy=CHAMELEON)
    with pytest.raises(BadInputError, match="unfinished build"):
        build_dataset(llama, grid, cham, progress=False)
    with pytest.raises(BadInputError, match="unfinished build"):
        build_dataset(llama, grid, cham, progress=False, policy=policy_from_name("chameleon", queues=2))
    assert build_dataset(llama, grid, cham, progress=False, policy=CHAMELEON).complete


def test_training_a_policy_surrogate_refuses_real_runs(tmp_path, llama):
    needs("sklearn")
    from models.train import train_surrogates

    with pytest.raises(BadInputError, match="stock vLLM"):
        train_surrogates([], llama, tmp_path, real_runs=object(), policy=CHAMELEON)
