"""The lower bound beside every plan (planner.lower_bound): what it is, where a plan shows it, and that no plan
goes below it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from models.scenario import GpuScenario
from models.twin_predictor import TwinPredictor
from planner.cli import main
from planner.lower_bound import BOUND_RUN, best_gpu_tok_s, bound_words, lower_bound
from planner.packing import PackRequest
from planner.verdict import ServiceBar, twin_check
from twin import load_profile
from twin.atomic import json_safe
from twin.workload import Adapter, Workload

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "datasets" / "workloads" / "mixed-ranks-128-adapters.csv"
PROFILE = "h100-64gb-llama-3.1-8b"


def _request(adapters) -> PackRequest:
    profile = load_profile(PROFILE)
    return PackRequest.build(Workload(tuple(adapters)), profile, TwinPredictor(profile), 10**6)


def test_the_bound_is_the_best_gpu_capacity_found_by_bisection():
    profile = load_profile(PROFILE)
    bar = ServiceBar()
    tok_s = best_gpu_tok_s(profile, None, bar, 8, 220.0, 200.0)
    def meets(rate):
        sc = GpuScenario(np.array([8]), np.array([rate]), np.array([220.0]), np.array([200.0]), 1,
                         max_ttft_ms=2000.0, max_tpot_ms=200.0)
        return bool(twin_check(profile, None, [sc], bar, BOUND_RUN).meets(bar)[0])

    rate = tok_s / 420.0
    assert meets(rate)  # the capacity found is one the twin passes ...
    assert not meets(rate * 1.2)  # ... and well above it the GPU misses the SLO
    # a looser bar lets one GPU serve more; a stricter one less
    assert best_gpu_tok_s(profile, None, ServiceBar(max_ttft_s=10.0, max_tpot_ms=400.0), 8, 220.0, 200.0) >= tok_s
    assert best_gpu_tok_s(profile, None, ServiceBar(max_tpot_ms=40.0), 8, 220.0, 200.0) < tok_s


def test_gpus_are_the_arriving_tokens_over_one_gpus_best_rounded_up():
    req = _request([Adapter(f"a{i}", 16 if i % 2 else 8, 0.5 + i / 10, 300.0, 150.0) for i in range(40)])
    bound = lower_bound(req, ServiceBar(slowdown=1.3))()
    assert bound.rank == 8 and bound.mean_input_tokens == 300.0 and bound.mean_output_tokens == 150.0
    assert math.isclose(bound.arriving_tok_s, float(req.arriving_tok_s.sum()))
    assert bound.gpus == math.ceil(bound.arriving_tok_s / bound.gpu_tok_s)
    # the margin is not in the bound: the same as with no margin
    assert lower_bound(req, ServiceBar())().gpu_tok_s == bound.gpu_tok_s


def test_a_workload_with_no_traffic_is_bounded_by_one_gpu():
    bound = lower_bound(_request([Adapter("idle", 8, 0.0, 100.0, 100.0)]), ServiceBar())()
    assert bound.gpus == 1 and bound.arriving_tok_s == 0.0
    record = json_safe(bound.to_dict())  # as a placement file holds it
    assert record["gpu_tok_s"] is None
    assert bound_words(record, 1) == "lower bound: 1 GPU(s): no traffic arrives"


def test_plan_prints_and_records_the_bound_and_no_plan_goes_below_it(tmp_path):
    out = tmp_path / "p.json"
    res = CliRunner().invoke(main, ["plan", str(EXAMPLE), "--out", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    bound = doc["inputs"]["lower_bound"]
    assert doc["summary"]["lower_bound_gpus"] == bound["gpus"] >= 1
    for objective in ((), ("--slowdown", "1.0"), ("--objective", "throughput")):
        plan = CliRunner().invoke(main, ["plan", str(EXAMPLE), "--json", *objective])
        assert plan.exit_code == 0, plan.output
        s = json.loads(plan.output)["summary"]
        assert s["gpus"] >= s["lower_bound_gpus"]
    line = f"lower bound: {bound['gpus']} GPU(s)"
    assert line in res.output
    assert f"this plan is {doc['summary']['gpus'] / bound['gpus']:.2f}x it" in res.output
    rendered = CliRunner().invoke(main, ["render", str(out)])
    assert rendered.exit_code == 0 and line in rendered.output


def test_an_older_plan_without_a_bound_reads_as_before(tmp_path):
    out = tmp_path / "p.json"
    assert CliRunner().invoke(main, ["plan", str(EXAMPLE), "--out", str(out)]).exit_code == 0
    doc = json.loads(out.read_text())
    del doc["inputs"]["lower_bound"], doc["summary"]["lower_bound_gpus"]
    out.write_text(json.dumps(doc))
    res = CliRunner().invoke(main, ["render", str(out)])
    assert res.exit_code == 0, res.output
    assert "lower bound" not in res.output
