"""Inputs of the policy loop from a workload, a profile and a policy; its outputs as the stock's."""

from __future__ import annotations

import numpy as np

from twin import core
from twin.errors import ProfileError
from twin.policies import engine
from twin.policies.history import history_state
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
    hist, conv, history_len = _history(spec, profile, requests, len(ranks))
    srv = engine.Server(
        duration=float(config.duration_s), a_max=int(config.a_max), pool_blocks=int(pool_blocks),
        block_size=int(eng.block_size), max_batched=int(eng.max_num_batched_tokens),
        max_num_seqs=int(eng.max_num_seqs), full_prompt_admission=eng.admission_rule == "full_prompt",
        lat=lat, sched=sched, **spec.loop_settings(), fp=spec.float_params(),
        max_in_flight=int(config.max_in_flight), ts_dt=float(config.timeseries_dt_s),
        trace_cap=int(config.trace_events), itl_edges=core.itl_edges(),
    )
    (*out, stats) = engine.simulate_policy_core(
        engine.new_requests(arrival, requests.adapter, requests.input_tokens, requests.output_tokens, out_pred, conv,
                            history_len),
        engine.new_adapters(ad_tokens, ad_blocks, load_ms, cpu_ms_per_token.astype(np.float64)), srv, hist,
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
        "prefill_tokens": int(stats[engine.S_PREFILL_TOKENS]),  # prompt tokens computed (history reuse saves them)
    }
    if hist.on:
        history, used = stats[engine.S_HISTORY_TOKENS], stats[engine.S_USED_BLOCK_S]
        policy_stats.update({
            "history_reused": float(stats[engine.S_REUSED_TOKENS] / history) if history else float("nan"),
            "history_evictions": int(stats[engine.S_KV_EVICTIONS]),
            "history_swap_ins": int(stats[engine.S_KV_SWAP_INS]),
            # time-averaged share of used pool blocks holding history of an adapter not on the GPU
            "invalid_kv_share": float(stats[engine.S_INVALID_BLOCK_S] / used) if used else 0.0,
        })
    return tuple(out), int(pool_tokens), policy_stats


def _history(spec: PolicySpec, profile, requests, n_adapters: int):
    """The history-KV state (``twin.policies.history``) and per-request conversation arrays."""
    n = len(requests)
    if requests.conversation is None:
        conv, history_len = np.full(n, -1, np.int64), np.zeros(n, np.int32)
    else:
        conv, history_len = requests.conversation, requests.history_tokens
    nc = requests.conversations
    conv_adapter = np.zeros(nc, np.int64)
    turns = conv >= 0
    conv_adapter[conv[turns]] = requests.adapter[turns]
    on = spec.prefix_cache and nc > 0
    swap_ms = 0.0
    if on and spec.host_kv:
        kv_bytes = profile.kv_bytes_per_token
        if kv_bytes is None:
            raise ProfileError(f"profile {profile.profile_id} gives no KV bytes per token (engine.kv_cache_bytes "
                               "or the model's layers/KV heads/head_dim), which swapping history KV needs")
        swap_ms = profile.policy_terms.swap_ms(kv_bytes)
    hist = history_state(conv_adapter, on, spec.host_kv, spec.dependency, profile.engine.block_size, swap_ms,
                         n_adapters)
    return hist, conv, history_len
