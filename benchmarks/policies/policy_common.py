"""Shared pieces of the serving-policy benchmarks (benchmarks/policies/policy_*.py): paper-shaped workloads,
load sweeps in the twin, and the SLO-capacity read-out the papers report."""

from __future__ import annotations

import time

import numpy as np

from twin import Adapter, LengthModel, SimConfig, Workload, simulate


def paper_workload(n_adapters: int, ranks: tuple[int, ...], total_rps: float, alpha: float,
                   input_tokens: float, output_tokens: float) -> Workload:
    """Uniform popularity across ranks, power-law (Zipf ``alpha``; 0 = uniform) within a rank, as in
    Chameleon's and S-LoRA's setups; the rates add up to ``total_rps``."""
    per_rank = np.array_split(np.arange(n_adapters), len(ranks))
    adapters = []
    for rank, ids in zip(ranks, per_rank):
        w = 1.0 / np.arange(1, len(ids) + 1) ** alpha
        for k, i in enumerate(ids):
            rate = total_rps / len(ranks) * w[k] / w.sum()
            adapters.append(Adapter(f"r{rank}-{i:03d}", rank, float(rate), input_tokens, output_tokens))
    return Workload(tuple(adapters))


def scaled(wl: Workload, factor: float) -> Workload:
    return Workload(tuple(Adapter(a.adapter_id, a.rank, a.rate_rps * factor, a.input_tokens, a.output_tokens)
                          for a in wl.adapters))


def run_point(wl: Workload, profile, policy, a_max: int, duration_s: float, warmup_s: float, length_cv: float,
              seed: int = 0, conversations=None) -> dict:
    """One simulation; TTFT/ITL figures plus E2E ~ TTFT + ITL x (output - 1) and time per token."""
    cfg = SimConfig(a_max=a_max, duration_s=duration_s, warmup_s=warmup_s, seed=seed, policy=policy,
                    lengths=LengthModel.lognormal(length_cv), conversations=conversations)
    t0 = time.perf_counter()
    r = simulate(wl, profile, cfg)
    out = float(np.mean([a.output_tokens for a in wl.adapters]))
    e2e = r.ttft_ms_mean + r.itl_ms_mean * (out - 1)
    return {
        "rps": round(sum(a.rate_rps for a in wl.adapters), 4), "a_max": a_max,
        "throughput_tok_s": r.total_throughput_tok_s, "arriving_tok_s": r.arriving_tok_s, "starved": r.starved,
        "ttft_ms_mean": r.ttft_ms_mean, "ttft_ms_p50": r.ttft_ms_p50, "ttft_ms_p99": r.ttft_ms_p99,
        "itl_ms_mean": r.itl_ms_mean, "itl_ms_p99": r.itl_ms_p99, "e2e_ms_mean": e2e, "tpt_ms_mean": e2e / out,
        "finished": r.finished_requests, "arrived": r.arrived_requests, "preemptions": r.preemptions,
        "adapter_loads": r.adapter_loads, "policy_stats": r.policy_stats, "sim_wall_s": time.perf_counter() - t0,
    }


def capacity(points: list[dict], metric: str, limit: float) -> float | None:
    """Highest swept load (rps) whose ``metric`` stays within ``limit``, with every lower load too
    (linear interpolation to the crossing); None if even the lowest load misses it."""
    pts = sorted(points, key=lambda p: p["rps"])
    best = None
    for lo, hi in zip([None, *pts], pts):
        if not hi[metric] <= limit:
            if lo is not None:
                f = (limit - lo[metric]) / (hi[metric] - lo[metric])
                best = lo["rps"] + f * (hi["rps"] - lo["rps"])
            return best
        best = hi["rps"]
    return best
