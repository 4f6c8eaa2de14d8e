"""Shared test helpers: small hand-made profiles."""

from __future__ import annotations

import copy
import importlib
import os

import pytest

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


#: Set by .ci/run: there the tests of the real vLLM engine must run, so a missing or broken vLLM is an error.
REQUIRE_VLLM = os.environ.get("LORA_PLANNER_REQUIRE_VLLM") == "1"


def vllm_needs(module: str):
    """Import ``module`` for a test of real vLLM (mark it ``pytest.mark.vllm``): skipped where it is
    missing, but an import error where ``LORA_PLANNER_REQUIRE_VLLM=1``."""
    if REQUIRE_VLLM:
        return importlib.import_module(module)
    return pytest.importorskip(module)


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
