"""The twin's rules on small hand-checked cases."""

from __future__ import annotations

import numpy as np
import pytest

from twin import Adapter, InfeasibleError, SimConfig, Workload, core, draw_requests, simulate, trace_requests
from twin.core import EV_ADMITTED, EV_SCHEDULED, step_ms
from twin.metrics import percentiles
from twin.stock_queue import drop_readmitted
from twin.workload import PoissonArrivals


def one_adapter(rate=0.0, rank=8):
    return Workload((Adapter("a", rank, rate),))


def test_single_request_timing_follows_the_step_model(make_profile):
    """10-token prompt, 3 outputs, budget 64: prefill step (samples token 1), then 2 decode steps."""
    prof = make_profile(
        step_latency_ms={"k4_ms_per_request": 2.0, "k5_ms": 10.0, "kp_ms_per_prompt_token": 0.5,
                         "l0_ms": 1.0, "l1_ms_per_request": 0.25, "l2_ms_per_adapter": 3.0},
        scheduler_overhead_us={"k1_us_per_running": 100.0, "k2_us_per_waiting": 0.0,
                               "k3_us_per_waiting_x_amax_over_a": 0.0, "intercept_us": 50.0},
    )
    wl = one_adapter()
    req = trace_requests(wl, [0.0], ["a"], [10], [3])
    res = simulate(wl, prof, SimConfig(a_max=1, duration_s=100), req)
    lat = np.array(prof.step_latency.as_array())
    sched_ms = (100.0 * 1 + 50.0) / 1000.0
    prefill = step_ms(lat, 1, 10, 1) + sched_ms  # adapter resident from start-up: no load
    decode = step_ms(lat, 1, 0, 1) + sched_ms
    assert res.ttft_ms_mean == pytest.approx(prefill)
    assert res.itl_ms_mean == pytest.approx(decode)
    assert res.finished_requests == 1
    assert res.total_throughput_tok_s == pytest.approx(13 / 100)


def test_adapter_load_paid_once_per_miss(make_profile):
    prof = make_profile(adapter_load_ms={"by_max_lora_rank": {"8": {"8": 500.0}, "16": {"16": 1.0}}})
    wl = Workload((Adapter("a", 8, 0.0), Adapter("b", 8, 0.0)))
    # a_max=1: adapter 'a' is resident at start-up; 'b' must be loaded, then 'a' again.
    req = trace_requests(wl, [0.0, 10.0, 20.0], ["a", "b", "a"], [5, 5, 5], [1, 1, 1])
    res = simulate(wl, prof, SimConfig(a_max=1, duration_s=100), req)
    assert res.adapter_loads == 2
    assert res.ttft_ms_mean == pytest.approx((1000 + 1500 + 1500) / 3)


def test_light_load_keeps_up_and_heavy_load_starves(make_profile):
    prof = make_profile(**{"step_latency_ms": {"k4_ms_per_request": 0.5, "k5_ms": 5.0},
                           "engine.max_num_batched_tokens": 512})
    light = simulate(Workload((Adapter("a", 8, 0.5, 50, 20),)), prof, SimConfig(a_max=1, duration_s=600))
    assert not light.starved
    assert light.total_throughput_tok_s == pytest.approx(light.arriving_tok_s, rel=0.05)
    heavy = simulate(Workload((Adapter("a", 8, 200.0, 50, 20),)), prof, SimConfig(a_max=1, duration_s=120))
    assert heavy.starved and heavy.total_throughput_tok_s < 0.9 * heavy.arriving_tok_s


def test_same_seed_same_result_other_seed_differs(make_profile):
    prof = make_profile(step_latency_ms={"k4_ms_per_request": 0.5, "k5_ms": 5.0})
    wl = Workload(tuple(Adapter(f"a{i}", 8, 0.3, 40, 10) for i in range(6)))
    a = simulate(wl, prof, SimConfig(a_max=2, duration_s=300, seed=1))
    b = simulate(wl, prof, SimConfig(a_max=2, duration_s=300, seed=1))
    c = simulate(wl, prof, SimConfig(a_max=2, duration_s=300, seed=2))
    assert a.total_throughput_tok_s == b.total_throughput_tok_s and a.ttft_ms_p99 == b.ttft_ms_p99
    assert a.arrived_requests != c.arrived_requests or a.total_throughput_tok_s != c.total_throughput_tok_s


