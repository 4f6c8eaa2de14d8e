"""Inputs of the policy loop from a workload, a profile and a policy; its outputs as the stock's."""

from __future__ import annotations

import numpy as np

from twin.policies import engine
from twin.policies.spec import PolicySpec


def run_policy(spec: PolicySpec, workload, profile, requests, arrival, load_ms, lat, sched, config, seed: int):
    """Run ``spec`` on pre-drawn requests; returns the stock core's outputs, the pool size (tokens)
    and the policy statistics as a dict."""
    eng = profile.engine
    terms = profile.policy_terms
    ranks = workload.ranks
    ad_tokens = np.array([terms.adapter_tokens(profile.kv, int(r)) for r in ranks])
    ad_blocks = np.ceil(ad_tokens / eng.block_size).astype(np.int64)
    cpu_ms_per_token = ranks * terms.cpu_lora_us_per_token_rank / 1000.0
    # Memory is one pool: the KV the engine has with no LoRA slots carved out (one null block kept).
    pool_tokens = profile.kv.no_lora_tokens
    pool_blocks = pool_tokens // eng.block_size - 1
    out_pred = requests.output_tokens
    if spec.scheduler == "mlq" and spec.output_prediction_sigma > 0:
        s = spec.output_prediction_sigma
        noise = np.random.default_rng([seed, 1]).lognormal(-s * s / 2, s, len(requests))
        out_pred = np.maximum(1, np.rint(out_pred * noise)).astype(np.int32)
    (*out, stats) = engine.simulate_policy_core(
        arrival, requests.adapter, requests.input_tokens, requests.output_tokens, out_pred,
        ad_tokens, ad_blocks, load_ms, cpu_ms_per_token.astype(np.float64),
        float(config.duration_s), int(config.a_max), int(pool_blocks), int(eng.block_size),
        int(eng.max_num_batched_tokens), int(eng.max_num_seqs), eng.admission_rule == "full_prompt",
        lat, sched, spec.int_params(), spec.float_params(),
        int(config.max_in_flight), float(config.timeseries_dt_s), int(config.trace_events),
    )
    hits, misses = stats[engine.S_HITS], stats[engine.S_MISSES]
    policy_stats = {
        "adapter_hit_rate": float(hits / (hits + misses)) if hits + misses else float("nan"),
        "evictions": int(stats[engine.S_EVICTIONS]),
        "load_stall_s": float(stats[engine.S_STALL_S]),
        "cpu_assisted_steps": int(stats[engine.S_CPU_STEPS]),
        "peak_resident_adapters": int(stats[engine.S_PEAK_RESIDENT]),
        "swap_ins": int(stats[engine.S_SWAP_INS]),
        "queue_refreshes": int(stats[engine.S_REFRESHES]),
        "bypasses": int(stats[engine.S_BYPASSES]),  # admissions past a head waiting for adapter memory
        "squashed": int(stats[engine.S_SQUASHED]),  # bypassers restarted when the head's memory came
    }
    return tuple(out), int(pool_tokens), policy_stats
