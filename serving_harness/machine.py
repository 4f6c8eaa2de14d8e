"""Facts about the machine a measurement ran on, naming no host: CPU model, cores, memory, and the GPU
as nvidia-smi reports it."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> float | None:
    """Total memory, GiB (one decimal); None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (AttributeError, ValueError, OSError):
        return None


def machine_facts(device: str = "cpu", gpu: int | None = None) -> dict:
    """The host (and, for ``device="cuda"``, GPU ``gpu`` as nvidia-smi reports it) a profile was measured on."""
    facts = {"accelerator": "none (CPU)", "cpu": cpu_model(), "nproc": os.cpu_count(), "platform": platform.platform()}
    if device == "cuda":
        facts.update(_gpu_facts(gpu or 0))
    return facts


def _gpu_facts(index: int) -> dict:
    query = ["nvidia-smi", "-i", str(index), "--query-gpu=name,memory.total,driver_version",
             "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=60, check=True).stdout
        name, mib, driver = (f.strip() for f in out.strip().splitlines()[0].split(","))
        return {"accelerator": name, "gpu_index": index, "memory_gib": round(float(mib) / 1024, 2), "driver": driver}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {"accelerator": "CUDA GPU (nvidia-smi unavailable)", "gpu_index": index}
