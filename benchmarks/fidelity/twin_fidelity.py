"""Twin fidelity against the study's real 1-hour Qwen2.5-7B runs on an H100 64GB.

    python -m benchmarks.fidelity.twin_fidelity [--profile h100-64gb-qwen2.5-7b] [--latency default|with-prefill]
    python -m benchmarks.fidelity.twin_fidelity --kp 0.02      # the default model plus a prompt-token cost
    python -m benchmarks.fidelity.twin_fidelity --length-cv 0  # constant lengths instead of the profile's

The twin gets only what a user knows — adapter count and ranks, the rate set, A_max, max rank
and the mean prompt/output lengths of the run's prompt pool — never the real arrival times. The
rank↔rate pairing of a run was not logged, so it is drawn at random (seeded). The study's client
opened one TCP connection per request and so could hold at most ~28k requests in flight (Linux's
default ephemeral port range, 32768–60999: 28232 ports; the runs peak at 27.7k running+waiting);
the twin models that client with ``max_in_flight=28232`` (``--no-client-cap`` turns it off).
Request lengths are drawn around those means as the profile says (``defaults.length_cv``);
``--length-cv`` overrides it (0 = every request at the mean).

Runs are split by scenario: the ranks-{8,16} runs are the *calibration half* (the only constant
chosen with real runs, the profile's length_cv, and the ``with-prefill`` variant's kp were picked
on them), the ranks-{8,16,32}
runs are *held out*. Errors are reported per half and per regime (real starved / not starved)
next to a trivial predictor, min(0.98 × arriving token rate, saturation throughput), and the
study's own twin. SMAPE here is the standard one, 100·mean(2|p−r|/(|p|+|r|)).

Writes artifacts/benchmarks/twin_fidelity[_VARIANT].json.
"""

from __future__ import annotations

import argparse
import csv
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from functools import cache
from pathlib import Path

import numpy as np

from benchmarks.record import result_path, write_result
from serving_harness.published_profiles import REFERENCE_DATA
from twin import Adapter, SimConfig, Workload, load_profile, simulate
from twin.metrics import smape

DEFAULT_DATA = REFERENCE_DATA
CLIENT_PORTS = 60999 - 32768 + 1


def load_runs(data: Path) -> list[dict]:
    with (data / "real_runs_qwen.csv").open(newline="") as f:
        return [r for r in csv.DictReader(f) if r["status"] == "ok"]


def run_workload(run: dict, seed: int) -> Workload:
    """The run's adapters as a user would describe them (ranks and rates, pairing drawn at random)."""
    ranks = [8] * int(run["n_rank_8"]) + [16] * int(run["n_rank_16"]) + [32] * int(run["n_rank_32"])
    rates = []
    for item in run["rate_counts"].split():
        value, count = item.split(":")
        rates += [float(value)] * int(count)
    rng = np.random.default_rng(seed)
    rng.shuffle(rates)
    mean_in, mean_out = float(run["pool_mean_in"]), float(run["pool_mean_out"])
    return Workload(tuple(Adapter(f"a{i}", r, lam, mean_in, mean_out) for i, (r, lam) in enumerate(zip(ranks, rates))))


@cache
def variant(profile_id: str, latency: str, override: tuple | None, length_cv: float | None):
    """The profile under test, loaded once per worker process (every run of a benchmark shares it)."""
    profile = load_profile(profile_id).with_latency_variant(latency)
    if override:
        profile = replace(profile, step_latency=replace(profile.step_latency, **dict(override)))
    if length_cv is not None:
        profile = replace(profile, default_length_cv=length_cv)
    return profile


def simulate_run(args) -> dict:
    run, profile_id, latency, seeds, client_cap, override, length_cv = args
    profile = variant(profile_id, latency, tuple(sorted(override.items())) if override else None, length_cv)
    outs = []
    for seed in range(seeds):
        res = simulate(run_workload(run, seed), profile, SimConfig(
            a_max=int(run["A_max"]), duration_s=float(run["total_time_s"]), seed=seed,
            max_lora_rank=int(run["S_max"]), max_in_flight=CLIENT_PORTS if client_cap else 0))
        outs.append(res)
    keys = ["total_throughput_tok_s", "itl_ms_mean", "ttft_ms_mean", "ttft_ms_mean_study", "arriving_tok_s", "sim_wall_s"]
    d = {k: float(np.mean([getattr(o, k) for o in outs])) for k in keys}
    d["starved"] = d["total_throughput_tok_s"] < 0.9 * d["arriving_tok_s"]
    return d


