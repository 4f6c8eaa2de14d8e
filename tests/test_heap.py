"""The heap kept for the twin's runs (twin.heap): memory one run frees serves the next without the kernel
faulting it in again."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Allocates and frees 1–8 MiB blocks as twin runs one after another do, twice; prints the page faults the second
#: round took (the first touched the memory once).
RUNS = """
import resource, sys
import numpy as np
from twin.heap import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def runs():
    for i in range(40):
        arrays = [np.ones((1 << 17) * (1 + i % 8)) for _ in range(4)]
        del arrays
runs()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
runs()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", RUNS, mode], cwd=ROOT, capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_freed_blocks_serve_the_next_runs_without_new_page_faults():
    plain, kept = _faults("plain"), _faults("keep")
    assert kept * 10 < plain, (kept, plain)
