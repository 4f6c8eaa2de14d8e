"""The twin's answers kept in the planner's process: a scenario asked again in the same run is answered
without simulating it, with what simulating it gives; any change to the scenario or to what the run
simulates with is simulated."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from models import twin_predictor
from models.scenario import GpuScenario
from models.twin_memo import MEMO, TwinMemo
from models.twin_predictor import FewAdapters, TwinPredictor
from twin import load_profile
from twin.workload import PoissonArrivals

LLAMA = "h100-64gb-llama-3.1-8b"


def _scenario(adapters: int, rate: float, a_max: int | None = None) -> GpuScenario:
    return GpuScenario(np.full(adapters, 16), np.full(adapters, rate), np.full(adapters, 300.0),
                       np.full(adapters, 200.0), a_max or adapters)


def _counting(monkeypatch) -> list:
    simulated: list = []
    simulate_on = twin_predictor._simulate_on

    def counted(*args):
        simulated.append(args[-1][0])
        return simulate_on(*args)

    monkeypatch.setattr(twin_predictor, "_simulate_on", counted)
    return simulated


def test_a_scenario_asked_again_is_answered_as_simulated_without_simulating(monkeypatch):
    simulated = _counting(monkeypatch)
    twin = TwinPredictor(load_profile(LLAMA), duration_s=300.0, slowdown=1.3)
    first = twin.predict([_scenario(4, 1.0), _scenario(8, 2.0)])
    assert len(simulated) == 2 and len(MEMO) == 2
    progress: list = []
    again = replace(twin, progress=lambda done, n: progress.append((done, n))).predict(
        [_scenario(8, 2.0), _scenario(4, 1.0), _scenario(6, 1.0)])  # another instance
    assert len(simulated) == 3  # only the new scenario
    assert progress == [(2, 3), (3, 3)]  # the kept answers count as done
    for field in ("throughput_tok_s", "arriving_tok_s", "ttft_ms_p99_all", "tpot_ms_p99", "ttft_ms_p999_all"):
        assert getattr(again, field)[0] == getattr(first, field)[1]
        assert getattr(again, field)[1] == getattr(first, field)[0]
    MEMO.clear()
    fresh = twin.predict([_scenario(8, 2.0)])
    assert fresh.tpot_ms_p99[0] == first.tpot_ms_p99[1]


def test_what_the_run_simulates_with_is_part_of_the_question(monkeypatch):
    simulated = _counting(monkeypatch)
    profile = load_profile(LLAMA)
    sc = _scenario(4, 1.0)
    base = TwinPredictor(profile, duration_s=300.0, slowdown=1.3)
    base.predict([sc])
    others = [replace(base, slowdown=1.4), replace(base, seed=1), replace(base, duration_s=600.0),
              replace(base, min_requests=5_000.0), replace(base, few=FewAdapters(4, 1.05)),
              replace(base, profile=replace(profile, default_output_tokens=profile.default_output_tokens + 1))]
    for k, twin in enumerate(others, start=2):
        twin.predict([sc])
        assert len(simulated) == k
    for k, changed in enumerate([_scenario(4, 1.0, a_max=8), _scenario(4, 1.01), replace(sc, ranks=np.full(4, 8))],
                                start=len(simulated) + 1):
        base.predict([changed])
        assert len(simulated) == k


def test_the_oldest_answers_are_dropped_past_the_limit():
    memo = TwinMemo(limit=2)
    rows = {k: tuple(float(k + i) for i in range(6)) for k in range(3)}
    for k, row in rows.items():
        memo.put(bytes([k]), row)
    assert len(memo) == 2 and memo.get(bytes([0])) is None
    assert memo.get(bytes([1])) == rows[1] and memo.get(bytes([2])) == rows[2]


class _PlainArrivals:
    """Poisson arrivals from a class that is not a dataclass (its ``repr`` is its address)."""

    def adapter_times(self, rate: float, duration: float, rng: np.random.Generator) -> np.ndarray:
        return PoissonArrivals().adapter_times(rate, duration, rng)


def test_a_run_that_cannot_be_keyed_by_value_is_simulated_every_time(monkeypatch):
    simulated = _counting(monkeypatch)
    twin = TwinPredictor(load_profile(LLAMA), duration_s=300.0, arrivals=_PlainArrivals())
    first, again = twin.predict([_scenario(4, 1.0)]), twin.predict([_scenario(4, 1.0)])
    assert len(simulated) == 2 and len(MEMO) == 0
    assert first.tpot_ms_p99[0] == again.tpot_ms_p99[0]


def test_runs_of_one_group_at_several_max_loras_share_one_draw_and_answer_as_alone(monkeypatch):
    twin_predictor._LAST_DRAWN.clear()
    drawn: list = []
    draw = twin_predictor.config_requests
    monkeypatch.setattr(twin_predictor, "config_requests", lambda *a: drawn.append(a[2].seed) or draw(*a))
    twin = TwinPredictor(load_profile(LLAMA), duration_s=300.0, slowdown=1.3)
    candidates = [_scenario(12, 0.5, a) for a in (4, 8, 12)]
    together = twin.predict(candidates)
    assert drawn == [0]  # one draw for the three --max-loras
    for i, sc in enumerate(candidates):  # each as if asked alone, drawn afresh
        MEMO.clear()
        twin_predictor._LAST_DRAWN.clear()
        alone = twin.predict([sc])
        for field in ("throughput_tok_s", "ttft_ms_p99_all", "tpot_ms_p99", "itl_ms_mean", "ttft_ms_p999_all"):
            assert getattr(alone, field)[0] == getattr(together, field)[i]
    assert len(drawn) == 4
    replace(twin, seed=1).predict(candidates[:1])  # other requests: drawn
    twin.predict([_scenario(12, 0.6, 4)])
    assert drawn[4:] == [1, 0]
