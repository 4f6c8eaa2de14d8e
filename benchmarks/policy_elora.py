"""ELORA (one pool for LoRA weights and KV) vs vLLM's static split, in the twin (ELORA §6 headline).

    python benchmarks/policy_elora.py

Workload shaped like the chatbot scenario: 50 adapters of rank 32 with skewed (Zipf 1) popularity,
Poisson arrivals, LMSYS-Chat-1M-like lengths (means 69.5 / 214.5 tokens; the twin has no multi-turn
prefix reuse, so ELORA's history-KV gains are out of scope), log-normal CV 1. Stock vLLM (the
``twin.core`` loop) runs every A_max of its static split (KV = the profile's table for that A_max);
ELORA runs the same A_max values as its per-batch adapter limit. Reported per load: mean TTFT, and
the paper's supported peak load (highest load with mean TTFT < 500 ms) for each A_max and the best
of each system. Paper: mean TTFT -45.7 %, peak load +78.9 % vs vLLM (and still +38.7 % TTFT for
vLLM at its oracle split). Writes artifacts/benchmarks/policy_elora.json.
"""

from __future__ import annotations

from policy_common import capacity, paper_workload, run_point, scaled, write

from twin import load_profile
from twin.errors import InfeasibleError
from twin.policies import policy_from_name

RPS = (10.0, 20.0, 30.0, 40.0, 50.0, 60.0)
A_MAX = (4, 8, 16, 32, 50)


def main() -> None:
    profile = load_profile()
    base = paper_workload(50, (32,), 1.0, 1.0, 69.5, 214.5)
    results: dict = {"vllm": {}, "elora": {}}
    for system, spec in (("vllm", None), ("elora", policy_from_name("elora"))):
        for a_max in A_MAX:
            try:
                results[system][str(a_max)] = [run_point(scaled(base, r), profile, spec, a_max, 600.0, 60.0, 1.0)
                                               for r in RPS]
            except InfeasibleError:
                continue
    peak = {s: {a: capacity(pts, "ttft_ms_mean", 500.0) for a, pts in by_a.items()} for s, by_a in results.items()}
    best = {s: max(((v or 0.0), a) for a, v in p.items()) for s, p in peak.items()}
    ttft = {s: {a: {str(p["rps"]): p["ttft_ms_mean"] for p in pts} for a, pts in by_a.items()}
            for s, by_a in results.items()}
    summary = {
        "peak_rps_mean_ttft_500ms": peak,
        "best": {s: {"a_max": a, "peak_rps": v} for s, (v, a) in best.items()},
        "peak_gain_best_vs_best_pct": 100 * (best["elora"][0] / best["vllm"][0] - 1) if best["vllm"][0] else None,
        "mean_ttft_ms": ttft,
    }
    path = write("policy_elora", {"benchmark": "policy_elora", "command": "python benchmarks/policy_elora.py",
                                  "profile": profile.profile_id, "summary": summary, "results": results})
    print(path)
    print(peak, summary["best"], summary["peak_gain_best_vs_best_pct"])
    for s, by_a in ttft.items():
        for a, d in by_a.items():
            print(s, a, {k: round(v) for k, v in d.items()})


if __name__ == "__main__":
    main()