def evaluate(runs, preds, sat_thr) -> dict:
    real_thr = np.array([float(r["total_throughput"]) for r in runs])
    real_itl = np.array([float(r["mean_itl_ms"]) for r in runs])
    real_ttft = np.array([float(r["mean_ttft_ms"]) for r in runs])
    real_starved = np.array([r["starved"] == "1" for r in runs])
    arriving = np.array([float(r["arrived_token_rate_est"]) for r in runs])
    p_thr = np.array([p["total_throughput_tok_s"] for p in preds])
    p_itl = np.array([p["itl_ms_mean"] for p in preds])
    p_ttft = np.array([p["ttft_ms_mean"] for p in preds])
    p_starved = np.array([p["starved"] for p in preds])
    s_thr = np.array([float(r["study_dt_total_throughput"]) for r in runs])
    s_itl = np.array([float(r["study_dt_itl_ms"]) for r in runs])
    s_starved = s_thr < 0.9 * arriving
    trivial = np.minimum(0.98 * arriving, sat_thr)

    def block(mask):
        return {
            "runs": int(mask.sum()),
            "twin": {
                "throughput_smape": smape(p_thr[mask], real_thr[mask]),
                "itl_smape": smape(p_itl[mask], real_itl[mask]),
                "ttft_smape": smape(p_ttft[mask], real_ttft[mask]),
                "starved_agreement": float(np.mean(p_starved[mask] == real_starved[mask])) if mask.any() else float("nan"),
            },
            "study_twin": {
                "throughput_smape": smape(s_thr[mask], real_thr[mask]),
                "itl_smape": smape(s_itl[mask], real_itl[mask]),
                "starved_agreement": float(np.mean(s_starved[mask] == real_starved[mask])) if mask.any() else float("nan"),
            },
            "trivial": {"throughput_smape": smape(trivial[mask], real_thr[mask])},
        }

    calib = np.array([r["adapter_ranks"] == "8 16" for r in runs])
    out = {}
    for name, m in [("all", np.ones(len(runs), bool)), ("calibration_half", calib), ("held_out", ~calib)]:
        out[name] = {"overall": block(m), "real_not_starved": block(m & ~real_starved), "real_starved": block(m & real_starved)}
    return out


def predict(runs, profile_id, latency, seeds, client_cap, override=None, jobs=2, length_cv=None):
    work = [(r, profile_id, latency, seeds, client_cap, override, length_cv) for r in runs]
    with ProcessPoolExecutor(jobs) as ex:
        return list(ex.map(simulate_run, work, chunksize=4))


def saturation_throughput(profile_id, latency, length_cv=None) -> float:
    """The twin's throughput for a deeply overloaded server (trivial predictor's cap)."""
    run = {"n_rank_8": 16, "n_rank_16": 16, "n_rank_32": 0, "rate_counts": "1.6:32", "pool_mean_in": 222.7,
           "pool_mean_out": 200.0, "A_max": 32, "S_max": 16, "total_time_s": 600}
    return simulate_run((run, profile_id, latency, 1, True, None, length_cv))["total_throughput_tok_s"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--profile", default="h100-64gb-qwen2.5-7b")
    ap.add_argument("--latency", default="default", help="latency model variant of the profile (default, study)")
    ap.add_argument("--seeds", type=int, default=2, help="twin runs (seeds) averaged per real run")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--no-client-cap", action="store_true")
    ap.add_argument("--kp", type=float, default=None, help="override the prompt-token cost kp (ms/token)")
    ap.add_argument("--length-cv", type=float, default=None,
                    help="override the profile's request-length CV (0 = constant lengths)")
    ap.add_argument("--out", type=Path, default=result_path("twin_fidelity"))
    args = ap.parse_args(argv)
    runs = load_runs(args.data)
    override = None if args.kp is None else {"kp": args.kp}
    t0 = time.time()
    preds = predict(runs, args.profile, args.latency, args.seeds, not args.no_client_cap, override, args.jobs,
                    args.length_cv)
    sat = saturation_throughput(args.profile, args.latency, args.length_cv)
    profile = load_profile(args.profile)
    table = evaluate(runs, preds, sat)
    result = {
        "benchmark": "twin_fidelity",
        "profile": args.profile, "latency_model": args.latency, "kp_override": args.kp,
        "length_cv": profile.default_length_cv if args.length_cv is None else args.length_cv,
        "seeds_per_run": args.seeds, "client_cap": None if args.no_client_cap else CLIENT_PORTS,
        "smape": "standard: 100*mean(2|p-r|/(|p|+|r|))", "saturation_throughput_tok_s": sat,
        "mean_sim_wall_s": float(np.mean([p["sim_wall_s"] for p in preds])),
        "bench_wall_s": time.time() - t0, "results": table,
        "per_run": [{"scenario": r["scenario"], "A": int(r["served_adapters"]), "A_max": int(r["A_max"]),
                     "real_thr": float(r["total_throughput"]), "twin_thr": p["total_throughput_tok_s"],
                     "real_itl": float(r["mean_itl_ms"]), "twin_itl": p["itl_ms_mean"],
                     "real_starved": r["starved"] == "1", "twin_starved": p["starved"]} for r, p in zip(runs, preds)],
    }
    tag = "" if args.latency == "default" else f"_{args.latency}"
    tag += "" if args.kp is None else f"_kp{args.kp}"
    tag += "" if args.length_cv is None else f"_cv{args.length_cv:g}"
    out = args.out.with_name(f"{args.out.stem}{tag}.json")
    write_result(out, result, argv)
    for half in ("all", "calibration_half", "held_out"):
        for regime in ("overall", "real_not_starved", "real_starved"):
            b = table[half][regime]
            t, s = b["twin"], b["study_twin"]
            print(f"{half:17} {regime:17} n={b['runs']:3}  twin thr {t['throughput_smape']:5.1f}% itl {t['itl_smape']:5.1f}% "
                  f"ttft {t['ttft_smape']:5.1f}% agree {t['starved_agreement']:.3f} | study thr {s['throughput_smape']:5.1f}% "
                  f"itl {s['itl_smape']:5.1f}% agree {s['starved_agreement']:.3f} | trivial thr {b['trivial']['throughput_smape']:5.1f}%")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
