"""What one LoRA slot costs in KV cache on a real H100, beside the study's measurements and the adapter's bytes.

Reads the start-up logs and raw results of ``planner profile --engine cuda`` (vLLM's own lines:
"Model loading took X GiB", "GPU KV cache size: N tokens") under ``--data`` and reports, per
max_lora_rank, the memory one more ``--max-loras`` slot takes at load time, the KV tokens it
costs, and the same slope in the study's KV table (vLLM 0.8.5 on an H100 64GB). The expected
slot size is the adapter's weights at max rank in bf16: every layer's q, k, v, o, gate, up and
down projections (``r x (in + out)`` each) plus a vocabulary-sized A of the embedding and B of
the LM head, which vLLM also reserves per slot.

    python benchmarks/kv_slot_cost.py            # -> artifacts/benchmarks/kv_slot_cost.json
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from serving_harness.synth import SHAPES, ModelShape
from twin import load_profile
from twin.atomic import write_json_atomic

GIB = 1024**3
LOADED = re.compile(r"Model loading took ([0-9.]+) GiB")
KV = re.compile(r"GPU KV cache size: ([0-9,]+) tokens")
POINT = re.compile(r"kv-a(\d+)-r(\d+)")


def slot_bytes(shape: ModelShape, rank: int, dtype_bytes: int = 2) -> int:
    """Bytes of one LoRA slot of ``rank``: the seven projections of every layer, embedding A, LM head B."""
    h, i, kv = shape.hidden_size, shape.intermediate_size, shape.num_key_value_heads * shape.head_dim
    per_layer = (h + h) * 2 + (h + kv) * 2 + (h + i) * 2 + (i + h)  # q, o; k, v; gate, up; down
    return dtype_bytes * rank * (shape.num_hidden_layers * per_layer + 2 * shape.vocab_size)


def kv_token_bytes(shape: ModelShape, dtype_bytes: int = 2) -> int:
    return dtype_bytes * 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim


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


def study_slope(profile_id: str, rank: int, a0: int, a1: int) -> float | None:
    """Tokens per slot in a published profile's KV table: least squares over its points in [a0, a1]
    where the engine started (None if fewer than two)."""
    kv = load_profile(profile_id).kv
    pts = [(a, t) for a, t in zip(kv.a_max_points, kv.tokens.get(rank, [])) if t is not None and a0 <= a <= a1]
    if len(pts) < 2:
        return None
    a, t = np.array(pts, float).T
    return float(-np.polyfit(a, t, 1)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(ROOT / "datasets/measured/h100-80gb-llama-3.1-8b"))
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--study-profile", default="h100-64gb-llama-3.1-8b")
    ap.add_argument("--out", default=str(ROOT / "artifacts/benchmarks/kv_slot_cost.json"))
    args = ap.parse_args()

    shape = SHAPES[args.shape]
    points = read_logs(Path(args.data) / "logs")
    if not points:
        sys.exit(f"no start-up logs with KV lines under {args.data}/logs")
    token_bytes = kv_token_bytes(shape)
    ranks = {}
    for rank in sorted({r for _, r in points if r}):
        a = sorted(a_max for a_max, r in points if r == rank)
        if len(a) < 2:
            continue
        lo, hi = points[(a[0], rank)], points[(a[-1], rank)]
        n = a[-1] - a[0]
        loaded_mib = (hi["loaded_gib"] - lo["loaded_gib"]) * GIB / n / 2**20
        kv_tokens = (lo["kv_tokens"] - hi["kv_tokens"]) / n
        expected = slot_bytes(shape, rank)
        study = study_slope(args.study_profile, rank, a[0], a[-1])
        ranks[str(rank)] = {
            "a_max": [a[0], a[-1]],
            "loaded_mib_per_slot": round(loaded_mib, 2),
            "adapter_bytes_mib": round(expected / 2**20, 2),
            "loaded_over_adapter_bytes": round(loaded_mib * 2**20 / expected, 4),
            "kv_tokens_per_slot": round(kv_tokens, 1),
            "kv_mib_per_slot": round(kv_tokens * token_bytes / 2**20, 2),
            "study_kv_tokens_per_slot": None if study is None else round(study, 1),
            "vs_study_pct": None if study is None else round(100 * (kv_tokens / study - 1), 2),
        }
    no_lora = points.get((0, 0))
    result = {
        "data": str(Path(args.data).resolve().relative_to(ROOT)) if Path(args.data).resolve().is_relative_to(ROOT)
        else args.data,
        "shape": args.shape, "kv_bytes_per_token": token_bytes, "study_profile": args.study_profile,
        "no_lora_kv_tokens": no_lora and no_lora["kv_tokens"],
        "points": {f"a{a}-r{r}": v for (a, r), v in sorted(points.items())},
        "per_rank": ranks,
    }
    write_json_atomic(args.out, result)
    for rank, r in ranks.items():
        study = "n/a" if r["study_kv_tokens_per_slot"] is None else \
            f"{r['study_kv_tokens_per_slot']:.0f} ({r['vs_study_pct']:+.1f} %)"
        print(f"rank {rank}: slot loads {r['loaded_mib_per_slot']:.1f} MiB (adapter {r['adapter_bytes_mib']:.1f} MiB), "
              f"costs {r['kv_tokens_per_slot']:.0f} KV tokens; study {study}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
