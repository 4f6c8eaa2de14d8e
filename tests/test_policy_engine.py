"""Serving policies in the twin's loop on small hand-checked cases (twin.policies.engine)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import STEP_10MS, make_profile_dict

from twin import Adapter, LengthModel, SimConfig, Workload, draw_requests, simulate, trace_requests
from twin.core import EV_ADMITTED, EV_PREEMPTED
from twin.policies import policy_from_name
from twin.policies.spec import PolicySpec
from twin.profile import profile_from_dict


@pytest.fixture
def prof(make_profile):
    """10 ms steps, 25 ms adapter copies, adapters of 160 pool tokens, CPU LoRA 8 ms per prompt token."""
    return make_profile(step_latency_ms=STEP_10MS,
                        adapter_load_ms={"by_max_lora_rank": {"8": {"8": 25.0}, "16": {"16": 25.0}}},
                        policy_terms={"adapter_kv_tokens": {"8": 160}, "cpu_lora_us_per_token_rank": 1000.0})


def run(prof, wl, times, ads, ins, outs, policy, a_max=4, **params):
    req = trace_requests(wl, times, ads, ins, outs)
    cfg = SimConfig(a_max=a_max, duration_s=100, trace_events=10_000, policy=policy_from_name(policy, **params))
    return simulate(wl, prof, cfg, req), req


ONE = Workload((Adapter("a", 8, 0.0),))


def test_cold_start_modes_hand_off_between_cpu_and_gpu(prof):
    """A 10-token prompt on a cold adapter (25 ms copy, 10 ms step)."""
    inline, _ = run(prof, ONE, [0.0], ["a"], [10], [2], "slora", cold_start="inline")
    assert inline.ttft_ms_mean == pytest.approx(25 + 10)  # the copy runs inside the step
    assert inline.policy_stats["load_stall_s"] == pytest.approx(0.025)
    waited, _ = run(prof, ONE, [0.0], ["a"], [10], [2], "slora")
    assert waited.ttft_ms_mean == pytest.approx(25 + 10)  # waits for the copy, then one step
    assert waited.policy_stats["load_stall_s"] == 0.0
    cpu, _ = run(prof, ONE, [0.0], ["a"], [10], [2], "toppings")
    # CPU LoRA: 10 tokens x rank 8 x 1 µs = 80 ms, of which 10 overlap the GPU step; + 1 ms sync
    assert cpu.ttft_ms_mean == pytest.approx(80 + 1)
    assert cpu.policy_stats["cpu_assisted_steps"] == 1  # the copy has landed by the next step
    assert cpu.itl_ms_mean == pytest.approx(10)


def test_cpu_share_shrinks_as_the_copy_proceeds(prof, make_profile):
    slow = make_profile(step_latency_ms=STEP_10MS,
                        adapter_load_ms={"by_max_lora_rank": {"8": {"8": 200.0}, "16": {"16": 200.0}}},
                        policy_terms={"adapter_kv_tokens": {"8": 160}, "cpu_lora_us_per_token_rank": 1000.0})
    # Two requests of one adapter, the second arrives 100 ms into the 200 ms copy: half of its layers
    # still run on CPU (40 of 80 ms).
    res, _ = run(slow, ONE, [0.0, 0.1], ["a", "a"], [10, 10], [1, 1], "toppings", cpu_sync_ms=0.0, cache="lru")
    assert res.adapter_loads == 1
    assert res.policy_stats["cpu_assisted_steps"] == 2
    assert res.ttft_ms_mean == pytest.approx((80 + 40) / 2)


def test_inline_loads_stall_running_decodes_async_loads_do_not(prof):
    wl = Workload((Adapter("a", 8, 0.0), Adapter("b", 8, 0.0)))
    args = (wl, [0.0, 0.1], ["a", "b"], [10, 10], [30, 2])
    inline, _ = run(prof, *args, "slora", cold_start="inline")
    waited, _ = run(prof, *args, "slora")
    assert inline.itl_ms_p99 > 30 and waited.itl_ms_p99 < 11  # a's decode paid b's copy inline
    assert inline.policy_stats["load_stall_s"] == pytest.approx(0.050)


def test_discard_after_use_reloads_a_cache_keeps(prof):
    times, ads = [0.0, 5.0, 10.0], ["a", "a", "a"]
    slora, _ = run(prof, ONE, times, ads, [10] * 3, [2] * 3, "slora")
    cached, _ = run(prof, ONE, times, ads, [10] * 3, [2] * 3, "chameleon")
    assert slora.adapter_loads == 3 and cached.adapter_loads == 1
    assert cached.policy_stats["adapter_hit_rate"] == pytest.approx(2 / 3)
    assert cached.ttft_ms_p50 == pytest.approx(10)


def test_memory_pressure_evicts_by_the_cache_rule(make_profile):
    """Pool of 299 blocks; adapters of 100 blocks; a 1000-token prompt needs 63 blocks."""
    p = make_profile(step_latency_ms=STEP_10MS,
                     policy_terms={"adapter_kv_tokens": {"8": 1600}})
    wl = Workload(tuple(Adapter(x, 8, 0.0) for x in "abcd"))
    # a used 3 times, then b, c once each: a, b, c cached (300 blocks > 299: c's load evicts one).
    times = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    ads = ["a", "a", "a", "b", "c", "d"]
    ins, outs = [10] * 6, [2] * 6
    lru, _ = run(p, wl, times, ads, ins, outs, "slora", cache="lru")
    cham, _ = run(p, wl, times, ads, ins, outs, "chameleon", scheduler="fifo")
    # LRU drops a (oldest) for c and b for d: a is gone. Chameleon keeps the frequently used a.
    assert lru.policy_stats["evictions"] == 2 and cham.policy_stats["evictions"] == 2
    more = ([6.0], ["a"])
    lru2, _ = run(p, wl, times + more[0], ads + more[1], ins + [10], outs + [2], "slora", cache="lru")
    cham2, _ = run(p, wl, times + more[0], ads + more[1], ins + [10], outs + [2], "chameleon", scheduler="fifo")
    assert lru2.adapter_loads == 5  # a, b, c, d, and a again
    assert cham2.adapter_loads == 4  # a still cached


def test_mlq_serves_small_requests_first_and_holds_quota_until_finish(prof):
    wl = Workload((Adapter("a", 8, 0.0),))
    # Three large requests (1000 + 500 tokens each) then a small one, all at t=0, two queues with
    # the static start-up split: quota 4784 / 2 = 2392 tokens per queue.
    res, _ = run(prof, wl, [0.0, 0.0, 0.0, 0.0], ["a"] * 4, [1000, 1000, 1000, 10], [500, 500, 500, 2],
                   "chameleon", queues=2, output_prediction_sigma=0.0, prefetch=True)
    ev = res.trace
    admitted = [(t, int(r)) for t, r, _tok, kind in ev if kind == EV_ADMITTED]
    first = {}
    for t, r in admitted:
        first.setdefault(r, t)
    assert admitted[0][1] == 3  # the small request goes first although it arrived last
    # Large request 0 fits its queue's quota, 1 borrows the emptied small queue's quota, 2 waits
    # for one of them to finish and return its quota (KV alone would have admitted it at once).
    assert first[1] < 1.0
    fifo, _ = run(prof, wl, [0.0, 0.0, 0.0, 0.0], ["a"] * 4, [1000, 1000, 1000, 10], [500, 500, 500, 2], "slora")
    fifo_first = {}
    for t, r, _tok, kind in fifo.trace:
        if kind == EV_ADMITTED:
            fifo_first.setdefault(int(r), t)
    assert fifo_first[2] < 1.0
    assert first[2] > 5.0  # after hundreds of decode steps of request 0 or 1
    assert res.finished_requests == 4 and res.preemptions == 0


def test_elora_swaps_back_recently_used_adapters_when_memory_is_idle(make_profile):
    """Pool of 999 blocks, adapters of 100. Six adapters are used once and stay cached; then eight
    long requests of adapters a, b grow their KV and evict all six. When those finish the pool is
    idle and the batch has been ~8: Low_lora = 2(1 - (10/14)^8) + 6(1 - (13/14)^8) = 4.5, so the
    swapper brings 3 of the six back (5 resident), while z, never used, stays on the host."""
    p = make_profile(step_latency_ms=STEP_10MS,
                     policy_terms={"adapter_kv_tokens": {"8": 1600}}, **{"kv_capacity.no_lora_tokens": 16000})
    wl = Workload(tuple(Adapter(x, 8, 0.0) for x in "abcdefghz"))
    times = [0.0] * 6 + [1.0] * 8 + [40.0]
    ads = list("cdefgh") + ["a", "b"] * 4 + ["a"]
    ins, outs = [10] * 15, [2] * 6 + [1500] * 8 + [2]
    res, _ = run(p, wl, times, ads, ins, outs, "elora", a_max=9)
    st = res.policy_stats
    assert st["evictions"] == 6
    assert st["swap_ins"] == 3
    assert res.adapter_loads == 8 + 3
    slora, _ = run(p, wl, times, ads, ins, outs, "slora", a_max=9)
    assert slora.policy_stats["swap_ins"] == 0


#: The policy loop set up as stock vLLM: adapters take no pool memory and are all on the GPU from the start
#: (as vLLM activates its static adapters), LRU cache, inline loads, FIFO scan, no prefetch or bypass.
STOCK_LIKE = PolicySpec("slora", cache="lru", cold_start="inline", prefetch=False, bypass=False, preload_all=True)


#: What the two-loop test's random engines stress. Engines drawn at large rarely preempt (a policy loop
#: queueing preempted requests at the back failed 5 of 40 of them), so the other kinds give the KV cache
#: room for a few requests only, each adding its own stress; every case checks its run did what its kind names.
KINDS = ("any", "preemption", "lora-churn", "long-prompts")


def _random_case(rng, kind):
    """(profile, workload, a_max, requests) of a random engine and workload of ``kind``."""
    block = int(rng.choice([16, 32]))
    budget = int(rng.choice([64, 256] if kind == "long-prompts" else [64, 256, 2048]))
    churn = kind == "lora-churn"
    n = int(rng.integers(8, 25)) if churn else int(rng.integers(1, 6))
    a_max = int(rng.integers(1, 4)) if churn else int(rng.integers(n, n + 3))  # else no adapter is ever evicted
    prompts = rng.uniform(1.5, 4, n) * budget if kind == "long-prompts" else rng.uniform(20, 300, n)
    outputs = rng.uniform(100, 600, n) if kind == "preemption" else rng.uniform(5, 100, n)
    if kind == "any":
        tokens = int(rng.integers(20, 400)) * block
    else:  # room for a few mean requests
        tokens = int(rng.uniform(1.5, 4) * (prompts + outputs).mean() / block + 1) * block
    rates = rng.uniform(0.05, 3, n) if kind == "any" else rng.uniform(0.5, 3, n)

    def load_ms():
        # Where adapters outnumber the slots the stock loop reloads evicted ones, while the policy loop set
        # up as stock keeps them all on the GPU: loads take no time (1e-300 ms vanishes from any step).
        return 1e-300 if churn else float(rng.uniform(1, 50))

    profile = profile_from_dict(make_profile_dict(**{
        "engine.version": str(rng.choice(["0.8.5", "0.32.0"])), "engine.block_size": block,
        "engine.max_num_batched_tokens": budget,
        "engine.max_num_seqs": int(rng.choice([4, 16, 256])),
        "kv_capacity.no_lora_tokens": tokens, "kv_capacity.a_max_points": [a_max + 2],
        "kv_capacity.tokens": {"8": [tokens], "16": [tokens]},
        "step_latency_ms": {"k4_ms_per_request": float(rng.uniform(0, 0.2)), "k5_ms": float(rng.uniform(5, 20))},
        "scheduler_overhead_us": {"k1_us_per_running": float(rng.uniform(0, 5)), "k2_us_per_waiting": float(rng.uniform(0, 5)),
                                  "k3_us_per_waiting_x_amax_over_a": float(rng.uniform(0, 1)), "intercept_us": 50.0},
        "adapter_load_ms": {"by_max_lora_rank": {"8": {"8": load_ms()}, "16": {"8": load_ms(), "16": load_ms()}}},
        "policy_terms": {"adapter_kv_tokens": {"8": 0, "16": 0}}}), where="random engine")
    wl = Workload(tuple(Adapter(f"a{i}", int(rng.choice([8, 16])), rates[i], prompts[i], outputs[i]) for i in range(n)))
    cv = 0.0 if kind == "any" else float(rng.choice([0.0, 0.5, 1.0]))
    return profile, wl, a_max, draw_requests(wl, 60.0, int(rng.integers(1 << 30)), lengths=LengthModel.lognormal(cv))


@pytest.mark.parametrize("seed", range(60), ids=lambda seed: f"{KINDS[seed % len(KINDS)]}-{seed}")
def test_policy_loop_set_up_as_stock_vllm_is_the_stock_loop(seed):
    """Both loops implement vLLM's step; on random engines they must agree to the last request time."""
    kind = KINDS[seed % len(KINDS)]
    rng = np.random.default_rng(seed)
    profile, wl, a_max, req = _random_case(rng, kind)
    cfg = {"a_max": a_max, "duration_s": 60.0, "request_times": True, "max_in_flight": int(rng.choice([0, 8]))}
    stock = simulate(wl, profile, SimConfig(**cfg), req)
    loop = simulate(wl, profile, SimConfig(**cfg, policy=STOCK_LIKE), req)
    assert loop.policy == "slora" and stock.policy == "vllm"
    assert stock.finished_requests > 0
    if kind != "any":
        assert stock.preemptions > 0, kind
    if kind == "lora-churn":
        assert stock.adapter_loads >= 2 * a_max, "the LoRA slots turned over twice"
    if kind == "long-prompts":
        assert (req.input_tokens > profile.engine.max_num_batched_tokens).mean() > 0.5, "prompts chunked"
    np.testing.assert_array_equal(loop.request_times, stock.request_times)
    for key in ("arrived_requests", "finished_requests", "preemptions", "engine_steps", "total_throughput_tok_s"):
        assert getattr(loop, key) == getattr(stock, key), key


