"""Packing algorithms on hand-checkable cases (capacity predictor) and their invariants."""

from __future__ import annotations

import numpy as np
import pytest

from planner.baselines import dlora_lora_size_tokens, plan_dlora, plan_latency, plan_maxbase, plan_random
from planner.greedy import plan_greedy
from planner.packing import PackRequest, a_max_candidates, priority_order
from planner.paper_greedy import plan_paper_greedy
from tests.planner_helpers import CapacityPredictor, workload
from twin import InfeasibleError, load_profile


@pytest.fixture(scope="module")
def profile():
    return load_profile("h100-64gb-llama-3.1-8b")


def request(profile, rates, ranks=None, gpus=1000, capacity=1000.0, seed=0):
    return PackRequest.build(workload(rates, ranks), profile, CapacityPredictor(capacity), gpus, seed=seed)


def loads(req, groups):
    per = req.arriving_tok_s
    return [sum(per[i] * s for i, s in g.shares.items()) for g in groups]


def test_priority_order_is_rank_desc_then_zigzag():
    ranks = np.array([8, 8, 8, 8, 16, 16, 16])
    rates = np.array([0.1, 0.4, 0.2, 0.3, 1.0, 3.0, 2.0])
    assert priority_order(ranks, rates) == [5, 4, 6, 1, 0, 3, 2]


def test_a_max_candidates_respect_memory_and_adapter_count(profile):
    limit32 = profile.kv.max_a_max(32)
    assert a_max_candidates(profile.kv, [32], 1000)[-1] == limit32
    assert a_max_candidates(profile.kv, [8], 5) == [5]
    assert a_max_candidates(profile.kv, [8], 20) == [8, 16, 20]


def test_greedy_fills_each_gpu_to_its_limit_and_balances(profile):
    # 100 tok/s per adapter, a GPU keeps up with <= 1111 tok/s: 11 adapters per GPU, 25 need 3 GPUs
    req = request(profile, [1.0] * 25)
    filled = plan_greedy(req, balance=False)
    assert [len(g) for g in filled] == [11, 11, 3]
    balanced = plan_greedy(req)
    assert len(balanced) == 3 and max(len(g) for g in balanced) <= 9
    assert sorted(i for g in balanced for i in g.shares) == list(range(25))
    assert all(g.a_max == len(g) for g in balanced)  # every adapter resident: the best A_max here


def test_greedy_never_uses_more_gpus_than_paper_greedy(profile):
    rng = np.random.default_rng(1)
    for _ in range(5):
        rates = rng.choice([2.4, 1.2, 0.6, 0.3, 0.15], size=60)
        req = request(profile, list(rates))
        ours, theirs = plan_greedy(req), plan_paper_greedy(request(profile, list(rates)))
        assert len(ours) <= len(theirs)
        assert all(x <= 1000 / 0.9 + 1e-6 for x in loads(req, ours))


def test_paper_greedy_tests_at_fixed_points_and_closes_a_failed_gpu(profile):
    # 16 adapters of 100 tok/s fail (1600 > 1111): each GPU closes at the 8-adapter testing point
    groups = plan_paper_greedy(request(profile, [1.0] * 25))
    assert [len(g) for g in groups] == [8, 8, 8, 1]
    assert [g.a_max for g in groups] == [8, 8, 8, 8]  # A_max grows one grid step per test


def test_hot_adapter_is_split_over_replicas_with_weights(profile):
    req = request(profile, [25.0, 1.0, 1.0])  # 2500 tok/s: more than one GPU keeps up with
    groups = plan_greedy(req)
    shares = [g.shares.get(0, 0.0) for g in groups]
    assert sum(shares) == pytest.approx(1.0)
    assert sum(s > 0 for s in shares) == 3
    assert all(x <= 1000 / 0.9 + 1e-6 for x in loads(req, groups))


def test_hot_adapter_without_split_is_infeasible_and_named(profile):
    with pytest.raises(InfeasibleError, match="ad-0 is too hot"):
        plan_greedy(request(profile, [25.0, 1.0]), split_hot=False)


def test_not_enough_gpus_names_the_leftovers(profile):
    with pytest.raises(InfeasibleError, match="not enough GPUs: 2 GPUs are full and 3 adapters"):
        plan_greedy(request(profile, [1.0] * 25, gpus=2), balance=False)


def test_rank_that_no_engine_starts_is_a_memory_error(make_profile):
    prof = make_profile(**{"kv_capacity.tokens": {"8": [4800], "16": [None]}})
    with pytest.raises(InfeasibleError, match="memory error.*max-lora-rank 16"):
        plan_greedy(request(prof, [1.0, 1.0], [8, 16]))


def test_maxbase_is_next_fit_to_backbone_throughput(profile):
    cap = profile.backbone_max_throughput_tok_s
    per = cap / 4.5  # 4 adapters fit, the 5th opens the next GPU
    rates = [per / 100.0] * 9
    groups = plan_maxbase(request(profile, rates))
    assert [len(g) for g in groups] == [4, 4, 1]
    assert [g.a_max for g in groups] == [4, 4, 1]
    assert [g.a_max for g in plan_maxbase(request(profile, rates), half=True)] == [2, 2, 1]


def test_random_is_seeded_and_spreads_over_all_gpus(profile):
    a = plan_random(request(profile, [0.1] * 40, gpus=4, seed=7))
    b = plan_random(request(profile, [0.1] * 40, gpus=4, seed=7))
    assert [g.shares for g in a] == [g.shares for g in b] and len(a) == 4
    assert all(1 <= g.a_max <= len(g) for g in a)


def test_latency_balances_request_rate_and_checks_the_model(profile):
    groups = plan_latency(request(profile, [1.0, 1.0, 1.0, 1.0, 0.5, 0.5], gpus=2))
    assert sorted(len(g) for g in groups) == [3, 3]
    with pytest.raises(InfeasibleError, match="latency"):
        plan_latency(request(profile, [5.0] * 10, gpus=2))


def test_dlora_places_every_adapter_and_pads_replicas(profile):
    req = request(profile, [0.5, 0.1, 0.1, 0.05, 0.05, 0.01], gpus=3)
    groups = plan_dlora(req)
    total = {i: 0.0 for i in range(6)}
    for g in groups:
        for i, s in g.shares.items():
            total[i] += s
    assert all(v == pytest.approx(1.0) for v in total.values())
    assert sum(len(g) for g in groups) >= 3 + 6 - 1
    assert all(g.a_max == len(g) for g in groups)
    assert dlora_lora_size_tokens(req) == pytest.approx(
        max((profile.kv.no_lora_tokens - t) / a
            for a, t in zip(profile.kv.a_max_points, profile.kv.tokens[8]) if t is not None))