def test_batches_never_exceed_max_loras_or_kv(make_profile):
    prof = make_profile(**{"step_latency_ms": {"k4_ms_per_request": 1.0, "k5_ms": 5.0},
                           "kv_capacity.no_lora_tokens": 480, "kv_capacity.tokens": {"8": [480], "16": [480]}})
    wl = Workload(tuple(Adapter(f"a{i}", 8, 2.0, 60, 30) for i in range(8)))
    res = simulate(wl, prof, SimConfig(a_max=3, duration_s=60, trace_events=500_000, timeseries_dt_s=0.5),
                   None)
    assert res.preemptions > 0
    assert res.timeseries[:, 3].max() <= 1.0
    from twin.workload import draw_requests

    reqs = draw_requests(wl, 60, 0, default_input_tokens=100, default_output_tokens=50)
    per_step: dict[float, set] = {}
    for t, r, _tok, kind in res.trace:
        if kind in (EV_SCHEDULED, EV_ADMITTED):
            per_step.setdefault(t, set()).add(int(reqs.adapter[int(r)]))
    assert max(len(s) for s in per_step.values()) == 3


def test_memory_error_is_infeasible(make_profile):
    prof = make_profile(**{"kv_capacity.a_max_points": [8, 16], "kv_capacity.tokens": {"8": [4000, 3000], "16": [3500, None]}})
    with pytest.raises(InfeasibleError, match="at most --max-loras 8"):
        simulate(Workload((Adapter("a", 16, 1.0),)), prof, SimConfig(a_max=12, duration_s=10))
    assert prof.kv.tokens_for(12, 8) == 3500  # interpolated between the 8 and 16 points
    assert prof.kv.tokens_for(17, 8) is None  # never extrapolated past the grid


def test_client_cap_rejects_arrivals_beyond_it(make_profile):
    prof = make_profile()  # 1 s steps: hopelessly overloaded
    wl = Workload((Adapter("a", 8, 50.0, 20, 20),))
    res = simulate(wl, prof, SimConfig(a_max=1, duration_s=30, max_in_flight=100))
    assert res.rejected_requests > 0
    assert res.arrived_requests > res.finished_requests + res.rejected_requests


def test_overload_with_huge_queue_is_handled(make_profile):
    """Hundreds of thousands waiting and a full LoRA set: the scan must not be O(waiting)."""
    prof = make_profile(step_latency_ms={"k4_ms_per_request": 0.05, "k5_ms": 20.0})
    wl = Workload(tuple(Adapter(f"a{i}", 8, 20.0, 200, 100) for i in range(100)))
    res = simulate(wl, prof, SimConfig(a_max=4, duration_s=300))
    assert res.arrived_requests > 500_000
    assert res.starved and res.finished_requests > 0


@pytest.mark.parametrize("order", ["random", "ascending", "descending", "ties", "one value", "all equal"])
def test_percentiles_are_numpys(order):
    """twin.metrics.percentiles gives np.percentile's figures exactly, whatever the order of the values."""
    rng = np.random.default_rng(len(order))
    for n in (4096, 10_007, 60_000):
        x = rng.exponential(1.0, n)
        x = {"random": x, "ascending": np.sort(x), "descending": np.sort(x)[::-1].copy(), "ties": np.round(x, 1),
             "one value": np.where(rng.random(n) < 0.002, x, 0.5), "all equal": np.full(n, 0.25)}[order]
        for q in ([99, 99.9], 99, [90, 99.99], [50, 99], 50, 37.3, [25, 75], 0, 100):
            np.testing.assert_array_equal(percentiles(x, q), np.percentile(x, q))


def test_itl_bins_searched_from_edges_are_the_formulas():
    """The engine loops bin each inter-token gap by walking core.itl_bin_edges from the last step's bin: the
    same bins as core.itl_bin_of, at and beside every edge and for gaps of any size in any order."""
    edges = core.itl_edges()
    n_hist = edges.shape[0] - 2
    rng = np.random.default_rng(5)
    beside = [np.nextafter(edges[1:], -np.inf), edges[1:], np.nextafter(edges[1:], np.inf)]
    wide = 10.0 ** rng.uniform(-9, 6, 20_000)
    for gaps in (*beside, wide, np.sort(wide), np.array([0.0, -1.0, 5e-324, 1e-300, 1e299])):
        b = 0
        for g in gaps:
            b = core.itl_bin(g, edges, b)
            assert b == core.itl_bin_of(g, n_hist), g


def test_preempted_stack_drops_requests_readmitted_or_preempted_since():
    """The stack of preempted requests, when full, keeps in order only the entries of requests still waiting
    with the key they were preempted with (a readmitted request runs; one preempted again has a newer entry)."""
    from twin.states import RUNNING, WAITING

    state = np.array([WAITING, RUNNING, WAITING, WAITING], np.int8)
    qkey = np.array([-4, -2, -3, -5], np.int64)
    pre_req = np.array([0, 1, 0, 2, 3, 1], np.int32)
    pre_key = np.array([-1, -2, -4, -3, -5, -6], np.int64)
    n = drop_readmitted(pre_req, pre_key, 6, state, qkey)
    assert (n, pre_req[:n].tolist(), pre_key[:n].tolist()) == (3, [0, 2, 3], [-4, -3, -5])