@pytest.fixture
def big_adapter_prof(make_profile):
    """Pool of 299 blocks, 10 ms steps, 25 ms copies; rank-8 adapters take 10 blocks, rank 16 200."""
    return make_profile(step_latency_ms=STEP_10MS,
                        adapter_load_ms={"by_max_lora_rank": {"8": {"8": 25.0},
                                                              "16": {"8": 25.0, "16": 25.0}}},
                        policy_terms={"adapter_kv_tokens": {"8": 160, "16": 3200}})


def _first(res, kind):
    out = {}
    for t, r, _tok, k in res.trace:
        if k == kind:
            out.setdefault(int(r), t)
    return out


BYPASS_WL = Workload((Adapter("x", 8, 0.0), Adapter("w", 8, 0.0), Adapter("big", 16, 0.0), Adapter("y", 8, 0.0)))


def bypass_run(prof, out_a, **params):
    """Requests 0 (x) and 1 (w) fill the KV; at 0.5 s request 2 needs the 200-block adapter, which
    fits only once 0 finishes and x turns idle; request 3 (y, 480 prompt tokens = 30 blocks, 100
    outputs) queues behind it."""
    return run(prof, BYPASS_WL, [0.0, 0.0, 0.5, 0.5], ["x", "w", "big", "y"], [800, 1120, 10, 480],
               [out_a, 400, 2, 100], "chameleon", queues=1, output_prediction_sigma=0.0, **params)[0]


