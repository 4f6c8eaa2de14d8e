"""Do the LoRA terms fitted on Qwen's real runs carry over to Llama? The study's own LoRA-overhead runs.

The study ran both models on the same vLLM with LoRA on (``lora_overhead_vs_adapters.csv``: batch cap
220/250, one-token prompts, ``--max-loras 300 --max-lora-rank 8``, 1 to 300 adapters receiving requests)
and with LoRA off at the same batch cap. Two figures say whether LoRA costs belong to the engine or to
the model:

* what one adapter adds to the backbone's step, and what each further distinct adapter of a batch adds
  (least squares over the runs whose distinct adapters per batch were logged), in milliseconds;
* each profile's step-latency model against the measured ITL of those runs (the decode steps dominate:
  one prompt token per request), with its default terms (additive LoRA l0 + l1·B, reserved slots l3)
  and with the study's eq. 1 (variant ``eq1``), as standard SMAPE.

    python -m benchmarks.fidelity.llama_terms     # -> artifacts/benchmarks/llama_terms.json
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

from benchmarks.record import result_path, write_result
from serving_harness.published_profiles import REFERENCE_DATA
from twin import load_profile
from twin.core import step_ms
from twin.metrics import smape

DATA = REFERENCE_DATA / "lora_overhead_vs_adapters.csv"
PROFILES = {"llama-3.1-8b-instruct": "h100-64gb-llama-3.1-8b", "qwen-2.5-7b-instruct": "h100-64gb-qwen2.5-7b"}
A_MAX, RANK = 300, 8  # the runs' --max-loras and --max-lora-rank


def lora_costs(rows: list[dict]) -> dict:
    """One adapter's cost over the backbone, and the slope per further distinct adapter (ms)."""
    backbone = np.mean([float(r["mean_itl_ms"]) for r in rows if r["experiment"] == "backbone_reference"])
    lora = [r for r in rows if r["experiment"] == "lora_overhead" and r["mean_unique_adapters_per_batch"]]
    x = np.array([float(r["mean_unique_adapters_per_batch"]) for r in lora])
    y = np.array([float(r["mean_itl_ms"]) for r in lora])
    slope, intercept = np.polyfit(x, y, 1)
    one = np.mean([float(r["mean_itl_ms"]) for r in rows
                   if r["experiment"] == "lora_overhead" and r["adapters_receiving_requests"] == "1"])
    return {"backbone_itl_ms": float(backbone), "one_adapter_adds_ms": float(one - backbone),
            "per_distinct_adapter_ms": float(slope), "intercept_ms": float(intercept), "runs_fitted": len(lora)}


def model_fit(rows: list[dict], profile_id: str) -> dict:
    """Each latency model of the profile against the runs with a logged distinct-adapter count."""
    lora = [r for r in rows if r["experiment"] == "lora_overhead" and r["mean_unique_adapters_per_batch"]]
    real = np.array([float(r["mean_itl_ms"]) for r in lora])
    out = {}
    profile = load_profile(profile_id)
    for name in ("default", "eq1"):
        lat = np.array(profile.with_latency_variant(name).step_latency.for_server(A_MAX, RANK).as_array())
        pred = np.array([step_ms(lat, float(r["mean_batch_size"]), float(r["mean_batch_size"]) /
                                 float(r["mean_output_tokens_per_req"]), float(r["mean_unique_adapters_per_batch"]))
                         for r in lora])
        out[name] = {"itl_smape_pct": smape(pred, real), "mean_log_ratio_model_over_real": float(np.mean(np.log(pred / real)))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--out", type=Path, default=result_path("llama_terms"))
    args = ap.parse_args()
    with args.data.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    out = {"benchmark": "llama_terms", "models": {}}
    for model, profile_id in PROFILES.items():
        mine = [r for r in rows if r["model"] == model]
        out["models"][model] = {"profile": profile_id, "lora_costs": lora_costs(mine),
                                "step_model_vs_runs": model_fit(mine, profile_id)}
    write_result(args.out, out)
    for model, d in out["models"].items():
        c, f = d["lora_costs"], d["step_model_vs_runs"]
        print(f"{model}: one adapter +{c['one_adapter_adds_ms']:.1f} ms over {c['backbone_itl_ms']:.1f}, "
              f"+{c['per_distinct_adapter_ms']:.3f} ms per distinct adapter ({c['runs_fitted']} runs); step model "
              f"ITL SMAPE default {f['default']['itl_smape_pct']:.1f} %, eq1 {f['eq1']['itl_smape_pct']:.1f} %")


if __name__ == "__main__":
    main()
