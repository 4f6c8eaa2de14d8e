"""Toppings (CPU-assisted cold starts) vs waiting for the load, in the twin (Toppings, ATC '25, §6 S3).

    python -m benchmarks.policies.policy_toppings

Workload shaped like setup S3: 200 adapters of one rank (32, the profile's largest; S3 uses 64)
with uniform popularity, Poisson arrivals at 9 req/s (and 6, 12), LMSYS-Chat-1M-like lengths
(means 69.5 prompt / 214.5 output tokens, log-normal CV 1). A_max = 200. Variants, all on the
S-LoRA memory model (adapters discarded after use): ``cached`` (every adapter resident and free,
the paper's CACHED upper bound), ``slora_inline`` (the copy runs inside the step and stalls every
running decode, S-LoRA as the paper describes it), ``slora_async`` (copied in the background, the
request waits: the paper's rejected strawman) and ``toppings`` (CPU LoRA while the copy runs).
Reported: mean TTFT, time per token (TPT, the paper's: E2E / output tokens) and P99 ITL (decode
stalls) relative to CACHED. Paper S3: S-LoRA +82 % TTFT / +80 % TPT, Toppings +6 % / +6 %.
Writes artifacts/benchmarks/policy_toppings.json.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from benchmarks.policies.policy_common import paper_workload, run_point, scaled
from benchmarks.record import write_result
from twin import load_profile
from twin.policies import policy_from_name

RPS = (6.0, 9.0, 12.0)
VARIANTS = {
    "cached": ("slora", {"preload_all": True, "cache": "lru"}),
    "slora_inline": ("slora", {"cold_start": "inline"}),
    "slora_async": ("slora", {}),
    "toppings": ("toppings", {}),
}


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    profile = load_profile()
    free_adapters = replace(profile, policy_terms=replace(profile.policy_terms, adapter_kv_tokens={32: 0.0}))
    base = paper_workload(200, (32,), 1.0, 0.0, 69.5, 214.5)
    results = {}
    for name, (policy, params) in VARIANTS.items():
        prof = free_adapters if name == "cached" else profile
        spec = policy_from_name(policy, **params)
        results[name] = [run_point(scaled(base, rps), prof, spec, 200, 600.0, 60.0, 1.0) for rps in RPS]
    summary = {}
    for name in VARIANTS:
        summary[name] = {
            str(p["rps"]): {m: 100 * (p[m] / c[m] - 1) for m in ("ttft_ms_mean", "tpt_ms_mean", "itl_ms_p99")}
            for p, c in zip(results[name], results["cached"])}
    path = write_result("policy_toppings", {
        "benchmark": "policy_toppings",
        "profile": profile.profile_id, "change_vs_cached_pct": summary, "results": results,
    }, argv)
    print(path)
    for name, s in summary.items():
        print(name, {k: {m: round(v, 1) for m, v in d.items()} for k, d in s.items()})


if __name__ == "__main__":
    main()
