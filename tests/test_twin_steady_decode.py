"""Fast steps (steady decoders held implicitly, twin.steady_decode) give exactly the explicit loop's results.

Recording a trace keeps the core on the explicit loop, so each scenario runs twice, with and without a
trace, and every per-request time, the ITL histogram, the counters and the time series must be equal;
the run without a trace must have taken fast steps (counter 6). The named scenarios mix what forces
explicit steps (prompts longer than the budget, a KV cache small enough to preempt, a full LoRA set,
adapter loads, a client cap) with long stretches of steady decoding; the random ones drive the core
directly over extreme settings (one-token budgets and blocks, one sequence, zero-time steps).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_core_args

from twin import Adapter, SimConfig, Workload, core, simulate, trace_requests
from twin.steady_decode import finish_calendar, finishing, make_steady
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
    assert fast[4][3] > 1000 and (fast[0] == core.FINISHED).sum() > 100  # a run worth comparing
    assert fast[4][6] > 100 and explicit[4][6] == 0
    _assert_same(fast, explicit)


def test_zero_time_steps_keep_a_recomputing_request_explicit(monkeypatch, make_profile):
    """With steps of no time a preempted request recomputing its tokens still has its last token time
    equal to the step's end; it must not be taken for one that sampled (review finding: it was, and lost
    preemptions and tokens). Three KV blocks of 64 tokens force the preemptions."""
    profile = make_profile(**{"step_latency_ms": {"k4_ms_per_request": 0.0, "k5_ms": 0.0}, "engine.block_size": 64,
                              "engine.admission": "first_chunk", "kv_capacity.no_lora_tokens": 256,
                              "kv_capacity.tokens": {"8": [256], "16": [256]}})
    wl = Workload((Adapter("a0", 8, 1.0, 50, 50),))
    req = trace_requests(wl, [9.0, 9.0], ["a0", "a0"], [66, 45], [37, 52])
    outs = []
    explicit = core.simulate_core
    monkeypatch.setattr(core, "simulate_core", lambda *args: outs.append(explicit(*args)) or outs[-1])
    simulate(wl, profile, SimConfig(a_max=1, duration_s=10.0), req)
    simulate(wl, profile, SimConfig(a_max=1, duration_s=10.0, trace_events=1), req)
    assert outs[1][4][0] == 9  # preemptions
    _assert_same(*outs)


def _assert_same(fast, explicit):
    """Core outputs equal but for the trace length and the fast-step count."""
    for k in (0, 1, 2, 3, 6):  # states, first-token and finish times, ITL histogram, time series
        np.testing.assert_array_equal(fast[k], explicit[k])
    np.testing.assert_array_equal(fast[4][:5], explicit[4][:5])
    assert fast[5] == explicit[5]  # busy time


def test_fast_steps_match_the_explicit_loop_on_random_engines():
    rng = np.random.default_rng(2026)
    fast_steps = 0
    for _ in range(300):
        args = random_core_args(rng)
        fast = core.simulate_core(*args, 0, core.itl_edges())
        _assert_same(fast, core.simulate_core(*args, 1, core.itl_edges()))
        fast_steps += fast[4][6]
    assert fast_steps > 10_000


def test_finish_calendar_gives_each_step_its_requests():
    """Requests made steady are handed back at the fast step they finish, each exactly once; a bucket left
    from an earlier lazy spell (epoch) is stale."""
    rng = np.random.default_rng(0)
    out_len = rng.integers(2, 40, 300)
    cal, fin_next = finish_calendar(out_len), np.empty(300, np.int64)
    computed, done_at = np.ones(300, np.int64), out_len + 1  # prompts of one token, each just sampled
    steady, g0, cnt = np.zeros(300, np.bool_), np.zeros(300, np.int64), np.zeros(16, np.int64)
    for r in range(300):
        make_steady(r, 5, computed, done_at, steady, g0, cnt, 16, cal, fin_next, 0)
    make_steady(0, 5, computed, done_at, steady, g0, cnt, 16, cal, fin_next, 1)  # a later spell
    got = {}
    for g in range(5, 5 + 40):
        r = finishing(cal, g, 0)
        while r >= 0:
            assert r not in got
            got[r] = g
            r = fin_next[r]
    # request 0's bucket (and those sharing its step) went to epoch 1
    same_as_0 = {r for r in range(300) if out_len[r] == out_len[0]}
    assert got == {r: 5 + int(out_len[r]) - 2 for r in range(300) if r not in same_as_0}
