"""Every hostile or careless input is exit 2 with one line, no traceback, and nothing written.

The cases are in tests/hostile_cases.py (``python -m benchmarks.placement.hostile_inputs`` runs them as real
processes); here they run in-process, plus rendered launch scripts executed with a stub ``python`` to
show no workload-derived value runs as a command, and property-based fuzzing of the two readers.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cli import main
from planner.schema import validate
from planner.workload_csv import read_workload
from tests.hostile_cases import GOOD_CSV, base_plan, cases, run_with_stub
from twin import BadInputError

CASES = cases()


def _listing(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() if p.is_file() else b"" for p in sorted(d.rglob("*"))}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_hostile_input_is_exit_2_one_line_and_writes_nothing(case, tmp_path, monkeypatch):
    case.files(tmp_path)
    before = _listing(tmp_path)
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, list(case.argv))
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2, (res.exit_code, res.output[-500:], repr(res.exception))
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.output, res.output
    assert _listing(tmp_path) == before
    assert len(CASES) >= 150


def test_rendered_launch_commands_run_no_workload_or_flag_value_as_a_command(tmp_path):
    """A workload file and an --adapter-dir whose names carry a newline and a command, a model name with a
    command substitution: the rendered script, run by bash with a stub `python`, starts only the stub, and
    the stub gets every adapter as one JSON --lora-modules value."""
    workload = tmp_path / "w\ntouch pwned-by-workload #.csv"
    workload.write_text(GOOD_CSV)
    plan = tmp_path / "plan.json"
    r = CliRunner()
    assert r.invoke(main, ["plan", str(workload), "--out", str(plan), "--jobs", "1"]).exit_code == 0
    res = r.invoke(main, ["render", str(plan), "--format", "vllm", "--model", "$(touch pwned-by-model)",
                          "--adapter-dir", "/srv/a\ntouch pwned-by-dir #"])
    assert res.exit_code == 0, res.output
    runs = run_with_stub(res.output, tmp_path)
    assert not list(tmp_path.glob("pwned*"))
    doc = json.loads(plan.read_text())
    assert len(runs) == len(doc["instances"])
    for argv, inst in zip(runs, doc["instances"]):
        assert argv[:3] == ["-m", "vllm.entrypoints.openai.api_server", "--model=$(touch pwned-by-model)"]
        specs = [json.loads(v) for v in argv[argv.index("--lora-modules") + 1:]]
        assert [s["name"] for s in specs] == [a["adapter_id"] for a in inst["adapters"]]
        assert all(s["path"].startswith("/srv/a\ntouch pwned-by-dir #/") for s in specs)
    assert "pwned" not in "".join(shlex.split(res.output.splitlines()[0], comments=True))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.binary(max_size=400), st.text(max_size=400),
                 st.lists(st.lists(st.text(max_size=20), max_size=8), max_size=8).map(
                     lambda rows: "adapter_id,rank,rate_rps\n" + "\n".join(",".join(r) for r in rows))))
def test_any_workload_file_reads_or_is_bad_input(tmp_path, content):
    path = tmp_path / "fuzz.csv"
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass"))
    try:
        read_workload(path)
    except BadInputError as exc:
        assert "\n" not in str(exc)


def _mutations():
    """A good placement with one value replaced anywhere by an arbitrary JSON value."""
    leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=30))
    value = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                         max_leaves=10)
    return st.tuples(st.integers(min_value=0), value)


@settings(max_examples=300, deadline=None)
@given(_mutations())
def test_any_placement_file_reads_or_is_bad_input(mutation):
    doc = json.loads(base_plan())
    paths = []

    def walk(node, trail):
        paths.append(trail)
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*trail, k))
        elif isinstance(node, list):
            for k, v in enumerate(node):
                walk(v, (*trail, k))

    walk(doc, ())
    index, value = mutation
    trail = paths[index % len(paths)]
    if not trail:
        doc = value
    else:
        node = doc
        for k in trail[:-1]:
            node = node[k]
        node[trail[-1]] = value
    try:
        validate(json.dumps(doc, allow_nan=True), "fuzz.json")
    except BadInputError as exc:
        assert "\n" not in str(exc)
