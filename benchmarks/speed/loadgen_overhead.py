"""How many requests/s the load generator keeps up with on one core (against a stub endpoint).

The stub (serving_harness/stub_server.py, in its own process) streams each request's tokens at
once, so the figures are the harness's own cost: for each offered Poisson rate, the requests sent,
the sending lag behind the planned arrival (p50/p99), the share that finished, and the client's
CPU seconds per request (its single event-loop thread; ``1 / cpu_per_request`` is the rate one core
sustains). "Keeps up" = every request finished and p99 lag < 50 ms.

    python -m benchmarks.speed.loadgen_overhead [--rates 250 500 1000 2000] [--seconds 5]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from benchmarks.record import result_path, write_result
from serving_harness.engine import free_port
from serving_harness.loadgen import run_load
from twin import Adapter, Workload, draw_requests

OUT = result_path("loadgen_overhead")


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def wait_healthy(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"stub server not healthy at {url}")


def one_rate(base_url: str, rate: float, seconds: float, n_adapters: int, tokens: tuple[int, int]) -> dict:
    workload = Workload(tuple(Adapter(f"a{i}", 8, rate / n_adapters, *tokens) for i in range(n_adapters)))
    requests = draw_requests(workload, seconds, seed=int(rate))
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    records = run_load(base_url, requests, [a.adapter_id for a in workload.adapters], seconds, vocab_size=1000,
                       drain_s=2.0)
    cpu, wall = cpu_seconds() - cpu0, time.perf_counter() - wall0
    lag_ms = (records.sent_s - records.arrival_s)[np.isfinite(records.sent_s)] * 1000.0
    finished = float(np.mean(records.error == ""))
    p99 = float(np.percentile(lag_ms, 99))
    return {
        "offered_rps": rate, "requests": len(records), "finished_fraction": finished,
        "send_lag_ms_p50": float(np.percentile(lag_ms, 50)), "send_lag_ms_p99": p99,
        "client_cpu_s": cpu, "wall_s": wall, "client_cpu_ms_per_request": 1000.0 * cpu / len(records),
        "one_core_capacity_rps": len(records) / cpu, "keeps_up": bool(finished == 1.0 and p99 < 50.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[250, 500, 1000, 1500])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--input-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    port = free_port()
    stub = subprocess.Popen([sys.executable, "-m", "serving_harness.stub_server", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health")
        rows = [one_rate(f"http://127.0.0.1:{port}", r, args.seconds, args.adapters,
                         (args.input_tokens, args.output_tokens)) for r in args.rates]
    finally:
        stub.terminate()
        stub.wait(10)
    for row in rows:
        print(f"{row['offered_rps']:7.0f} req/s offered: finished {row['finished_fraction']:.3f}, lag p99 "
              f"{row['send_lag_ms_p99']:.1f} ms, {row['client_cpu_ms_per_request']:.3f} CPU ms/request "
              f"(one core: {row['one_core_capacity_rps']:.0f} req/s), keeps up: {row['keeps_up']}")
    write_result(args.out, {
        "benchmark": "loadgen_overhead",
        "settings": {"seconds": args.seconds, "adapters": args.adapters, "input_tokens": args.input_tokens,
                     "output_tokens": args.output_tokens, "stub_token_delay_ms": 0},
        "rows": rows,
        "max_rate_kept_up_rps": max((r["offered_rps"] for r in rows if r["keeps_up"]), default=0.0),
    })
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