@pytest.mark.parametrize("adapters", [5, 200])  # buckets of a few equal times, and buckets sorted whole
def test_requests_arriving_together_keep_adapter_order(adapters):
    """Equal arrival times (an arrival process on a grid) are ordered by adapter, as a stable sort orders them."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Grid:  # every adapter's requests at the same whole seconds
        name: str = "grid"

        def adapter_times(self, rate, duration, rng):
            return np.arange(0.0, duration, 1.0 / rate)

    wl = Workload(tuple(Adapter(f"a{i}", 8, 2.0) for i in range(adapters)))
    req = draw_requests(wl, 30.0, seed=0, arrivals=Grid())
    assert np.all(np.diff(req.arrival_s) >= 0)
    same = np.flatnonzero(np.diff(req.arrival_s) == 0)
    assert same.size > 200 and np.all(req.adapter[same] < req.adapter[same + 1])


@pytest.mark.parametrize("seed", range(6))
def test_arrival_order_is_numpys_stable_order(seed):
    """``arrival_order`` orders times as NumPy's stable sort does, whatever their spread: an hour of Poisson
    arrivals, times on a grid (many equal), a burst crowding one bucket, negative times, one time, none, all
    equal, and spreads no bucket width spans (wider than the largest double, narrower than the smallest)."""
    from twin.workload import SMALL_BUCKET, arrival_order

    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 50_000))
    cases = [rng.uniform(0.0, 3600.0, n), np.round(rng.uniform(0.0, 60.0, n)),
             np.r_[rng.uniform(0.0, 3600.0, n), rng.uniform(100.0, 100.001, 50 * SMALL_BUCKET)],
             np.round(rng.uniform(-30.0, 30.0, 500)), np.array([7.0]), np.empty(0), np.full(n, 3.0),
             np.array([-1e308, 1e308, 0.0, 0.0, 1e308]), np.array([0.0, 0.0, 0.0, 5e-324, 0.0])]
    for times in cases:
        assert np.array_equal(arrival_order(times), np.argsort(times, kind="stable"))


def test_single_turn_requests_are_each_adapters_own_draws_in_arrival_order():
    """Single-turn Poisson requests, their times drawn unsorted and ordered all at once, are each adapter's times as
    ``adapter_times`` draws them (sorted), in arrival order."""
    wl = Workload(tuple(Adapter(f"a{i}", 8, rate) for i, rate in enumerate([0.5, 3.0, 0.0, 12.0])))
    req = draw_requests(wl, 600.0, seed=3)
    rng = np.random.default_rng(3)
    for i, a in enumerate(wl.adapters):
        assert np.array_equal(req.arrival_s[req.adapter == i], PoissonArrivals().adapter_times(a.rate_rps, 600.0, rng))
    assert np.all(np.diff(req.arrival_s) >= 0)


#: Compiles the twin and prints the functions ``core.run_loop``'s body calls. Run with an empty numba cache: a
#: ``simulate_core`` loaded from the cache never compiles ``run_loop`` in the process, leaving no LLVM to read.
CALLS_OF_RUN_LOOP = r"""
import json, re
from twin import Adapter, SimConfig, Workload, core, load_profile, simulate
simulate(Workload((Adapter("a", 8, 1.0),)), load_profile("h100-64gb-llama-3.1-8b"),
         SimConfig(a_max=1, duration_s=5.0, seed=0))
(llvm,) = core.run_loop.inspect_llvm().values()
print(json.dumps(sorted(set(re.findall(r"call [^@\n]*@([\w.$]+)", llvm)))))
"""


def test_stock_loop_compiles_to_one_function_without_reference_counting(tmp_path):
    """``core.run_loop`` keeps its speed only while it counts no references and its phases are inlined (see
    "Phases" in twin.core): its compiled body calls no NRT function and no phase."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-c", CALLS_OF_RUN_LOOP], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1], env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)})
    called = set(json.loads(out.stdout.splitlines()[-1]))
    assert called, "no calls found: the pattern no longer matches numba's LLVM"
    assert not [c for c in called if c.startswith("NRT_")]
    phases = ("arrive", "sample_series", "fast_step_demand", "schedule_fast", "schedule_running",
              "schedule_waiting", "next_adapter", "load_adapters", "finish_steady", "free_finished", "split_steady")
    assert not [c for c in called if any(f"{len(p)}{p}" in c for p in phases)]
