"""The safety margin by the adapters a GPU serves: under the SLO a GPU of few adapters is judged on the profile's
served-share margin, with the twin's error measured there, and every other GPU on its SLO margin."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner

from models.predictor import load_predictor
from models.scenario import GpuScenario
from models.twin_memo import MEMO
from models.twin_predictor import FewAdapters, TwinPredictor
from planner.cli import main
from planner.packing import PackRequest
from planner.plan import PlanOptions
from planner.verdict import FEW_ADAPTERS, ServiceBar
from tests.test_prefix_search import plan, random_workload
from twin import load_profile

LLAMA = "h100-64gb-llama-3.1-8b"


def _scenario(adapters: int, rate: float) -> GpuScenario:
    return GpuScenario(np.full(adapters, 16), np.full(adapters, rate), np.full(adapters, 300.0),
                       np.full(adapters, 200.0), adapters)


def test_a_gpu_of_few_adapters_runs_on_the_smaller_margin_with_the_twins_error_added():
    """Per scenario: at most ``few.adapters`` adapters on the GPU ``few.slowdown`` times slower, its p99 TTFT
    (and p99.9) plus the allowance per adapter and its p99 TPOT times the factor; more adapters on ``slowdown``
    as they are; in worker processes alike."""
    profile = load_profile(LLAMA)
    few = FewAdapters(4, 1.05, 1.5, 10.0)
    small, large = _scenario(4, 1.5), _scenario(6, 1.0)
    ruled = TwinPredictor(profile, duration_s=300.0, slowdown=1.4, few=few).predict([small, large])
    on_few = TwinPredictor(profile, duration_s=300.0, slowdown=1.05).predict([small])
    flat = TwinPredictor(profile, duration_s=300.0, slowdown=1.4).predict([small, large])
    assert ruled.ttft_ms_p99_all[0] == pytest.approx(on_few.ttft_ms_p99_all[0] + 40.0)
    assert ruled.ttft_ms_p999_all[0] == pytest.approx(on_few.ttft_ms_p999_all[0] + 40.0)
    assert ruled.tpot_ms_p99[0] == pytest.approx(on_few.tpot_ms_p99[0] * 1.5)
    assert ruled.throughput_tok_s[0] == on_few.throughput_tok_s[0]
    for field in ("throughput_tok_s", "ttft_ms_p99_all", "tpot_ms_p99"):
        assert getattr(ruled, field)[1] == getattr(flat, field)[1]
    assert on_few.tpot_ms_p99[0] < flat.tpot_ms_p99[0]  # the smaller margin is what the rule is for
    MEMO.clear()  # simulated again, in the workers
    parallel = TwinPredictor(profile, duration_s=300.0, slowdown=1.4, few=few, jobs=2).predict([small, large])
    assert np.array_equal(parallel.ttft_ms_p99_all, ruled.ttft_ms_p99_all)
    assert np.array_equal(parallel.tpot_ms_p99, ruled.tpot_ms_p99)


def test_the_rule_applies_under_the_slo_where_the_profile_has_a_larger_slo_margin_and_no_slowdown_is_given():
    llama, gpu80 = load_profile(LLAMA), load_profile("h100-80gb-llama-3.1-8b")
    bar = PlanOptions().bar(llama)
    assert bar.slowdown == llama.planning_slowdown("slo") == 1.3
    assert bar.few == FewAdapters(FEW_ADAPTERS, llama.planning_slowdown("throughput"), bar.few.tpot_factor,
                                  bar.few.ttft_ms_per_adapter)
    assert bar.few.tpot_factor > 1 and bar.few.ttft_ms_per_adapter > 0
    assert PlanOptions(objective="throughput").bar(llama).few is None
    assert PlanOptions(slowdown=1.3).bar(llama).few is None  # --slowdown: every GPU on that margin
    assert PlanOptions(slowdown=1.3, few=bar.few).bar(llama) == bar  # a re-plan keeps its plan's rule
    assert gpu80.planning_slowdown("throughput") == gpu80.planning_slowdown("slo")
    assert PlanOptions().bar(gpu80).few is None
    assert ServiceBar.from_dict(bar.to_dict()) == bar
    older = {k: v for k, v in bar.to_dict().items() if k != "few_adapters"}
    assert ServiceBar.from_dict(older) == bar.flat(1.3)  # a plan from before the rule reads as it was judged
    assert "7% where it serves at most 64 adapters" in bar.describe()


@pytest.mark.parametrize("kind", ["small-tree", "surrogate"])
def test_the_packer_aims_a_group_of_few_adapters_at_its_rule_in_both_searches(monkeypatch, kind):
    """A window of few adapters is asked about its smaller margin, with the TTFT allowance taken off its limit
    (and the edge classifier asked at that load): the compiled search and best_a_max give the same plan, which
    needs fewer GPUs than every window on the larger margin."""
    llama = load_profile(LLAMA)
    pred = load_predictor(llama, kind)
    edge = getattr(pred, "edge", None) is not None
    flat = replace(PackRequest.build(random_workload(300, 9), llama, pred, 1000), margin=0.3, tpot_aim=1.3,
                   bar=ServiceBar(slowdown=1.3), edge=edge)
    few = FewAdapters(FEW_ADAPTERS, 1.066, 1.6, 5.5)
    ruled = replace(flat, bar=replace(flat.bar, few=few), few=few, few_margin=0.066)
    assert ruled.aim_scale({i: 1.0 for i in range(FEW_ADAPTERS)}) == pytest.approx(1.066)
    assert ruled.aim_scale({i: 1.0 for i in range(FEW_ADAPTERS + 1)}) == pytest.approx(1.3)
    fast, _ = plan(ruled, monkeypatch, True)
    slow, _ = plan(ruled, monkeypatch, False)
    assert fast == slow and not isinstance(fast, str)
    assert len(fast) < len(plan(flat, monkeypatch, True)[0])


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_a_plan_records_the_rule_and_evaluate_and_replan_judge_by_it(tmp_path):
    """200 adapters of log-uniform rates: GPUs of at most 64 adapters on the smaller margin take fewer GPUs than
    --slowdown 1.3 (every GPU on the SLO margin), and every one of them passes; the plan records the rule;
    evaluate judges by it (by --slowdown on one margin) and a re-plan of the same workload keeps it and changes
    nothing."""
    from twin.families import family_workload, write_workload_csv

    workload = tmp_path / "w.csv"
    write_workload_csv(family_workload("log-uniform", 200, 0), workload)
    res = _run("plan", workload, "--out", tmp_path / "plan.json")
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "plan.json").read_text())
    conf = doc["inputs"]["confirmation"]
    assert conf["few_adapters"]["adapters"] == FEW_ADAPTERS and conf["failing_gpus"] == 0
    assert "7% where it serves at most 64 adapters" in res.output
    assert _run("plan", workload, "--slowdown", 1.3, "--out", tmp_path / "flat.json").exit_code == 0
    flat = json.loads((tmp_path / "flat.json").read_text())
    assert "few_adapters" not in flat["inputs"]["confirmation"]
    assert doc["summary"]["gpus"] < flat["summary"]["gpus"]
    ev = json.loads(_run("evaluate", tmp_path / "plan.json", workload, "--json").stdout)
    assert ev["ok"] and ev["slo"]["few_adapters"] == conf["few_adapters"]
    one = json.loads(_run("evaluate", tmp_path / "plan.json", workload, "--slowdown", 1.3, "--json").stdout)
    assert "few_adapters" not in one["slo"]
    res = _run("replan", workload, "--previous", tmp_path / "plan.json", "--out", tmp_path / "again.json")
    assert res.exit_code == 0, res.output
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["inputs"]["confirmation"]["few_adapters"] == conf["few_adapters"]
    assert [i["adapters"] for i in again["instances"]] == [i["adapters"] for i in doc["instances"]]


#: A re-planned GPU of a mixed-length fleet (seed 1, night 19 of ``benchmarks.placement.nightly``): 21 adapters
#: on --max-loras 19, (rank, rate, prompt, output). With its third run on the smaller margin it passed at 1.88 s
#: p99 TTFT (p99.9 4.1 s) and missed with the night's evaluation seed (2.2 s).
AT_THE_KNEE = [(16, 1.13102, 1581.6, 341.1), (16, 0.408418, 3397.2, 19.4), (16, 0.29747, 3021.1, 793),
               (16, 0.17208, 1011, 893.8), (16, 0.172672, 2575.9, 64.9), (16, 0.119928, 4065.4, 33.6),
               (16, 0.0717269, 3161.4, 365), (16, 0.0310804, 509.2, 48.9), (16, 0.232221, 3516.3, 22),
               (16, 1.01443, 86.4, 22), (16, 0.820742, 63.1, 36.6), (16, 0.0201202, 102.5, 924.1),
               (8, 0.249127, 882.8, 633.4), (8, 1.43922, 1867.4, 198.2), (16, 0.221241, 3075.5, 363.3),
               (16, 0.129718, 3981.7, 595.5), (16, 0.978727, 2472.3, 98.4), (16, 0.248006, 1261.8, 140.1),
               (16, 0.570394, 2938.7, 884.9), (16, 0.911123, 288.5, 447.8), (16, 1.10948, 394.7, 91.9)]


def test_a_gpu_of_few_adapters_that_bursts_is_run_the_third_time_on_the_slo_margin(monkeypatch):
    """A p99.9 TTFT over the limit puts a GPU at its knee, where the rule for few adapters was never measured:
    its third run judges it as any other GPU, and this one fails there."""
    from planner.verdict import THIRD_SEED, TwinRun, twin_check

    profile = load_profile(LLAMA)
    bar = PlanOptions().bar(profile)
    ranks, rates, ins, outs = (np.array(c, float) for c in zip(*AT_THE_KNEE))
    sc = GpuScenario(ranks.astype(int), rates, ins, outs, 19, 16, max_ttft_ms=2000.0, max_tpot_ms=200.0)
    calls = []
    predict = TwinPredictor.predict
    monkeypatch.setattr(TwinPredictor, "predict",
                        lambda self, scs: calls.append((self.seed, self.few is None)) or predict(self, scs))
    run = TwinRun.for_bar(bar)
    assert not twin_check(profile, None, [sc], bar, run).meets(bar)[0]
    assert calls[-1] == (THIRD_SEED, True) and all(not flat for _, flat in calls[:-1])
    # with its third run on the smaller margin it passed
    monkeypatch.setattr(TwinPredictor, "predict", lambda self, scs: predict(replace(self, few=bar.few), scs))
    assert twin_check(profile, None, [sc], bar, run).meets(bar)[0]


#: A GPU the forests alone packed first for a 10,000-adapter mixed-length fleet (seed 0): six rank-32 adapters
#: on --max-loras 6, three at 1.8 req/s, (rate, prompt, output). Its judging run took 5.1 s p99 TTFT.
LONG_FEW = [(1.79781, 139.6, 1018.6), (0.00111102, 568.1, 696.0), (1.79766, 1602.1, 972.5),
            (0.00111576, 1825.5, 700.6), (1.79697, 1635.3, 52.2), (0.00111843, 92.9, 164.8)]


@pytest.mark.parametrize("compiled", [True, False])
def test_a_group_of_few_adapters_is_packed_only_where_the_edge_classifier_expects_it_to_pass(monkeypatch, compiled):
    """The forests pass LONG_FEW on one GPU on the smaller margin, and the twin fails it; the edge classifier,
    asked at that margin's load, does not (both searches)."""
    from planner.confirm import check_groups
    from planner.greedy import plan_greedy
    from planner.plan import pack_request
    from twin import Adapter, Workload

    profile = load_profile(LLAMA)
    wl = Workload(tuple(Adapter(f"a{i}", 32, rate, prompt, out) for i, (rate, prompt, out) in enumerate(LONG_FEW)))
    opts = PlanOptions()
    req = pack_request(wl, profile, load_predictor(profile, "surrogate"), opts)
    assert req.edge and req.few_covers(len(LONG_FEW))
    if not compiled:
        monkeypatch.setattr("planner.prefix_search.PrefixSearch.compiled", lambda self: False)
    alone = plan_greedy(replace(req, edge=False))
    assert len(alone) == 1 and not check_groups(req, alone, opts.run, opts.bar(profile)).meets(opts.bar(profile))[0]
    assert len(plan_greedy(req)) > 1
