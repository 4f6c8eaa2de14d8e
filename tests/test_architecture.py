"""The layers of docs/architecture.md: twin at the bottom, models and serving_harness on twin only, planner on
top; and within them no two modules that import each other, directly or round a loop."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {"twin": set(), "models": {"twin"}, "serving_harness": {"twin"},
           "planner": {"twin", "models", "serving_harness"}}


def imported_packages(path: Path) -> set[str]:
    """Top-level project packages a module imports, anywhere in it (function-level imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
    return out & ALLOWED.keys()


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_layers_below_it(package):
    bad = {str(p.relative_to(ROOT)): sorted(imported_packages(p) - ALLOWED[package] - {package})
           for p in (ROOT / package).rglob("*.py")}
    assert not {k: v for k, v in bad.items() if v}


def module_graph(root: Path) -> dict[str, set[str]]:
    """Which project modules each module imports (function-level imports included). ``from pkg import mod``
    of a submodule is an edge to that module, not to the package's ``__init__``."""
    modules = {}
    for package in ALLOWED:
        for path in (root / package).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
                graph[name].update(subs)
                if node.module in modules and len(subs) < len(node.names):
                    graph[name].add(node.module)
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name in modules)
    return graph


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that reach each other by imports (strongly connected, more than one module)."""
    reach = {m: set() for m in graph}
    for start, imported in graph.items():
        todo = list(imported)
        while todo:
            m = todo.pop()
            if m not in reach[start]:
                reach[start].add(m)
                todo.extend(graph[m])
    loops = {tuple(sorted(m for m in reach[a] if a in reach[m])) for a in graph if a in reach[a]}
    return sorted(list(loop) for loop in loops)


def test_no_modules_import_each_other():
    assert import_loops(module_graph(ROOT)) == []


def test_the_loop_check_sees_a_loop():
    assert import_loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_check_sees_an_upward_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from planner.plan import make_plan\n")
    assert imported_packages(module) == {"planner"}


def test_ci_turns_a_missing_dependency_into_an_error(monkeypatch):
    """Tests needing an optional module or program skip where it is absent, except under the switch that
    .ci/run sets."""
    import conftest

    assert "export LORA_PLANNER_REQUIRE_ALL=1" in (ROOT / ".ci" / "run").read_text()
    assert conftest.require_all({"LORA_PLANNER_REQUIRE_VLLM": "1"}) and not conftest.require_all({})
    monkeypatch.setattr(conftest, "REQUIRE_ALL", True)
    with pytest.raises(ModuleNotFoundError):
        conftest.needs("no_such_engine_module")
    with pytest.raises(FileNotFoundError):
        conftest.needs_program("no-such-program")
    monkeypatch.setattr(conftest, "REQUIRE_ALL", False)
    with pytest.raises(pytest.skip.Exception):
        conftest.needs("no_such_engine_module")
    with pytest.raises(pytest.skip.Exception):
        conftest.needs_program("no-such-program")
