"""Twin confirmation of surrogate plans (planner.confirm): GPUs that fall short are retuned or packed again.

The predictor here is the shipped Llama surrogate told 60 % less traffic than arrives: a real model
made optimistic on purpose, so its plans starve in the twin whatever the surrogate's own accuracy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import numpy as np
import pytest
from click.testing import CliRunner

from models.predictor import GpuScenario, TwinPredictor, load_predictor
from planner.cli import main
from planner.confirm import CONFIRM_RATIO, EXTRA_SEEDS, ServiceBar, retune, twin_check
from planner.evaluate import evaluate_placement
from planner.packing import GpuGroup, PackRequest, a_max_candidates
from planner.plan import PlanOptions, make_plan
from tests.planner_helpers import workload
from twin import BadInputError, InfeasibleError, SimConfig, load_profile

PROFILE = "h100-64gb-llama-3.1-8b"


@dataclass
class Optimistic:
    base: object
    factor: float = 0.4
    kind: str = "optimistic-surrogate"

    @property
    def profile_id(self):
        return self.base.profile_id

    @property
    def policy(self):
        return self.base.policy

    def predict(self, scenarios):
        return self.base.predict([replace(s, rates_rps=s.rates_rps * self.factor) for s in scenarios])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    profile = load_profile(PROFILE)
    wl = workload([1.6, 0.4, 1.0, 0.2] * 16, [8, 16, 32, 8] * 16, tokens=(300.0, 200.0))
    path = tmp_path_factory.mktemp("wl") / "wl.csv"  # the plan records it; the adapters come from ``wl``
    path.write_text("adapter_id,rank,rate_rps,input_tokens,output_tokens\n" + "".join(
        f"{a.adapter_id},{a.rank},{a.rate_rps},300,200\n" for a in wl.adapters))
    return profile, wl, path, Optimistic(load_predictor(profile, "surrogate"))


def _evaluate(placement, wl, profile):
    return evaluate_placement(placement, wl, profile, SimConfig(a_max=1))  # `planner evaluate`'s defaults


def test_unconfirmed_optimistic_plan_starves_in_the_twin(setup):
    profile, wl, path, pred = setup
    placement = make_plan(path, wl, profile, pred, PlanOptions(confirm=False))
    assert "confirmation" not in placement.inputs
    assert not _evaluate(placement, wl, profile).ok


def test_confirmed_plan_repacks_the_short_gpus_until_the_twin_agrees(setup):
    profile, wl, path, pred = setup
    loose = make_plan(path, wl, profile, pred, PlanOptions(confirm=False))
    messages = []
    placement = make_plan(path, wl, profile, pred, PlanOptions(jobs=2), progress=messages.append)
    conf = placement.inputs["confirmation"]
    assert conf["rounds"] >= 2 and conf["repacked_gpus"] >= 1 and conf["margin"] > 0
    assert conf["worst_ratio"] >= CONFIRM_RATIO
    assert messages and "fall short" in messages[0]
    assert len(placement.instances) > len(loose.instances)
    ev = _evaluate(placement, wl, profile)
    assert ev.ok, [i.to_dict() for i in ev.instances if i.starved]
    placed = {aid for inst in placement.instances for aid in inst.adapters}
    assert placed == {a.adapter_id for a in wl.adapters}


def test_repacking_past_the_gpu_limit_is_infeasible_and_says_why(setup):
    profile, wl, path, pred = setup
    loose = make_plan(path, wl, profile, pred, PlanOptions(confirm=False))
    with pytest.raises(InfeasibleError, match="packed again"):
        make_plan(path, wl, profile, pred, PlanOptions(gpus=len(loose.instances)))


def test_twin_and_other_algorithms_are_not_confirmed(setup):
    profile, wl, path, pred = setup
    placement = make_plan(path, wl, profile, pred, PlanOptions(algorithm="paper-greedy"))
    assert "confirmation" not in placement.inputs


def test_parallel_twin_predictions_equal_serial(setup):
    profile = setup[0]
    scen = [GpuScenario(np.array([8, 16]), np.array([r, r / 2]), np.array([300.0] * 2), np.array([200.0] * 2), 2)
            for r in (1.0, 5.0, 40.0)]
    serial = TwinPredictor(profile, duration_s=300.0).predict(scen)
    parallel = TwinPredictor(profile, duration_s=300.0, jobs=2).predict(scen)
    assert np.array_equal(serial.throughput_tok_s, parallel.throughput_tok_s)
    assert np.array_equal(serial.starved, parallel.starved) and serial.starved.any() and not serial.starved.all()


MIXED = "datasets/workloads/mixed-ranks-128-adapters.csv"


def test_cli_plan_reports_the_confirmation_and_can_skip_it():
    res = CliRunner().invoke(main, ["plan", MIXED, "--json", "--jobs", "1"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["inputs"]["confirmation"]["worst_ratio"] >= CONFIRM_RATIO
    res = CliRunner().invoke(main, ["plan", MIXED, "--no-confirm"])
    assert res.exit_code == 0 and "confirmed in the twin" not in res.output


def test_ttft_limit_is_met_in_the_twin_or_the_plan_is_refused(tmp_path):
    r = CliRunner()
    low = "datasets/workloads/low-rate-384-adapters.csv"
    loose = json.loads(r.invoke(main, ["plan", low, "--json"]).stdout)
    assert loose["inputs"]["confirmation"]["worst_ttft_ms_p99"] > 10_000  # keeps up by the 90 % rule, with a queue
    res = r.invoke(main, ["plan", MIXED, "--max-ttft", "0.02"])  # below what one light GPU's steps take
    assert res.exit_code == 3 and "allow a longer TTFT" in res.output
    for path in (low, MIXED):  # low: the surrogate's A_max leaves minutes of queue; a GPU is retuned
        out = tmp_path / "plan.json"
        res = r.invoke(main, ["plan", path, "--max-ttft", "2", "--out", str(out)])
        assert res.exit_code == 0, res.output
        conf = json.loads(out.read_text())["inputs"]["confirmation"]
        assert conf["max_ttft_s"] == 2 and (conf["retuned_gpus"] >= 1 or path != low)
        res = r.invoke(main, ["evaluate", str(out), path, "--json"])
        assert res.exit_code == 0, res.output
        assert all(i["ttft_ms_p99"] <= 2000 and not i["starved"] for i in json.loads(res.stdout)["instances"])


def test_ttft_limit_and_min_served_need_the_greedy_confirmation():
    for extra in (["--algorithm", "paper-greedy"], ["--no-confirm"]):
        for bar in (["--max-ttft", "2"], ["--min-served", "0.92"]):
            res = CliRunner().invoke(main, ["plan", MIXED, *bar, *extra])
            assert res.exit_code == 2 and bar[0] in res.output, res.output
    res = CliRunner().invoke(main, ["plan", MIXED, "--min-served", "0.85"])  # below 0.9 a GPU starves
    assert res.exit_code == 2 and "0.9<=x<1.0" in res.output
    with pytest.raises(BadInputError, match="starves"):
        ServiceBar(0.89)


def test_below_the_default_bar_a_gpu_must_hold_with_every_seed():
    """41 busy rank-8 adapters on --max-loras 32 keep swapping adapters; one arrival seed serves ~94 % of
    their load, but others tip them into a collapse (high/low/128 of the paper's workloads: 0.946 with
    seed 0, 0.84 with seed 1). One seed would confirm them at --min-served 0.9; the extra seeds do not.
    With --max-loras 41 nothing swaps and they hold with every seed."""
    profile = load_profile(PROFILE)
    wl = workload([0.6, 1.2] * 14 + [0.6] * 13, [8] * 41, tokens=(221.67, 196.52))  # the plan's order
    req = PackRequest.build(wl, profile, load_predictor(profile, "surrogate"), max_gpus=1)
    everyone = {i: 1.0 for i in range(41)}
    swapping, resident = GpuGroup(everyone, a_max=32), GpuGroup(everyone, a_max=41)
    first = twin_check(req, [swapping, resident])  # the default bar runs one seed
    assert (0.9 <= first.ratio).all() and first.ratio[0] < CONFIRM_RATIO, first.ratio
    assert first.ratio[1] < CONFIRM_RATIO  # so the resident group is simulated again too, and holds
    bar = ServiceBar(0.9)
    assert bar.seeds == (0, *EXTRA_SEEDS) and ServiceBar(0.95).seeds == ServiceBar().seeds == (0,)
    every = twin_check(req, [swapping, resident], bar=bar)
    assert every.meets(bar).tolist() == [False, True], every.ratio
    assert every.ratio[0] < 0.9


def test_cli_plan_at_the_paper_bar_is_denser_holds_and_replans_at_it(tmp_path):
    """The 128-adapter example at --min-served 0.9: 1 GPU serving ~94 % (2 at the default bar) that keeps
    up with another arrival seed; the nightly replan without the flag keeps its bar and its GPU."""
    r, plan = CliRunner(), tmp_path / "plan.json"
    default = json.loads(r.invoke(main, ["plan", MIXED, "--json"]).stdout)
    res = r.invoke(main, ["plan", MIXED, "--min-served", "0.9", "--out", str(plan)])
    assert res.exit_code == 0 and "with 5 arrival seeds" in res.output, res.output
    dense = json.loads(plan.read_text())
    conf = dense["inputs"]["confirmation"]
    assert conf["min_ratio"] == 0.9 and conf["seeds_below_default_ratio"] == list(EXTRA_SEEDS)
    assert 0.9 <= conf["worst_ratio"] < CONFIRM_RATIO
    assert len(dense["instances"]) < len(default["instances"])
    res = r.invoke(main, ["evaluate", str(plan), MIXED, "--seed", "1", "--json"])
    assert res.exit_code == 0 and not any(i["starved"] for i in json.loads(res.stdout)["instances"]), res.output
    res = r.invoke(main, ["replan", MIXED, "--previous", str(plan), "--out", str(plan)])
    assert res.exit_code == 0, res.output
    again = json.loads(plan.read_text())
    assert again["inputs"]["confirmation"]["min_ratio"] == 0.9 and len(again["instances"]) == len(dense["instances"])


def test_replan_is_confirmed_and_meets_a_ttft_limit(tmp_path):
    r = CliRunner()
    plan = tmp_path / "plan.json"
    assert r.invoke(main, ["plan", MIXED, "--no-confirm", "--out", str(plan)]).exit_code == 0  # 1 GPU, long queue
    res = r.invoke(main, ["replan", MIXED, "--previous", str(plan), "--out", str(plan), "--max-ttft", "2"])
    assert res.exit_code == 0, res.output
    new = json.loads(plan.read_text())
    assert new["inputs"]["confirmation"]["max_ttft_s"] == 2 and new["changes"]["new_instances"]
    res = r.invoke(main, ["evaluate", str(plan), MIXED, "--json"])
    assert all(i["ttft_ms_p99"] <= 2000 and not i["starved"] for i in json.loads(res.stdout)["instances"])


def test_retune_keeps_a_short_group_with_the_a_max_the_twin_confirms(setup):
    """48 adapters on --max-loras 2 swap adapters all the time and fall short (the twin serves ~89 %); at
    larger A_max the same adapters keep up, and retune picks the candidate serving them best. A group
    that no A_max saves (one adapter far beyond a GPU) gets None."""
    profile, wl, _, _ = setup
    req = PackRequest.build(wl, profile, load_predictor(profile, "surrogate"), max_gpus=4)
    short = GpuGroup({i: 0.5 for i in range(48)}, a_max=2)
    hot = GpuGroup({0: 40.0}, a_max=1)
    assert not twin_check(req, [short, hot]).keeps_up(ServiceBar()).any()
    fixed, none = retune(req, [short, hot])
    assert none is None and fixed is not None
    group, ratio, _ = fixed
    assert group.shares == short.shares and ratio >= CONFIRM_RATIO
    cands = a_max_candidates(req.kv, req.ranks[short.members], len(short))
    ratios = twin_check(req, [GpuGroup(short.shares, a) for a in cands]).ratio
    assert ratio == ratios.max() and group.a_max == cands[int(np.argmax(ratios))]
