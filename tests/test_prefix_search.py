"""greedy's compiled prefix search (compiled-tree predictors) gives the plans that asking best_a_max gives."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from models.predictor import load_predictor
from planner.greedy import plan_greedy
from planner.packing import PackRequest
from planner.prefix_search import PrefixSearch
from planner.verdict import ServiceBar
from tests.planner_helpers import workload
from twin import InfeasibleError, load_profile
from twin.policies import policy_from_name
from twin.policies.memory import UnifiedPool, kv_capacity

PAPER_RATES = (3.2, 1.6, 0.8, 0.4, 0.2, 0.1, 0.05, 0.025, 0.0125, 0.003125)


@pytest.fixture(scope="module")
def llama():
    return load_profile("h100-64gb-llama-3.1-8b")


def random_workload(n, seed, hot=()):
    rng = np.random.default_rng(seed)
    rates = [*hot, *rng.choice(PAPER_RATES, n).tolist()]
    ranks = rng.choice([8, 16, 32], len(rates)).tolist()
    return workload(rates, ranks, tokens=(222.9, 196.4))


def plan(req, monkeypatch, compiled, **kw):
    """Groups as (shares, A_max), or the infeasibility message; and how often the predictor was asked."""
    monkeypatch.setattr(PrefixSearch, "compiled", lambda self: compiled)
    calls = []
    predict = req.predictor.predict
    monkeypatch.setattr(req.predictor, "predict", lambda scenarios: calls.append(len(scenarios)) or predict(scenarios))
    try:
        out = [(sorted(g.shares.items()), g.a_max) for g in plan_greedy(req, **kw)]
    except InfeasibleError as exc:
        out = str(exc)
    monkeypatch.undo()
    return out, len(calls)


@pytest.mark.parametrize("kind", ["small-tree", "surrogate"])
@pytest.mark.parametrize(("n", "gpus", "seed", "hot"), [
    (40, 1000, 0, ()), (300, 1000, 1, ()), (300, 4, 2, ()), (120, 1000, 3, (200.0, 120.0)), (2000, 1000, 4, ()),
])
def test_compiled_search_plans_as_best_a_max(llama, monkeypatch, kind, n, gpus, seed, hot):
    req = PackRequest.build(random_workload(n, seed, hot), llama, load_predictor(llama, kind), gpus)
    fast, fast_calls = plan(req, monkeypatch, True)
    slow, slow_calls = plan(req, monkeypatch, False)
    assert fast == slow
    assert slow_calls > 0 and (fast_calls == 0 or hot)  # only splitting a hot adapter asks predict()
    if hot:  # replicas of the hot adapters were placed, with shares below 1
        assert any(s < 1 for g, _ in fast for _, s in g)


@pytest.mark.parametrize("kind", ["small-tree", "surrogate"])
def test_compiled_search_with_margin_slo_and_partial_shares(llama, monkeypatch, kind):
    """The served-share bar, the latency forest (the full surrogate's) and some adapters' own TTFT limits."""
    req = PackRequest.build(random_workload(400, 5), llama, load_predictor(llama, kind), 1000)
    own = np.full(400, np.nan)
    own[::7] = 0.4
    req = replace(req, margin=0.3, bar=ServiceBar(), adapter_ttft_s=own)
    entries = [(i, 0.5 if i % 3 == 0 else 1.0) for i in range(0, 400, 2)]
    fast, _ = plan(req, monkeypatch, True, entries=entries)
    slow, _ = plan(req, monkeypatch, False, entries=entries)
    assert fast == slow and not isinstance(fast, str)


def test_compiled_search_aims_at_the_size_scaled_judging_load(llama, monkeypatch):
    """Mixed request lengths: a window is asked about the load its judging run will simulate (the margin times
    the variation of its request sizes, PackRequest.aim_scale), in both searches; the aim changes the plan."""
    from twin.families import family_workload

    req = replace(PackRequest.build(family_workload("mixed-lengths", 300, 7), llama, load_predictor(llama, "surrogate"),
                                    1000), margin=0.3, bar=ServiceBar())
    aimed = replace(req, size_margin=0.05)
    mixed = {i: 1.0 for i in range(20)}
    assert aimed.aim_scale(mixed) > 1.3 + 1e-6 and req.aim_scale(mixed) == 1.3
    fast, _ = plan(aimed, monkeypatch, True)
    slow, _ = plan(aimed, monkeypatch, False)
    assert fast == slow and not isinstance(fast, str)
    assert fast != plan(req, monkeypatch, True)[0]


@pytest.mark.parametrize("pid", ["h100-64gb-llama-3.1-8b", "h100-64gb-qwen2.5-7b"])
def test_compiled_search_holds_a_tight_tpot_limit_alike(pid, monkeypatch):
    """A TPOT limit tighter than the default (the bar's, and some adapters' own) is held by the TPOT forest,
    scaled by the slowdown, in both searches alike; it changes the plan, and the default limit does not."""
    profile = load_profile(pid)
    base = replace(PackRequest.build(random_workload(300, 8), profile, load_predictor(profile, "surrogate"), 1000),
                   margin=0.3, tpot_aim=1.3)
    assert base.predictor.tpot_forest is not None
    own = np.full(300, np.nan)
    own[::5] = 40.0
    tight = replace(base, bar=ServiceBar(max_tpot_ms=60.0, slowdown=1.3), adapter_tpot_ms=own)
    fast, _ = plan(tight, monkeypatch, True)
    slow, _ = plan(tight, monkeypatch, False)
    assert fast == slow and not isinstance(fast, str)
    default = replace(base, bar=ServiceBar(slowdown=1.3))
    assert fast != plan(default, monkeypatch, True)[0]
    untimed = load_predictor(profile, "surrogate")
    untimed.tpot_forest = None
    assert plan(default, monkeypatch, True)[0] == plan(replace(default, predictor=untimed), monkeypatch, True)[0]


def test_compiled_search_under_a_unified_pool(llama, monkeypatch):
    """Another serving policy's memory rule (every A_max starts with the whole pool)."""
    chameleon = policy_from_name("chameleon")
    pred = load_predictor(llama, "small-tree")
    pred.policy, pred._capacity = chameleon, kv_capacity(llama, chameleon)  # stock forests, pool memory rule
    req = PackRequest.build(random_workload(300, 6), llama, pred, 1000)
    assert isinstance(req.kv, UnifiedPool)
    fast, fast_calls = plan(req, monkeypatch, True)
    slow, _ = plan(req, monkeypatch, False)
    assert fast == slow and fast_calls == 0


@pytest.mark.parametrize("pid", ["h100-64gb-llama-3.1-8b", "h100-64gb-qwen2.5-7b", "cpu-2core-tiny-llama"])
def test_tokens_array_is_tokens_for(pid):
    kv = load_profile(pid).kv
    for capacity in (kv, UnifiedPool(kv)):
        for rank in kv.lora_ranks:
            want = [-1 if (t := capacity.tokens_for(a, rank)) is None else t for a in range(701)]
            assert capacity.tokens_array(rank, 700).tolist() == want


@pytest.mark.parametrize("k_max", [1, 2, 37, 100, 1000])
def test_the_search_from_a_guess_ends_where_the_search_from_one_adapter_does(k_max):
    """Where the verdict is monotone in k, every guess ends on the largest passing k, as doubling from 1 does;
    a guess near it asks far fewer questions (the twin's questions cost up to a second each)."""
    from planner.prefix_search import largest_passing

    def search(threshold: int, guess: int | None) -> tuple[int, list[int]]:
        asked: list[int] = []

        def ok(k: int) -> bool:
            assert 1 <= k <= k_max, k
            asked.append(k)
            return k <= threshold

        return largest_passing(ok, k_max, guess), asked

    for threshold in sorted({0, 1, 2, 3, k_max // 3, k_max - 1, k_max, k_max + 5}):
        found, plain = search(threshold, None)
        assert found == min(threshold, k_max)
        for guess in sorted({1, 2, k_max // 2, max(1, threshold), min(max(1, threshold + 3), k_max), k_max}):
            found, asked = search(threshold, guess)
            assert found == min(threshold, k_max), (threshold, guess)
            if guess == threshold and k_max >= 100 and 10 < threshold < k_max:
                assert len(asked) <= 8 and len(asked) < len(plain) / 2, (asked, plain)


def test_a_twin_packed_fill_starts_from_the_bounds_of_the_fill_before(monkeypatch):
    """The balancing fills of a plan the twin packs start each GPU's search where that GPU ended in the fill
    before: the same plan here (its verdicts are monotone), from fewer questions to the twin."""
    from models.twin_predictor import TwinPredictor

    cpu = load_profile("cpu-2core-tiny-llama")
    rng = np.random.default_rng(3)
    wl = workload((rng.choice([0.5, 1.0, 2.0], 60)).tolist(), rng.choice([8, 16], 60).tolist(),
                  tokens=(64.0, 32.0))
    req = PackRequest.build(wl, cpu, TwinPredictor(cpu, duration_s=120.0, jobs=1), 1000)
    guessed, guessed_calls = plan(req, monkeypatch, False)
    largest = PrefixSearch.largest
    monkeypatch.setattr(PrefixSearch, "largest", lambda self, pos, k_max, guess=None: largest(self, pos, k_max))
    plain, plain_calls = plan(req, monkeypatch, False)
    assert len(guessed) >= 3 and guessed == plain
    assert guessed_calls < 0.75 * plain_calls
