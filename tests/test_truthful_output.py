"""What plan, evaluate and profiles print is what the plan holds: an adapter's own limit shows on its GPU,
a --gpus too small says how many a plan needs, a miss is printed with the digits that show it, and the
safety margins the README lists are the profiles'."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from planner.cli import main
from planner.verdict import beyond

README = Path(__file__).resolve().parents[1] / "README.md"
TIGHT = ("adapter_id,rank,rate_rps,input_tokens,output_tokens,path,max_ttft_s\n"
         "support-bot,16,6.0,,,,\nlegal,32,0.4,1800,350,,0.3\n")


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_an_adapters_own_ttft_limit_shows_in_the_plan_and_evaluate_headers(tmp_path):
    wl = tmp_path / "w.csv"
    wl.write_text(TIGHT)
    res = _run("plan", wl, "--out", tmp_path / "p.json")
    assert res.exit_code == 0, res.output
    gpu = next(i["instance_id"] for i in json.loads((tmp_path / "p.json").read_text())["instances"]
               if any(a["adapter_id"] == "legal" for a in i["adapters"]))
    line = f"{gpu} p99 TTFT <= 0.3 s"
    assert line in res.output
    for cmd in (("evaluate", tmp_path / "p.json", wl), ("render", tmp_path / "p.json")):
        out = _run(*cmd)
        assert out.exit_code == 0 and line in out.output, out.output


def test_a_plan_short_of_gpus_says_how_many_it_needs(tmp_path):
    wl = Path(__file__).resolve().parents[1] / "datasets" / "workloads" / "mixed-ranks-128-adapters.csv"
    res = _run("plan", wl, "--gpus", 1)
    assert res.exit_code == 3
    needed = int(re.search(r"needs (\d+) GPUs: give --gpus \1 or more", res.output).group(1))
    assert needed > 1
    assert _run("plan", wl, "--gpus", needed).exit_code == 0
    assert _run("plan", wl, "--gpus", needed - 1).exit_code == 3


@given(st.floats(1e-4, 1e4), st.floats(1e-9, 1.0))
def test_a_miss_is_printed_with_the_digits_that_show_it(limit, excess):
    value = limit * (1 + excess)
    shown, bound = beyond(value, limit, " s").split(" > ")
    number = float(shown.removesuffix(" s").replace(",", ""))
    assert number > float(bound.removesuffix(" s")) == limit
    decimals = len(shown.removesuffix(" s").split(".")[1])
    assert abs(number - value) <= 0.5 * 10.0 ** -decimals * (1 + 1e-6) + 4 * math.ulp(value)  # rounded
    low = beyond(limit * (1 - excess / 2), limit, "%", below=True)
    assert float(low.split(" < ")[0].removesuffix("%").replace(",", "")) < limit


def test_evaluate_never_prints_a_miss_equal_to_its_limit(tmp_path):
    wl = tmp_path / "w.csv"
    wl.write_text(TIGHT)
    assert _run("plan", wl, "--out", tmp_path / "p.json").exit_code == 0
    ttft = json.loads(_run("evaluate", tmp_path / "p.json", wl, "--json").stdout)["instances"][0]["ttft_ms_p99"]
    # just below the p99 (the JSON rounds it to 0.1 ms): rounded to two decimals both read the same
    limit = math.floor((ttft - 0.06) / 1000 * 1e5) / 1e5
    res = _run("evaluate", tmp_path / "p.json", wl, "--max-ttft", limit)
    assert res.exit_code == 3
    shown, bound = re.search(r"p99 TTFT ([\d.]+) s > ([\d.]+) s", res.output).groups()
    assert float(shown) > float(bound) == limit


def test_profiles_shows_the_safety_margins_the_readme_lists():
    res = _run("profiles", "--json")
    margins = {p["profile_id"]: p["safety_margin"] for p in json.loads(res.stdout)}
    rows = [r for r in README.read_text().splitlines() if re.match(r"\| `[a-z0-9.-]+`", r)]
    listed = {re.match(r"\| `([^`]+)`", r).group(1): r.rstrip(" |").rsplit("|", 1)[1].strip() for r in rows}
    listed = {k: v for k, v in listed.items() if k in margins}
    assert set(listed) == set(margins)
    text = _run("profiles").output
    for pid, cell in listed.items():
        served, slo = (float(x) for x in cell.split("/"))
        assert (margins[pid]["throughput"], margins[pid]["slo"]) == (served, slo), pid
        few = margins[pid]["few_adapters"]
        between = "" if few is None else f" ({few['slowdown']:g}x where a GPU serves at most {few['adapters']} adapters)"
        assert f"{slo:g}x slower than the profile for the SLO{between}, {served:g}x for the served share" in text
        assert (few is None) == (served >= slo), pid  # the rule for few adapters where the SLO margin is larger


def test_a_launch_format_without_a_loadable_model_is_refused_before_any_plan(tmp_path):
    """plan and replan print launch lines as render does: never a bare model name, and a refusal writes nothing."""
    wl = tmp_path / "w.csv"
    wl.write_text(TIGHT)
    res = _run("plan", wl, "--format", "k8s", "--out", tmp_path / "p.json")
    assert res.exit_code == 2 and "--model" in res.output and not (tmp_path / "p.json").exists()
    assert _run("plan", wl, "--out", tmp_path / "p.json").exit_code == 0
    before = (tmp_path / "p.json").read_bytes()
    res = _run("replan", wl, "--previous", tmp_path / "p.json", "--out", tmp_path / "p.json", "--format", "vllm")
    assert res.exit_code == 2 and (tmp_path / "p.json").read_bytes() == before
    res = _run("plan", wl, "--format", "vllm", "--model", "meta-llama/Llama-3.1-8B-Instruct")
    assert res.exit_code == 0 and "--model=meta-llama/Llama-3.1-8B-Instruct" in res.output
