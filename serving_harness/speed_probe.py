"""A fixed probe of how fast an engine decodes at the moment, and the twin's answer to the same probe.

A shared CPU VM gives an engine a speed that moves from one stretch of minutes to the next (see
benchmarks/fidelity/engine_speed_drift.py). The probe — PROBE_REQUESTS requests of one adapter sent together,
PROMPT prompt tokens and OUTPUT output tokens each — is small enough to run right before and after a
validation case (or a ``planner verify`` engine's traffic). Real probe ITL over the twin's probe ITL is
the machine's speed relative to the profile at that time: ``Profile.slowed`` scales the twin's step
latency by it, so a case can be scored against a twin that knows how fast the machine was, measured
apart from the case itself.
"""

from __future__ import annotations

import numpy as np

from serving_harness.loadgen import run_load, summarise
from serving_harness.metrics import wait_idle
from twin.metrics import geomean
from twin.profile import Profile
from twin.simulate import SimConfig, simulate
from twin.workload import Adapter, Requests, Workload, trace_requests

PROBE_REQUESTS, PROMPT, OUTPUT = 8, 32, 64
#: Seconds the probe may take; every probe request arrives at 0.
PROBE_WINDOW_S = 60.0


def probe_requests(adapter: str, rank: int) -> tuple[Workload, Requests]:
    """The probe's one-adapter workload and its requests, all arriving at 0."""
    workload = Workload((Adapter(adapter, rank, 1.0),))
    n = PROBE_REQUESTS
    return workload, trace_requests(workload, [0.0] * n, [adapter] * n, [PROMPT] * n, [OUTPUT] * n)


def real_probe_itl_ms(base_url: str, adapter: str, rank: int, vocab_size: int) -> float | None:
    """ITL (ms) of the probe on the engine at ``base_url``, served by its adapter ``adapter`` once the engine
    is idle; None when no probe request finished."""
    wait_idle(base_url)
    _, requests = probe_requests(adapter, rank)
    records = run_load(base_url, requests, [adapter], 1.0, vocab_size=vocab_size, drain_s=PROBE_WINDOW_S)
    itl = summarise(records, PROBE_WINDOW_S + 1.0).itl_ms_mean
    return float(itl) if np.isfinite(itl) and itl > 0 else None


def twin_probe_itl_ms(profile: Profile, adapter: str, rank: int, a_max: int, max_lora_rank: int) -> float:
    """ITL (ms) the twin gives the probe on an engine with ``a_max`` slots of ``max_lora_rank``."""
    workload, requests = probe_requests(adapter, rank)
    sim = simulate(workload, profile, SimConfig(a_max=a_max, duration_s=PROBE_WINDOW_S + 1.0,
                                                max_lora_rank=max_lora_rank), requests=requests)
    return sim.itl_ms_mean


def speed_vs_profile(profile: Profile, adapter: str, rank: int, a_max: int, max_lora_rank: int,
                     real_itl_ms: list[float]) -> tuple[float, float]:
    """Real over twin probe ITL (the real probes' geometric mean; above 1: slower than profiled), and the
    twin's probe ITL."""
    twin = twin_probe_itl_ms(profile, adapter, rank, a_max, max_lora_rank)
    return float(geomean(real_itl_ms)) / twin, twin
