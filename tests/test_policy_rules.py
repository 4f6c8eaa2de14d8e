"""Serving-policy decision rules on small hand-checked cases (twin.policies.rules)."""

from __future__ import annotations

import numpy as np
import pytest

from twin.errors import WorkloadError
from twin.policies import parse_overrides, policy_from_name
from twin.policies.rules import (
    CACHE_CHAMELEON,
    CACHE_ELORA,
    CACHE_LRU,
    eviction_scores,
    kmeans_boundaries,
    low_lora,
    mlq_quotas,
    queue_of,
)


def _scores(mode, last_used, freq, size, load_ms, **params):
    spec = policy_from_name("chameleon", freq_window_s=1e12, **params)
    n = len(freq)
    return eviction_scores(mode, 100.0, np.ones(n, np.bool_), np.array(freq, float), np.zeros(n),
                           np.array(last_used, float), np.array(size, float), np.array(load_ms, float),
                           spec.float_params())


def test_chameleon_score_evicts_small_rare_adapter_before_the_lru_one():
    # a: used most, oldest; b: rare, large, recent; c: rare, small, fairly recent.
    s = _scores(CACHE_CHAMELEON, last_used=[50, 95, 90], freq=[4, 1, 1], size=[100, 400, 100], load_ms=[1, 1, 1])
    # by hand: ages 50/5/10 (max 50); F .45, R .10, S .45 over max-normalised terms
    assert s == pytest.approx([0.45 + 0.0 + 0.1125, 0.1125 + 0.09 + 0.45, 0.1125 + 0.08 + 0.1125])
    assert list(np.argsort(s)) == [2, 0, 1]
    lru = _scores(CACHE_LRU, last_used=[50, 95, 90], freq=[4, 1, 1], size=[100, 400, 100], load_ms=[1, 1, 1])
    assert int(np.argmin(lru)) == 0  # LRU would evict the popular adapter


def test_chameleon_weights_are_parameters():
    s = _scores(CACHE_CHAMELEON, last_used=[50, 95, 90], freq=[4, 1, 1], size=[100, 400, 100], load_ms=[1, 1, 1],
                score_f=0.0, score_r=1.0, score_s=0.0)
    assert int(np.argmin(s)) == 0  # recency only: the oldest goes


def test_elora_retention_value_is_cost_times_visit_times_recency_decay():
    s = _scores(CACHE_ELORA, last_used=[99.9, 99.9, 95.0], freq=[1, 1, 1], size=[1, 1, 1], load_ms=[10, 1, 10],
                recency_tau_s=1.0)

    def decay(t):
        return 1 - 1 / (1 + np.exp(-t))
    assert s == pytest.approx([10 / 3 * decay(0.1), 1 / 3 * decay(0.1), 10 / 3 * decay(5.0)])
    assert list(np.argsort(s)) == [2, 1, 0]  # stale first, then the cheap-to-reload one


def test_low_lora_is_expected_distinct_adapters_per_batch():
    assert low_lora(np.array([1.0, 1.0]), np.zeros(2), 0.0, 5.0, 2.0) == pytest.approx(2 * (1 - 0.5**2))
    assert low_lora(np.array([3.0, 1.0]), np.zeros(2), 0.0, 5.0, 1.0) == pytest.approx(1.0)
    assert low_lora(np.zeros(3), np.zeros(3), 0.0, 5.0, 8.0) == 0.0


def test_kmeans_cut_offs_are_midpoints_between_centroids():
    assert kmeans_boundaries(np.array([1.0, 1, 1, 10, 10, 10]), 2) == pytest.approx([5.5])
    v = np.repeat([1.0, 2.0, 10.0, 20.0], 3)
    assert kmeans_boundaries(v, 4) == pytest.approx([1.5, 6.0, 15.0])
    b = np.array([1.5, 6.0, 15.0])
    assert [queue_of(x, b) for x in (0.0, 1.5, 5.9, 6.0, 30.0)] == [0, 1, 1, 2, 3]


def test_quotas_follow_the_mm1_minimum_and_share_the_rest_by_rate():
    s, d, lam = np.array([100.0, 200.0]), np.array([1.0, 2.0]), np.array([1.0, 1.0])
    # Tok_min = S * D * (1/SLO + lambda) = 200 and 800; 1000 left, split by rate share
    assert mlq_quotas(s, d, lam, 1.0, 2000.0) == pytest.approx([700.0, 1300.0])
    assert mlq_quotas(s, d, lam, 1.0, 500.0) == pytest.approx([100.0, 400.0])  # scaled to fit


def test_policy_names_and_parameters_are_checked():
    assert policy_from_name("vllm") is None
    assert policy_from_name("chameleon").scheduler == "mlq"
    assert policy_from_name("toppings").cold_start == "cpu"
    assert policy_from_name("elora", swap_period_s=0.5).swap_period_s == 0.5
    assert parse_overrides(["queues=2", "prefetch=false", "cache=lru", "slo_s=2.5"]) == {
        "queues": 2, "prefetch": False, "cache": "lru", "slo_s": 2.5}
    for bad in (lambda: policy_from_name("nope"), lambda: policy_from_name("vllm", queues=2),
                lambda: policy_from_name("elora", cache="fifo"), lambda: parse_overrides(["queues=x"]),
                lambda: parse_overrides(["bogus=1"])):
        with pytest.raises(WorkloadError):
            bad()
