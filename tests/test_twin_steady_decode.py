"""Fast steps (steady decoders held implicitly, twin.steady_decode) give exactly the explicit loop's results.

Recording a trace keeps the core on the explicit loop, so each scenario runs twice, with and without a
trace, and every per-request time, the ITL histogram, the counters and the time series must be equal.
The scenarios mix what forces explicit steps (prompts longer than the budget, a KV cache small enough
to preempt, a full LoRA set, adapter loads, a client cap) with long stretches of steady decoding.
"""

from __future__ import annotations

import numpy as np
import pytest

from twin import Adapter, SimConfig, Workload, core, simulate
from twin.steady_decode import heap_pop, heap_push
from twin.workload import LengthModel

SCENARIOS = {
    # name: (profile changes, adapters (rank, rate, prompt, output), a_max, length cv, max_in_flight)
    "steady": ({}, [(8, 3.0, 40, 200)] * 4, 4, 0.0, 0),
    "chunked prompts": ({}, [(8, 1.0, 300, 80), (16, 2.0, 30, 150)], 2, 1.0, 0),
    "preempting": ({"kv_capacity.tokens": {"8": [900], "16": [900]}}, [(8, 4.0, 60, 120)] * 3, 3, 0.8, 0),
    "lora limit and loads": ({}, [(8, 0.8, 50, 90)] * 12, 3, 0.5, 0),
    "adapter churn": ({}, [(8, 0.15, 50, 90)] * 12, 4, 0.5, 0),
    "client cap": ({}, [(16, 6.0, 40, 100)] * 2, 2, 0.3, 40),
    "large blocks": ({"engine.block_size": 128, "engine.max_num_batched_tokens": 512}, [(8, 2.5, 120, 300)] * 5, 2,
                     1.0, 0),
}
STEP = {"k4_ms_per_request": 0.05, "k5_ms": 8.0, "kp_ms_per_prompt_token": 0.02,
        "l0_ms": 0.5, "l1_ms_per_request": 0.01, "l2_ms_per_adapter": 0.3}


def _core_outputs(monkeypatch, workload, profile, config):
    seen = []
    explicit = core.simulate_core

    def record(*args):
        seen.append(explicit(*args))
        return seen[-1]

    monkeypatch.setattr(core, "simulate_core", record)
    simulate(workload, profile, config)
    monkeypatch.setattr(core, "simulate_core", explicit)
    return seen[0]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_fast_steps_match_the_explicit_loop(monkeypatch, make_profile, name):
    changes, adapters, a_max, cv, cap = SCENARIOS[name]
    profile = make_profile(**{"step_latency_ms": STEP, "adapter_load_ms.by_max_lora_rank":
                              {"8": {"8": 4.0}, "16": {"8": 5.0, "16": 6.0}}, **changes})
    wl = Workload(tuple(Adapter(f"a{i}", *spec) for i, spec in enumerate(adapters)))
    base = {"a_max": a_max, "duration_s": 150.0, "seed": 5, "lengths": LengthModel.lognormal(cv),
            "max_in_flight": cap, "timeseries_dt_s": 1.0}
    fast = _core_outputs(monkeypatch, wl, profile, SimConfig(**base))
    explicit = _core_outputs(monkeypatch, wl, profile, SimConfig(**base, trace_events=1))
    state, first, finish, hist, counters, busy, ts, _ = fast
    assert counters[3] > 1000 and (state == core.FINISHED).sum() > 100  # a run worth comparing
    for got, want in zip((state, first, finish, hist, counters[:5], ts), explicit[:4] + (explicit[4][:5], explicit[6])):
        np.testing.assert_array_equal(got, want)
    assert busy == explicit[5]


def test_heap_pops_in_key_order_and_grows():
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 50, 300)
    hk, hr, size = np.empty(2, np.int64), np.empty(2, np.int64), 0
    for i, k in enumerate(keys):
        hk, hr, size = heap_push(hk, hr, size, k, i)
    popped = []
    while size:
        popped.append((hk[0], hr[0]))
        size = heap_pop(hk, hr, size)
    assert [k for k, _ in popped] == sorted(keys.tolist())
    assert sorted(r for _, r in popped) == list(range(300))
