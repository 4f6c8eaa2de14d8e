"""What one LoRA slot costs in KV cache on a real H100, beside the study's measurements and vLLM's slot buffers.

Reads the start-up logs of ``planner profile --engine cuda`` (vLLM's own lines: "Model loading took
X GiB", "GPU KV cache size: N tokens") under ``--data`` and reports, per max_lora_rank, the memory
one more ``--max-loras`` slot takes at load time, the KV tokens it costs, and the same least-squares
slope in the study's KV table (vLLM 0.8.5 on an H100 64GB) over the A_max range it measured. The
expected slot size is the buffers vLLM reserves per slot at max rank in bf16: A and B of every
layer's q, k, v, o, gate, up and down projections, and of the embedding and the LM head (the
adapters the harness writes have only the projections).

    python -m benchmarks.studies.kv_slot_cost            # -> artifacts/benchmarks/kv_slot_cost.json
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

from benchmarks.record import result_path, write_result
from serving_harness.synth import SHAPES
from twin import load_profile
from twin.atomic import recorded_path
from twin.profile import KVCapacity

ROOT = Path(__file__).resolve().parents[2]

GIB = 1024**3
LOADED = re.compile(r"Model loading took ([0-9.]+) GiB")
KV = re.compile(r"GPU KV cache size: ([0-9,]+) tokens")
POINT = re.compile(r"kv-a(\d+)-r(\d+)")


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares fall per A_max step of (A_max, value) points."""
    a, v = np.array(points, float).T
    return float(-np.polyfit(a, v, 1)[0])


def read_logs(logs: Path) -> dict[tuple[int, int], dict[str, float]]:
    """(A_max, rank) -> loaded GiB and KV tokens, from each start-up log (0, 0 for the engine without LoRA)."""
    points = {}
    for log in sorted(logs.glob("kv-*.log")):
        text = log.read_text(encoding="utf-8", errors="replace")
        loaded, kv = LOADED.search(text), KV.search(text)
        if not (loaded and kv):
            continue
        m = POINT.match(log.stem)
        key = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
        points[key] = {"loaded_gib": float(loaded.group(1)), "kv_tokens": int(kv.group(1).replace(",", ""))}
    return points


def study_slope(kv: KVCapacity, rank: int, a0: int, a1: int) -> tuple[float, list[int]] | None:
    """Tokens per slot in a published profile's KV table over its points in [a0, a1] where the engine
    started, and the A_max range used (None if fewer than two)."""
    pts = [(a, t) for a, t in zip(kv.a_max_points, kv.tokens.get(rank, [])) if t is not None and a0 <= a <= a1]
    if len(pts) < 2:
        return None
    return slope(pts), [pts[0][0], pts[-1][0]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(ROOT / "datasets/measured/h100-80gb-llama-3.1-8b"))
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--study-profile", default="h100-64gb-llama-3.1-8b")
    ap.add_argument("--out", default=str(result_path("kv_slot_cost")))
    args = ap.parse_args()

    shape = SHAPES[args.shape]
    points = read_logs(Path(args.data) / "logs")
    if not points:
        sys.exit(f"no start-up logs with KV lines under {args.data}/logs")
    token_bytes = shape.kv_bytes_per_token
    study_kv = load_profile(args.study_profile).kv
    ranks = {}
    for rank in sorted({r for _, r in points if r}):
        pts = sorted((a_max, v) for (a_max, r), v in points.items() if r == rank)
        if len(pts) < 2:
            continue
        loaded_mib = -slope([(a, v["loaded_gib"]) for a, v in pts]) * GIB / 2**20
        kv_tokens = slope([(a, v["kv_tokens"]) for a, v in pts])
        expected = shape.lora_slot_bytes(rank)
        study = study_slope(study_kv, rank, pts[0][0], pts[-1][0])
        ranks[str(rank)] = {
            "a_max": [pts[0][0], pts[-1][0]],
            "loaded_mib_per_slot": round(loaded_mib, 2),
            "slot_buffer_mib": round(expected / 2**20, 2),
            "loaded_over_slot_buffer": round(loaded_mib * 2**20 / expected, 4),
            "kv_tokens_per_slot": round(kv_tokens, 1),
            "kv_mib_per_slot": round(kv_tokens * token_bytes / 2**20, 2),
            "study_kv_tokens_per_slot": None if study is None else round(study[0], 1),
            "study_a_max": None if study is None else study[1],
            "vs_study_pct": None if study is None else round(100 * (kv_tokens / study[0] - 1), 2),
        }
    no_lora = points.get((0, 0))
    result = {
        "benchmark": "kv_slot_cost", "data": recorded_path(args.data, ROOT),
        "shape": args.shape, "kv_bytes_per_token": token_bytes, "study_profile": args.study_profile,
        "no_lora_kv_tokens": no_lora and no_lora["kv_tokens"],
        "points": {f"a{a}-r{r}": v for (a, r), v in sorted(points.items())},
        "per_rank": ranks,
    }
    write_result(args.out, result)
    for rank, r in ranks.items():
        study = "n/a" if r["study_kv_tokens_per_slot"] is None else \
            f"{r['study_kv_tokens_per_slot']:.0f} over A_max {r['study_a_max']} ({r['vs_study_pct']:+.1f} %)"
        print(f"rank {rank}: slot loads {r['loaded_mib_per_slot']:.1f} MiB (buffers {r['slot_buffer_mib']:.1f} MiB), "
              f"costs {r['kv_tokens_per_slot']:.0f} KV tokens; study {study}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
