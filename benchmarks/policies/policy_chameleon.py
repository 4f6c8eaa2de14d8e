"""Chameleon vs the S-LoRA-like baseline in the twin (Chameleon, MICRO '25, §7 headline comparison).

    python -m benchmarks.policies.policy_chameleon

Workload shaped like the paper's: 100 adapters, ranks 8/16/32 (the profile's largest; the paper
also has 64/128), uniform rank popularity and Zipf(1) popularity within a rank, Poisson arrivals,
heavy-tailed (log-normal, CV 1.5) prompt/output lengths around the profile's means; A_max = 100
(S-LoRA has no per-batch adapter limit). Variants: slora (discard after use), chameleon, and the
paper's ablations cache-only (scheduler=fifo) and scheduler-only (cache=discard), and Chameleon
without its Opportunistic Bypass (the blog's blocked head). Reported: P50/P99
TTFT per load and the paper's throughput, the highest load whose P99 TTFT stays under 5x the mean
request execution time at the lowest load. Paper: P99 TTFT -14.7/-24.6/-80.7 % at low/medium/high
load, 1.5x throughput (cache-only 1.2x, scheduler-only 1.05x), at most 5 % of requests squashed.
Writes
artifacts/benchmarks/policy_chameleon.json.
"""

from __future__ import annotations

import argparse

from benchmarks.policies.policy_common import capacity, paper_workload, run_point, scaled
from benchmarks.record import write_result
from twin import load_profile
from twin.policies import policy_from_name

VARIANTS = {
    "slora": ("slora", {}),
    "chameleon": ("chameleon", {}),
    "chameleon_cache_only": ("chameleon", {"scheduler": "fifo"}),
    "chameleon_scheduler_only": ("chameleon", {"cache": "discard"}),
    "chameleon_blocked_head": ("chameleon", {"bypass": False}),
}
RPS = (4.0, 8.0, 12.0, 16.0, 18.0, 20.0, 22.0, 24.0)


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    profile = load_profile()
    base = paper_workload(100, (8, 16, 32), 1.0, 1.0, profile.default_input_tokens, profile.default_output_tokens)
    results = {}
    for name, (policy, params) in VARIANTS.items():
        spec = policy_from_name(policy, **params)
        results[name] = [run_point(scaled(base, rps), profile, spec, 100, 600.0, 60.0, 1.5) for rps in RPS]
    slo_ms = 5 * results["slora"][0]["e2e_ms_mean"]
    summary = {name: {"capacity_rps_p99_ttft_slo": capacity(pts, "ttft_ms_p99", slo_ms)} for name, pts in results.items()}
    for name in VARIANTS:
        cap, ref = summary[name]["capacity_rps_p99_ttft_slo"], summary["slora"]["capacity_rps_p99_ttft_slo"]
        summary[name]["capacity_vs_slora"] = cap / ref if cap and ref else None
        summary[name]["p99_ttft_change_vs_slora_pct"] = {
            str(p["rps"]): 100 * (p["ttft_ms_p99"] / q["ttft_ms_p99"] - 1) for p, q in zip(results[name], results["slora"])}
        summary[name]["hit_rate"] = {str(p["rps"]): p["policy_stats"]["adapter_hit_rate"] for p in results[name]}
        summary[name]["squashed_pct"] = {str(p["rps"]): 100 * p["policy_stats"]["squashed"] / max(p["arrived"], 1)
                                         for p in results[name]}
    path = write_result("policy_chameleon", {
        "benchmark": "policy_chameleon",
        "profile": profile.profile_id, "slo_p99_ttft_ms": slo_ms, "summary": summary, "results": results,
    }, argv)
    print(path)
    for name, s in summary.items():
        print(name, s["capacity_rps_p99_ttft_slo"], s["capacity_vs_slora"],
              {k: round(v) for k, v in s["p99_ttft_change_vs_slora_pct"].items()})


if __name__ == "__main__":
    main()
