"""The layers of docs/architecture.md: twin at the bottom, models and serving_harness on twin only, planner on top."""

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


def test_the_check_sees_an_upward_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from planner.plan import make_plan\n")
    assert imported_packages(module) == {"planner"}
