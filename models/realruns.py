"""The study's real single-GPU runs (``real_runs_qwen.csv``) as scenarios the surrogates can score.

Each run becomes what a user would give the planner: adapter ranks (from the per-rank counts),
rates (from ``rate_counts``; the rank↔rate pairing was not logged, so it is shuffled with a fixed
seed, as benchmarks/fidelity/twin_fidelity.py does), the prompt pool's mean lengths, A_max and S_max.
Only runs with ``status == ok`` are kept.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.scenario import GpuScenario
from twin.errors import BadInputError

REQUIRED = ("status", "n_rank_8", "n_rank_16", "n_rank_32", "rate_counts", "pool_mean_in", "pool_mean_out",
            "A_max", "S_max", "total_throughput", "starved", "arrived_token_rate_est")


@dataclass
class RealRuns:
    scenarios: list[GpuScenario]
    throughput: np.ndarray
    starved: np.ndarray
    arriving_tok_s: np.ndarray  # measured arriving token rate (for the trivial predictor)


def load_real_runs(path: str | Path, seed: int = 0) -> RealRuns:
    path = Path(path)
    try:
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInputError(f"{path}: cannot read real runs ({exc})") from None
    missing = [c for c in REQUIRED if rows and c not in rows[0]]
    if not rows or missing:
        raise BadInputError(f"{path}: not a real-runs CSV (missing columns {missing or list(REQUIRED)})")
    rng = np.random.default_rng(seed)
    scenarios, thr, starved, arriving = [], [], [], []
    for row in rows:
        if row["status"] != "ok":
            continue
        ranks = np.repeat([8, 16, 32], [int(row["n_rank_8"]), int(row["n_rank_16"]), int(row["n_rank_32"])])
        rates = np.concatenate([np.full(int(c), float(v)) for v, c in
                                (item.split(":") for item in row["rate_counts"].split())])
        rng.shuffle(rates)
        n = ranks.shape[0]
        scenarios.append(GpuScenario(ranks.astype(np.int64), rates, np.full(n, float(row["pool_mean_in"])),
                                     np.full(n, float(row["pool_mean_out"])), int(row["A_max"]), int(row["S_max"])))
        thr.append(float(row["total_throughput"]))
        starved.append(row["starved"] == "1")
        arriving.append(float(row["arrived_token_rate_est"]))
    return RealRuns(scenarios, np.array(thr), np.array(starved), np.array(arriving))
