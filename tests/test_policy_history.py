"""Multi-turn conversations and history-KV reuse (twin.workload.Conversations, twin.policies.history)
on small hand-checked cases."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import STEP_10MS

from twin import Adapter, Conversations, Requests, SimConfig, Workload, WorkloadError, draw_requests, simulate
from twin.policies import policy_from_name

TWO = Workload((Adapter("a", 8, 0.0), Adapter("b", 8, 0.0)))


@pytest.fixture
def prof(make_profile):
    """10 ms steps of up to 64 tokens, blocks of 16 tokens, a pool of 299 blocks, adapters of 10
    blocks copied in 25 ms, KV of 1000 bytes per token over a 1 MB/s link: 1 ms per token swapped."""
    return make_profile(step_latency_ms=STEP_10MS, **{"engine.kv_cache_bytes": 4_800_000},
                        adapter_load_ms={"by_max_lora_rank": {"8": {"8": 25.0}, "16": {"16": 25.0}}},
                        policy_terms={"adapter_kv_tokens": {"8": 160}, "host_link_gb_s": 0.001})


def conversation(arrivals, adapters, prompts, outputs, conv, history) -> Requests:
    return Requests(np.array(arrivals, float), np.array(adapters, np.int64), np.array(prompts, np.int32),
                    np.array(outputs, np.int32), conversation=np.array(conv, np.int64),
                    history_tokens=np.array(history, np.int32))


def run(prof, req, **params):
    cfg = SimConfig(a_max=4, duration_s=100, policy=policy_from_name("elora", **params))
    return simulate(TWO, prof, cfg, req)


# Turn 1 of adapter a: 40 prompt + 9 output tokens; its KV ends at 48 tokens = 3 full blocks.
# Turn 2 at 5 s: 49 history + 20 new tokens = 69 (more than one 64-token step).
TURNS = ([0.0, 5.0], [0, 0], [40, 69], [9, 5], [0, 0], [0, 49])
# Adapter b's 4450-token prompt (279 blocks) at 1 s fills the pool: 10 + 10 + 279 + 3 > 299 blocks.
SQUEEZED = ([0.0, 1.0, 5.0], [0, 1, 0], [40, 4450, 69], [9, 2, 5], [0, -1, 0], [0, 0, 49])


def test_turns_carry_their_conversation_so_far():
    wl = Workload((Adapter("a", 8, 2.0, 10, 5), Adapter("b", 8, 1.0, 20, 7)))
    req = draw_requests(wl, 2000.0, seed=3, conversations=Conversations(turns=3, think_s=5))
    assert len(req) / 2000.0 == pytest.approx(3.0, rel=0.05)  # rates stay turns per second
    assert len(req) / req.conversations == pytest.approx(3.0, rel=0.1)
    for c in range(50):
        turns = np.flatnonzero(req.conversation == c)
        a = req.adapter[turns[0]]
        assert (req.adapter[turns] == a).all() and (np.diff(req.arrival_s[turns]) >= 0).all()
        new, out = (10, 5) if a == 0 else (20, 7)
        k = np.arange(len(turns))
        assert (req.history_tokens[turns] == k * (new + out)).all()
        assert (req.input_tokens[turns] == k * (new + out) + new).all()
    with pytest.raises(WorkloadError):
        Conversations(turns=0.5)


def test_a_later_turn_reuses_the_full_blocks_of_the_one_before(prof):
    kept = run(prof, conversation(*TURNS))
    recomputed = run(prof, conversation(*TURNS), prefix_cache=False)
    # Turn 1: 25 ms copy + one step. Turn 2 computes 69 - 48 = 21 tokens in one step, or 69 in two.
    assert kept.ttft_ms_mean == pytest.approx((35 + 10) / 2)
    assert recomputed.ttft_ms_mean == pytest.approx((35 + 20) / 2)
    assert kept.policy_stats["prefill_tokens"] == 40 + 21
    assert recomputed.policy_stats["prefill_tokens"] == 40 + 69
    assert kept.policy_stats["history_reused"] == pytest.approx(48 / 49)
    assert "history_reused" not in recomputed.policy_stats


def test_evicted_history_is_swapped_back_with_a_host_tier_and_recomputed_without(prof):
    swapped = run(prof, conversation(*SQUEEZED))
    dropped = run(prof, conversation(*SQUEEZED), host_kv=False)
    for res in (swapped, dropped):
        # The dependency rule spares adapter a while its history is on the GPU: the history goes.
        assert res.policy_stats["history_evictions"] == 1 and res.policy_stats["evictions"] == 0
        assert res.policy_stats["invalid_kv_share"] == 0.0
    assert swapped.policy_stats["history_swap_ins"] == 1 and swapped.policy_stats["history_reused"] == pytest.approx(
        48 / 49)
    assert dropped.policy_stats["history_swap_ins"] == 0 and dropped.policy_stats["history_reused"] == 0.0
    # Only turn 2 differs. Swapped back: 48 tokens x 1 ms over the link, then one step; dropped: 69
    # tokens in two steps.
    assert 3 * (swapped.ttft_ms_mean - dropped.ttft_ms_mean) == pytest.approx((48 + 10) - 20)
    assert swapped.policy_stats["prefill_tokens"] == 40 + 4450 + 21
    assert dropped.policy_stats["prefill_tokens"] == 40 + 4450 + 69


def test_without_the_dependency_rule_history_outlives_its_adapter(prof):
    # LRU: adapter a was last used in turn 1's last step, its history at that step's end, so a goes.
    lru = run(prof, conversation(*SQUEEZED), cache="lru", dependency=False)
    ordered = run(prof, conversation(*SQUEEZED), cache="lru")
    assert lru.policy_stats["evictions"] == 1 and lru.policy_stats["history_evictions"] == 0
    assert lru.policy_stats["invalid_kv_share"] > 0  # a's history sat on the GPU without a
    assert ordered.policy_stats["evictions"] == 0 and ordered.policy_stats["history_evictions"] == 1
    assert ordered.policy_stats["invalid_kv_share"] == 0.0
    # Turn 2 reloads a (25 ms) and still finds its history: one step of 21 tokens; with the rule,
    # its history comes back over the link (48 ms) and a step follows.
    assert lru.policy_stats["history_reused"] == ordered.policy_stats["history_reused"] == pytest.approx(48 / 49)
    assert 3 * (lru.ttft_ms_mean - ordered.ttft_ms_mean) == pytest.approx((25 + 10) - (48 + 10))


def test_slora_reuses_no_history_and_stock_vllm_recomputes_it(prof):
    req = conversation(*TURNS)
    slora = simulate(TWO, prof, SimConfig(a_max=4, duration_s=100, policy=policy_from_name("slora")), req)
    stock = simulate(TWO, prof, SimConfig(a_max=4, duration_s=100), req)
    assert "history_reused" not in slora.policy_stats and slora.policy_stats["prefill_tokens"] == 40 + 69
    assert stock.finished_requests == slora.finished_requests == 2


def test_an_adapter_whose_history_was_reused_can_still_be_evicted(prof):
    # a's two turns leave 4 blocks of history; b's 4500-token prompt (282 blocks) then needs a's
    # history and a itself to go (10 + 10 + 282 + 4 > 299 blocks).
    req = conversation([0.0, 5.0, 10.0], [0, 0, 1], [40, 69, 4500], [9, 5, 2], [0, 0, -1], [0, 49, 0])
    res = run(prof, req)
    assert res.finished_requests == 3 and res.rejected_requests == 0
    assert res.policy_stats["history_evictions"] == 1 and res.policy_stats["evictions"] == 1


def test_a_request_over_max_model_len_is_refused_without_cutting_the_run_short(make_profile):
    short = make_profile(step_latency_ms=STEP_10MS, **{"engine.max_model_len": 100, "engine.kv_cache_bytes": 4_800_000})
    req = conversation([0.0, 1.0, 2.0], [0, 0, 0], [40, 200, 40], [9, 5, 9], [0, 0, 1], [0, 49, 0])
    for policy in (None, policy_from_name("elora")):
        res = simulate(TWO, short, SimConfig(a_max=4, duration_s=100, policy=policy), req)
        assert res.finished_requests == 2 and res.rejected_requests == 1


@pytest.mark.parametrize("params", [{}, {"dependency": False}, {"cache": "lru"}, {"host_kv": False}])
def test_busy_multi_turn_runs_finish_and_reuse_history(make_profile, params):
    """Short think times and a small pool: turns overlap, history and adapters are evicted, swapped
    back, and land in every order (a loop waiting on a copy that already landed would never end)."""
    small = make_profile(step_latency_ms={"k4_ms_per_request": 0.5, "k5_ms": 5.0}, **{"engine.kv_cache_bytes": 4_800_000},
                         adapter_load_ms={"by_max_lora_rank": {"8": {"8": 20.0}, "16": {"16": 20.0}}},
                         policy_terms={"adapter_kv_tokens": {"8": 480}, "host_link_gb_s": 0.05})
    wl = Workload(tuple(Adapter(f"a{i}", 8, 0.8, 60, 20) for i in range(6)))
    cfg = SimConfig(a_max=4, duration_s=140, policy=policy_from_name("elora", **params),
                    conversations=Conversations(turns=4, think_s=3))
    res = simulate(wl, small, cfg)
    assert res.finished_requests > 0.8 * res.arrived_requests
    assert 0 < res.policy_stats["history_reused"] <= 1
