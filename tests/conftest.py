"""Shared test helpers: small hand-made profiles."""

from __future__ import annotations

import copy
import importlib
import os
import shutil

import numpy as np
import pytest

from twin import core
from twin.profile import SCHEMA_VERSION, profile_from_dict

BASE_PROFILE = {
    "schema_version": SCHEMA_VERSION,
    "profile_id": "test-profile",
    "engine": {"version": "0.32.0", "block_size": 16, "max_num_batched_tokens": 64, "max_num_seqs": 256,
               "max_model_len": 100000},
    "kv_capacity": {"no_lora_tokens": 4800, "a_max_points": [64], "tokens": {"8": [4800], "16": [4800]}},
    "step_latency_ms": {"k4_ms_per_request": 0.0, "k5_ms": 1000.0},
    "scheduler_overhead_us": {"k1_us_per_running": 0.0, "k2_us_per_waiting": 0.0,
                              "k3_us_per_waiting_x_amax_over_a": 0.0, "intercept_us": 0.0},
    "adapter_load_ms": {"by_max_lora_rank": {"8": {"8": 1e-9}, "16": {"16": 1e-9}}},
    "defaults": {"input_tokens": 100, "output_tokens": 50},
    "provenance": {"kind": "hand-made for tests"},
}
#: A step of 10 ms whatever the batch (easy arithmetic for timing tests).
STEP_10MS = {"k4_ms_per_request": 0.0, "k5_ms": 10.0}
#: Simulation hashes the shipped datasets and surrogates were built with (models.surrogate.simulation_hash).
LLAMA_HASH = "ddaff2e6dd613984"  # with the real-run terms carried over from Qwen (l3, length_cv)
QWEN_HASH = "c8916de80b280b46"  # with its real-run terms (l3, length_cv)


#: Set by .ci/run, where every test must run: a missing or broken optional dependency (vLLM, an extra's
#: package, the ``prometheus`` program) is then an error instead of a skip. ``LORA_PLANNER_REQUIRE_VLLM=1``,
#: its first name, still sets it.
def require_all(environ) -> bool:
    return "1" in (environ.get("LORA_PLANNER_REQUIRE_ALL"), environ.get("LORA_PLANNER_REQUIRE_VLLM"))


REQUIRE_ALL = require_all(os.environ)


def needs(module: str):
    """Import ``module``, an optional dependency of a test (of real vLLM: mark it ``pytest.mark.vllm``):
    skipped where it is missing, but an import error under :data:`REQUIRE_ALL`."""
    if REQUIRE_ALL:
        return importlib.import_module(module)
    return pytest.importorskip(module)


def needs_program(name: str) -> str:
    """The path of program ``name`` a test runs: skipped where it is not on PATH, but an error under
    :data:`REQUIRE_ALL`."""
    path = shutil.which(name)
    if path is None:
        if REQUIRE_ALL:
            raise FileNotFoundError(f"`{name}` is not on PATH (.ci/run installs it)")
        pytest.skip(f"`{name}` is not on PATH")
    return path


def make_profile_dict(**changes):
    """BASE_PROFILE with dotted-path changes, e.g. ``**{"engine.block_size": 32}``."""
    d = copy.deepcopy(BASE_PROFILE)
    for path, value in changes.items():
        node = d
        keys = path.split(".")
        for k in keys[:-1]:
            node = node[k]
        if value is None:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return d


def random_core_args(rng):
    """``twin.core.simulate_core``'s arguments but the trace capacity and ITL edges, for a random small engine and
    workload over extreme settings (one-token budgets and blocks, one sequence, zero-time steps)."""
    n_ad = int(rng.choice([1, 3, 12]))
    block = int(rng.choice([1, 4, 16, 128]))
    budget = int(rng.choice([1, 16, 64, 512]))
    duration = float(rng.choice([3.0, 10.0]))
    n = int(rng.poisson(rng.choice([5, 30, 120]) * duration))
    arrival = np.sort(rng.uniform(0, duration, n))
    if rng.random() < 0.3:  # many requests arriving together
        arrival = np.round(arrival)
    adapter = rng.choice(n_ad, n, p=rng.dirichlet(np.ones(n_ad))).astype(np.int64)
    cv = float(rng.choice([0.0, 1.0, 3.0]))

    def lengths(mean):
        if cv == 0:
            return np.full(n, mean, np.int32)
        s2 = np.log1p(cv * cv)
        return np.maximum(1, np.rint(rng.lognormal(np.log(mean) - s2 / 2, np.sqrt(s2), n))).astype(np.int32)

    in_len, out_len = lengths(int(rng.choice([1, 16, 300]))), lengths(int(rng.choice([1, 3, 100])))
    ad_start, ad_list = core.group_by(adapter, n_ad)
    lat = np.array([rng.uniform(0, 0.5), rng.uniform(1, 12), rng.uniform(0, 0.3), rng.uniform(0, 2), 100.0,
                    rng.uniform(0, 4), rng.uniform(0, 0.2), rng.uniform(0, 0.5)])
    if rng.random() < 0.15:  # steps that take no time: every token of a request lands at one instant
        lat[:] = 0.0
        lat[4] = 100.0
    sched = np.array([rng.uniform(0, 5), rng.uniform(0, 25), rng.uniform(0, 5), 0.0, float(n_ad)])
    return (arrival, adapter.view(np.uint64), in_len, out_len, ad_start, ad_list, rng.uniform(0, 30, n_ad),
            duration, int(rng.integers(1, n_ad + 2)), int(rng.choice([1, 3, 20, 300, 5000])), block, budget,
            int(rng.choice([1, 4, 64, 256])), bool(rng.random() < 0.5), lat, sched,
            int(rng.choice([0, 0, 2, 50])), float(rng.choice([0.0, 0.5])))


@pytest.fixture
def make_profile():
    def _make(**changes):
        return profile_from_dict(make_profile_dict(**changes), where="test")

    return _make


@pytest.fixture(scope="session", autouse=True)
def _private_packed_cache(tmp_path_factory):
    """Tests (and the commands they start) keep their packed-forest cache out of the user's home."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORA_PLANNER_CACHE", str(tmp_path_factory.mktemp("packed-cache")))
        yield


@pytest.fixture(autouse=True)
def _fresh_twin_memo():
    """Each test asks the twin afresh: no answer kept from another test (or from a twin another test patched)."""
    from models.twin_memo import MEMO

    MEMO.clear()
    yield
    MEMO.clear()
