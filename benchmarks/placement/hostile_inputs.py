"""Every hostile-input reproducer of tests/hostile_cases.py as a real `planner` process.

Each case's files go into a fresh directory, its command runs there as a new process with no stdin and a
stub ``python`` and ``vllm`` first on PATH (so a value that escaped into a command line would run them
and leave a mark), and the result is recorded: exit code, the lines of output, whether a traceback
appeared, whether anything was written, whether a stub ran. Target: every case exits 2 with one line,
no traceback, nothing written, no stub run.

    python -m benchmarks.placement.hostile_inputs        # -> artifacts/benchmarks/hostile_inputs.json
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.record import result_path, write_result
from tests.hostile_cases import cases

ROOT = Path(__file__).resolve().parents[2]

STUB = "#!/bin/sh\ntouch \"$STUB_MARK\"\n"


def listing(d: Path) -> dict[str, int]:
    return {str(p.relative_to(d)): p.stat().st_size for p in sorted(d.rglob("*")) if "stub-bin" not in p.parts}


def render_injection() -> dict:
    """A workload file and an --adapter-dir named with a newline and a command, and a model name with a
    command substitution: the rendered launch script is run by bash with the stub ``python``; nothing but the
    stub may run (no ``pwned*`` file appears)."""
    from tests.hostile_cases import GOOD_CSV

    with tempfile.TemporaryDirectory(prefix="hostile-render-") as tmp:
        d = Path(tmp)
        (d / "w\ntouch pwned-by-workload #.csv").write_text(GOOD_CSV)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        planner = [sys.executable, "-m", "planner.cli"]
        subprocess.run([*planner, "plan", "w\ntouch pwned-by-workload #.csv", "--out", "plan.json"], cwd=d, env=env,
                       check=True, capture_output=True, stdin=subprocess.DEVNULL)
        script = subprocess.run([*planner, "render", "plan.json", "--format", "vllm", "--model", "$(touch pwned-by-model)",
                                 "--adapter-dir", "/srv/a\ntouch pwned-by-dir #"], cwd=d, env=env, check=True,
                                capture_output=True, text=True, stdin=subprocess.DEVNULL).stdout
        (d / "launch.sh").write_text(script + "\nwait\n")
        bin_dir = d / "stub-bin"
        bin_dir.mkdir()
        stub = bin_dir / "python"
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
        subprocess.run(["bash", "launch.sh"], cwd=d, env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
                       check=True, timeout=120)
        pwned = sorted(p.name for p in d.glob("pwned*"))
    return {"case": "render/injection", "exit": 0, "lines": None, "traceback": False, "wrote": False,
            "stub_ran": False, "message": f"files a command made: {pwned or 'none'}", "ok": not pwned}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=result_path("hostile_inputs"))
    args = ap.parse_args()
    rows = []
    for case in cases():
        with tempfile.TemporaryDirectory(prefix="hostile-") as tmp:
            d = Path(tmp)
            case.files(d)
            bin_dir = d / "stub-bin"
            bin_dir.mkdir()
            for name in ("python", "vllm"):
                stub = bin_dir / name
                stub.write_text(STUB)
                stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
            before = listing(d)
            mark = d.parent / f"{d.name}.stub-ran"
            env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_MARK": str(mark),
                   "PYTHONPATH": str(ROOT)}
            proc = subprocess.run([sys.executable, "-m", "planner.cli", *case.argv], cwd=d, env=env, text=True,
                                  capture_output=True, stdin=subprocess.DEVNULL, check=False, timeout=600)
            out = (proc.stdout + proc.stderr).strip().splitlines()
            row = {"case": case.name, "exit": proc.returncode, "lines": len(out), "traceback": "Traceback" in proc.stderr,
                   "wrote": listing(d) != before, "stub_ran": mark.exists(), "message": out[-1][:300] if out else ""}
            row["ok"] = row["exit"] == 2 and row["lines"] == 1 and not (row["traceback"] or row["wrote"] or row["stub_ran"])
            mark.unlink(missing_ok=True)
        rows.append(row)
        print(("ok   " if row["ok"] else "FAIL ") + f"{case.name}: exit {row['exit']}: {row['message'][:120]}", flush=True)
    rows.append(render_injection())
    print(("ok   " if rows[-1]["ok"] else "FAIL ") + rows[-1]["case"], flush=True)
    summary = {"cases": len(rows), "ok": sum(r["ok"] for r in rows), "exit_2": sum(r["exit"] == 2 for r in rows),
               "tracebacks": sum(r["traceback"] for r in rows), "wrote_something": sum(r["wrote"] for r in rows),
               "stub_ran": sum(r["stub_ran"] for r in rows)}
    write_result(args.out, {"benchmark": "hostile_inputs", "summary": summary, "cases": rows})
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
