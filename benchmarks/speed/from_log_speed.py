"""`planner workload from-log` on a large request log: wall time, log lines/s and peak memory on one core.

    python -m benchmarks.speed.from_log_speed [--size 1GB] [--adapters 1000] [--days 7]

Writes a gateway log of about ``--size`` into a temporary directory (a week of times, slightly out of order;
``--adapters`` models; lines mixed as gateways write them: 70 % epoch seconds with an OpenAI ``usage``
object, 20 % ISO 8601 times with top-level token counts, 10 % LiteLLM-like rows with epoch milliseconds,
extra keys and no completion tokens), then runs the command in a fresh process pinned to one core
(``taskset -c 0``), its stderr on a pseudo-terminal so the progress bar is drawn as a user sees it. A first
run on a small log compiles the scanner (numba caches it on disk), so the timed run is a warm one, as every
nightly run after the first. Peak memory is the child's max RSS. Targets: >= 1 M lines/s, <= 2 GB.
Writes artifacts/benchmarks/from_log_speed.json (``--out``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import fcntl
import os
import pty
import shutil
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.record import result_path, write_result

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_733_000_000.0
BLOCK = 200_000  # lines formatted at once


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().removesuffix("b")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def write_log(path: Path, size: int, adapters: int, days: float, seed: int = 0) -> int:
    """A mixed gateway log of about ``size`` bytes; returns its lines."""
    rng = np.random.default_rng(seed)
    written = lines = 0
    per_line = 115  # bytes, about
    total = max(1, size // per_line)
    with path.open("w") as f:
        while written < size:
            n = BLOCK
            k = lines + np.arange(n)
            t = T0 + k * (days * 86400.0 / total) + rng.normal(0.0, 30.0, n)  # a little out of order
            model = rng.integers(0, adapters, n)
            prompt = rng.integers(1, 4000, n)
            completion = rng.integers(1, 800, n)
            kind = rng.random(n)
            out = []
            for x, m, p, c, u in zip(t.tolist(), model.tolist(), prompt.tolist(), completion.tolist(), kind.tolist()):
                if u < 0.7:
                    out.append(f'{{"timestamp": {x:.3f}, "model": "adapter-{m}", "usage": {{"prompt_tokens": {p}, '
                               f'"completion_tokens": {c}}}}}\n')
                elif u < 0.9:
                    stamp = dt.datetime.fromtimestamp(x, dt.UTC).isoformat(timespec="milliseconds")
                    out.append(f'{{"time":"{stamp.replace("+00:00", "Z")}","model":"adapter-{m}",'
                               f'"prompt_tokens":{p},"completion_tokens":{c}}}\n')
                else:
                    out.append(f'{{"request_id": "r{lines}", "created": {int(x * 1000)}, "model": "adapter-{m}", '
                               f'"status": "ok", "usage": {{"prompt_tokens": {p}, "total_tokens": {p}}}}}\n')
            block = "".join(out)
            f.write(block)
            written += len(block)
            lines += n
    return lines


def run(cmd: list[str], tty: bool) -> dict:
    """Run ``cmd`` (its stderr on a pseudo-terminal if ``tty``): wall seconds, exit code, its own peak RSS,
    output, and what its progress bar drew."""
    master, slave = pty.openpty() if tty else (None, None)
    if tty:  # a terminal 100 columns wide (a fresh one says 0, and tqdm would draw nothing)
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    seen: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            seen.append(data)

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=slave if tty else err)
        if tty:
            os.close(slave)
            reader = threading.Thread(target=drain, daemon=True)
            reader.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if tty:
            reader.join(timeout=5)
            os.close(master)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), (b"".join(seen) if tty else err.read()).decode("utf-8", "replace")
    frames = [s.strip() for s in stderr.replace("\r", "\n").splitlines() if "reading logs" in s]
    return {"wall_s": wall, "rc": proc.returncode, "peak_rss_mb": usage.ru_maxrss / 1024,
            "cpu_s": usage.ru_utime + usage.ru_stime, "stdout": stdout.strip(),
            "stderr_tail": stderr[-300:] if proc.returncode else "", "progress_frames": len(frames),
            "last_progress": frames[-1] if frames else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GB", help="log size, e.g. 1GB, 200MB")
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--gzip", action="store_true", help="also time the log gzipped")
    parser.add_argument("--no-tty", dest="tty", action="store_false", help="stderr on a pipe: no progress bar")
    parser.add_argument("--out", type=Path, default=result_path("from_log_speed"))
    args = parser.parse_args()
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    planner = [sys.executable, "-m", "planner.cli", "workload", "from-log"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        small = tmp / "small.jsonl"
        write_log(small, 2 << 20, args.adapters, 1.0)
        compile_run = run([*pin, *planner, str(small), "--default-rank", "16", "--base-model", "none",
                           "--out", str(tmp / "w0.csv")], tty=False)
        log = tmp / "gateway.jsonl"
        t0 = time.perf_counter()
        lines = write_log(log, _size(args.size), args.adapters, args.days)
        gen_s = time.perf_counter() - t0
        size = log.stat().st_size
        cases = {"jsonl": log}
        if args.gzip:
            subprocess.run(["gzip", "-k", "-1", str(log)], check=True)
            cases["jsonl.gz"] = Path(f"{log}.gz")
        results = {}
        for name, path in cases.items():
            r = run([*pin, *planner, str(path), "--default-rank", "16", "--base-model", "none", "--out",
                     str(tmp / f"w-{name}.csv")], tty=args.tty)
            r.update(bytes_on_disk=path.stat().st_size, lines_per_s=lines / r["wall_s"],
                     lines_per_cpu_s=lines / r["cpu_s"], mb_per_s=size / r["wall_s"] / 1e6)
            results[name] = r
            print(f"{name}: {lines:,} lines ({size / 1e9:.2f} GB) in {r['wall_s']:.1f} s = "
                  f"{r['lines_per_s'] / 1e6:.2f} M lines/s ({r['lines_per_cpu_s'] / 1e6:.2f} per CPU s), peak RSS {r['peak_rss_mb']:.0f} MB, rc {r['rc']}; "
                  f"{r['stdout']}", flush=True)
    write_result(args.out, {
        "benchmark": "from_log_speed", "log_bytes": size, "log_lines": lines, "adapters": args.adapters,
        "days": args.days, "pinned": " ".join(pin) or None, "generate_s": gen_s,
        "compile_run_s": compile_run["wall_s"], "targets": {"lines_per_s": 1e6, "peak_rss_mb": 2048},
        "results": results})


if __name__ == "__main__":
    main()
