"""Do this checkout and an earlier commit give the same plans and twin results? The check behind a refactor.

Checks out ``--against`` (a commit, branch or tag) into a temporary git worktree and runs, in each tree
with this Python, ``planner plan --predictor twin --json`` (the twin packs and judges: no surrogate
artifact in the comparison) and ``planner simulate --a-max 8 --json`` (stock vLLM; each other serving
policy, and ELORA on multi-turn chat, for 600 simulated s) on every example workload of
``datasets/workloads/``. Outputs are compared after dropping what a run cannot repeat: wall times and the
creation time. Identical outputs mean the code between the two commits did not change what the planner
and the twin compute.

    python -m benchmarks.placement.same_outputs --against 49ba7c3   # -> artifacts/benchmarks/same_outputs.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.record import result_path, write_result

ROOT = Path(__file__).resolve().parents[2]
UNREPEATABLE = {"wall_s", "plan_wall_s", "sim_wall_s", "created_utc"}
POLICIES = ("slora", "chameleon", "toppings", "elora")


def _strip(obj):
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in UNREPEATABLE}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def outputs(tree: Path) -> dict[str, object]:
    """Every command's JSON output in ``tree``, less what cannot repeat."""
    out = {}
    for csv in sorted((ROOT / "datasets" / "workloads").glob("*.csv")):
        runs = [("plan", ["plan", str(csv), "--predictor", "twin", "--json"]),
                ("simulate", ["simulate", str(csv), "--a-max", "8", "--json"])]
        # The policy loops scan their queues each step: 10 simulated minutes keep overloaded workloads quick.
        short = ["--a-max", "8", "--duration", "600", "--json"]
        runs += [(f"simulate --policy {p}", ["simulate", str(csv), "--policy", p, *short]) for p in POLICIES]
        runs.append(("simulate --policy elora --turns 3", ["simulate", str(csv), "--policy", "elora", "--turns", "3",
                                                            *short]))
        for name, args in runs:
            proc = subprocess.run([sys.executable, "-m", "planner.cli", *args], cwd=tree, capture_output=True,
                                  text=True, stdin=subprocess.DEVNULL, check=False)
            out[f"{name} {csv.name}"] = (_strip(json.loads(proc.stdout)) if proc.returncode == 0
                                         else {"exit": proc.returncode, "stderr": proc.stderr.strip()[-300:]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", required=True, help="the commit to compare with")
    ap.add_argument("--out", type=Path, default=result_path("same_outputs"))
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", args.against], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="same-outputs-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), commit], cwd=ROOT, check=True)
        try:
            before = outputs(tree)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    after = outputs(ROOT)
    differ = sorted(k for k in after if after[k] != before.get(k))
    result = {"benchmark": "same_outputs", "against": commit, "compared": len(after), "identical": not differ,
              "differ": differ}
    write_result(args.out, result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
