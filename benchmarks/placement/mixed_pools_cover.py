"""What the pool benchmark's result files show together: the latest run of each case, one table, one summary.

``benchmarks/placement/mixed_pools.py`` runs for minutes per 10,000-adapter case, so its grid is measured a
few cases at a time, each into its own file. This reads them all (default: every
``artifacts/benchmarks/mixed_pools*.json``), keeps for each case (adapters, family, seed, kinds) the run with
the latest date, and prints per case the plans that exit 0, GPUs failing in ``evaluate --seed 1``, plans
costing more than the best single kind, the largest saving and wall ratio, the commit it ran at, and how many
commits since then changed the planning code (``planner/``, ``models/``, ``twin/``): a case measured before
such a change says nothing certain about the code as it is. The summary
over those cases is ``mixed_pools.summary``'s, overall and per size.

    python -m benchmarks.placement.mixed_pools_cover [FILES ...] [--out cover.json]

A run recorded before the wall target counted a refusing kind's share has no ``wall_over_kinds_sum``; where
no kind refused it is the same as ``wall_over_singles_sum``, which is used (elsewhere it stays unknown).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from functools import cache
from pathlib import Path

from benchmarks.placement.mixed_pools import TARGET_WALL_RATIO, summary
from benchmarks.record import RESULTS, ROOT, write_result

#: The code a pool plan depends on: a run at a commit where these differ from HEAD measured other code.
PLANNING_CODE = ("planner", "models", "twin")


def latest_cases(paths: list[Path]) -> list[dict]:
    """Each case's row from the file with the latest run date, tagged with that file, commit and date."""
    best: dict[tuple, dict] = {}
    for path in paths:
        doc = json.loads(path.read_text())
        if doc.get("benchmark") != "mixed_pools":
            continue
        run = doc["run"]
        for row in doc["cases"]:
            key = (row["adapters"], row["family"], row["seed"], tuple(doc["kinds"]))
            if key not in best or run["date"] > best[key]["date"]:
                best[key] = {**row, "kinds": list(doc["kinds"]), "file": path.name, "commit": run["commit"],
                             "date": run["date"]}
    for row in best.values():
        refused = any(s["exit"] == 2 for s in row["singles"].values())
        for p in row["pools"]:
            if "wall_over_kinds_sum" not in p:
                p["wall_over_kinds_sum"] = None if refused else p["wall_over_singles_sum"]
    return sorted(best.values(), key=lambda r: (len(r["kinds"]), r["adapters"], r["family"], r["seed"]))


@cache
def changes_since(commit: str | None) -> int | None:
    """Commits since ``commit`` (a ``-dirty`` run counts as its commit) that changed the planning code; None
    where git cannot tell. Asked once per commit: most cases of a result file share one."""
    if not commit:
        return None
    since = f"{commit.removesuffix('-dirty')}..HEAD"
    proc = subprocess.run(["git", "--no-optional-locks", "rev-list", "--count", since, "--", *PLANNING_CODE],
                          cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
    return int(proc.stdout) if proc.returncode == 0 and proc.stdout.strip().isdigit() else None


def case_line(row: dict) -> dict:
    pools = row["pools"]
    ok = [p for p in pools if p["exit"] == 0]
    walls = [p["wall_over_kinds_sum"] for p in pools if p["wall_over_kinds_sum"] is not None]
    savings = [p["saving"] for p in ok if p.get("saving") is not None]
    return {"adapters": row["adapters"], "family": row["family"], "seed": row["seed"], "kinds": row["kinds"],
            "price_sets": [p["price_set"] for p in pools], "exit_0": len(ok), "plans": len(pools),
            "evaluate_failing": sum(p.get("evaluate_failing") or 0 for p in ok),
            "over_best_single": sum(p.get("holds") is False for p in ok),
            "max_saving": max(savings, default=None), "max_wall_ratio": max(walls, default=None),
            "commit": row["commit"], "code_changes_since": changes_since(row["commit"]), "file": row["file"]}


def table(lines: list[dict]) -> str:
    head = (f"{'adapters':>8}  {'family':<13} {'seed':>4}  {'kinds':<22} {'exit 0':>6} {'failing':>7} "
            f"{'over best':>9} {'saving':>7} {'wall x':>6}  {'commit':<14} code changes since")
    out = [head]
    for c in lines:
        since = "?" if c["code_changes_since"] is None else c["code_changes_since"]
        saving = "-" if c["max_saving"] is None else f"{c['max_saving']:.1%}"
        wall = "?" if c["max_wall_ratio"] is None else f"{c['max_wall_ratio']:.2f}"
        out.append(f"{c['adapters']:>8,}  {c['family']:<13} {c['seed']:>4}  {','.join(c['kinds']):<22} "
                   f"{c['exit_0']:>3}/{c['plans']:<2} {c['evaluate_failing']:>7} {c['over_best_single']:>9} "
                   f"{saving:>7} {wall:>6}  {c['commit'] or '?':<14} {since}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", type=Path, default=sorted(RESULTS.glob("mixed_pools*.json")),
                    help="mixed_pools result files (default: every artifacts/benchmarks/mixed_pools*.json)")
    ap.add_argument("--out", type=Path, default=None, help="also write the table and summaries as JSON here")
    args = ap.parse_args()
    missing = [str(p) for p in args.files if not p.is_file()]
    if missing:
        raise SystemExit(f"no such file: {', '.join(missing)}")
    rows = latest_cases(args.files)
    if not rows:
        raise SystemExit("no mixed_pools cases in the files given")
    lines = [case_line(r) for r in rows]
    print(table(lines))
    sizes = sorted({r["adapters"] for r in rows})
    result = {"benchmark": "mixed_pools_cover", "files": [p.name for p in args.files],
              "target_wall_ratio": TARGET_WALL_RATIO, "cases": lines, "summary": summary(rows),
              "by_size": {str(n): summary([r for r in rows if r["adapters"] == n]) for n in sizes},
              "cases_with_code_changes_since": sum(bool(c["code_changes_since"]) for c in lines)}
    print(json.dumps({k: result[k] for k in ("summary", "cases_with_code_changes_since")}, indent=1))
    if args.out is not None:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
