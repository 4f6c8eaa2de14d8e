"""Repository hygiene CI checks: ruff, and no test skipping around the one switch that makes CI run it all."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conftest import needs

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    needs("ruff")
    res = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True,
                         check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_no_test_skips_around_the_switch():
    """Optional imports, skips and installs in tests go through conftest's ``needs``/``needs_program``, which
    .ci/run's LORA_PLANNER_REQUIRE_ALL turns into errors: nothing skips silently in CI."""
    direct = re.compile(r"importorskip|pytest\.skip\(|except (ImportError|ModuleNotFoundError)|apt-get")
    offenders = [f"{p.name}:{i}" for p in sorted((ROOT / "tests").glob("*.py"))
                 if p.name not in ("conftest.py", Path(__file__).name)
                 for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if direct.search(line)]
    assert offenders == []
