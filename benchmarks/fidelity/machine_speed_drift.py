"""How steady this machine's own speed is, with no vLLM at all: the floor under any real-run fidelity target.

One busy process per core (each pinned to its core) repeats a fixed unit of pure-Python work (dict and
integer arithmetic, about the kind of work a small engine's scheduler and API server do) for ``--minutes`` and
records how long each unit took. Reported per core: the units' spread (the SD of their log time, and the fastest
and slowest tenth), and the mean unit time over consecutive windows of ``--window`` seconds (a validation case
measures 25 s): the SD of the log of those window means is how far the speed of one case's window can differ from
another's on an otherwise idle machine, whatever model the twin has. Real runs of the same requests that differ by
more than that differ for reasons of their own; runs that differ by no more are what the machine gives.

    python -m benchmarks.fidelity.machine_speed_drift [--minutes 10] [--window 25]
        # -> artifacts/benchmarks/machine_speed_drift.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.record import result_path, write_result


def unit() -> int:
    """A fixed piece of interpreter work (~30-45 ms on the 2-core VM)."""
    total, table = 0, {}
    for i in range(300_000):
        total += i * i % 7
        table[i & 1023] = total
    return total


def busy(core: int, seconds: float, queue: mp.Queue) -> None:
    """Repeat :func:`unit` on ``core`` for ``seconds``; put (start offsets, durations) on ``queue``."""
    os.sched_setaffinity(0, {core})
    unit()  # warm-up, not kept
    t0 = time.perf_counter()
    starts, durations = [], []
    while (now := time.perf_counter()) - t0 < seconds:
        unit()
        starts.append(now - t0)
        durations.append(time.perf_counter() - now)
    queue.put((core, starts, durations))


def window_means(starts: np.ndarray, durations: np.ndarray, window: float) -> np.ndarray:
    """Mean unit time (ms) in each whole ``window`` of seconds (the last, partial window is left out)."""
    k = (starts // window).astype(np.int64)
    whole = k < int(starts.max() // window)
    counts = np.bincount(k[whole])
    sums = np.bincount(k[whole], weights=durations[whole])
    return sums[counts > 0] / counts[counts > 0] * 1e3


def core_summary(starts: np.ndarray, durations: np.ndarray, window: float) -> dict:
    ms = durations * 1e3
    means = window_means(starts, durations, window)
    return {
        "units": int(ms.size),
        "unit_ms_p10_p50_p90": [float(np.percentile(ms, q)) for q in (10, 50, 90)],
        "unit_ms_min_max": [float(ms.min()), float(ms.max())],
        "sd_log_unit": float(np.std(np.log(ms), ddof=1)),
        "windows": int(means.size),
        "window_mean_ms": [round(float(m), 2) for m in means],
        "sd_log_window_mean": float(np.std(np.log(means), ddof=1)) if means.size > 1 else None,
        "window_mean_max_over_min": float(means.max() / means.min()) if means.size else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="How long every core stays busy.")
    ap.add_argument("--window", type=float, default=25.0, help="Seconds per window mean (a validation case's "
                                                                "measurement window is 25 s).")
    ap.add_argument("--out", type=Path, default=result_path("machine_speed_drift"))
    args = ap.parse_args()
    if args.minutes * 60 < 2 * args.window:
        sys.exit("--minutes must cover at least two windows")
    cores = sorted(os.sched_getaffinity(0))
    queue: mp.Queue = mp.Queue()
    procs = [mp.Process(target=busy, args=(c, args.minutes * 60.0, queue)) for c in cores]
    print(f"{len(cores)} cores busy for {args.minutes:g} min ...", flush=True)
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        core, starts, durations = queue.get()
        results[core] = core_summary(np.array(starts), np.array(durations), args.window)
    for p in procs:
        p.join()
    out = {"benchmark": "machine_speed_drift", "minutes": args.minutes, "window_s": args.window,
           "cores": {str(c): results[c] for c in cores}}
    write_result(args.out, out)
    for c in cores:
        r = results[c]
        p10, p50, p90 = r["unit_ms_p10_p50_p90"]
        print(f"core {c}: {r['units']} units, p10/p50/p90 {p10:.1f}/{p50:.1f}/{p90:.1f} ms (SD of log "
              f"{r['sd_log_unit']:.3f}); {r['windows']} windows of {args.window:g} s: SD of log mean "
              f"{r['sd_log_window_mean']:.3f}, slowest/fastest {r['window_mean_max_over_min']:.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