def test_bypass_lets_a_short_request_pass_a_head_waiting_for_adapter_memory(big_adapter_prof):
    # 0 runs long enough (700 outputs) that 3's 101 predicted steps end well before 2's memory.
    blocked = bypass_run(big_adapter_prof, 700, bypass=False)
    passed = bypass_run(big_adapter_prof, 700)
    b_adm, p_adm = _first(blocked, EV_ADMITTED), _first(passed, EV_ADMITTED)
    assert b_adm[3] >= b_adm[2] > 4.0  # the blog's blocked head: 3 waits for 2, which waits for 0
    assert p_adm[3] < 0.55  # after y's 25 ms copy, past the blocked head
    assert passed.policy_stats["bypasses"] == 1 and passed.policy_stats["squashed"] == 0
    assert p_adm[2] == pytest.approx(b_adm[2], abs=0.02)  # the head is not delayed
    assert passed.finished_requests == blocked.finished_requests == 4


def test_a_bypasser_is_squashed_when_the_heads_memory_turns_up_first(big_adapter_prof):
    # 0 finishes after 50 outputs. The wait prediction counts KV only (0's 53 blocks are short of
    # 2's 57), so it waits for 1 (400 outputs): 3 may pass. But 0's end also leaves x idle, and
    # with 3's 30 blocks counted 2's adapter fits: 3 is squashed.
    res = bypass_run(big_adapter_prof, 50)
    adm, pre = _first(res, EV_ADMITTED), _first(res, EV_PREEMPTED)
    assert res.policy_stats["bypasses"] == 1 and res.policy_stats["squashed"] == 1
    assert adm[3] < 0.55 and pre[3] < 1.0  # squashed before its 100 outputs end
    assert pre[3] < adm[2] < pre[3] + 0.1  # 2 gets the memory (and its 25 ms copy) at once
    admitted_again = [t for t, r, _tok, k in res.trace if k == EV_ADMITTED and r == 3]
    assert len(admitted_again) == 2 and admitted_again[1] >= adm[2]  # 3 restarts behind 2
    assert res.finished_requests == 4
