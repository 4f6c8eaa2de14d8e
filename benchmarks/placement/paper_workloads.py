"""The paper's placement evaluation workloads (§8.4; rate and rank sets from the study's script).

Rates per adapter are drawn uniformly from the rate set, ranks from the rank set (seeded).
"""

from __future__ import annotations

import numpy as np

from twin.workload import Adapter, Workload

RATE_SETS = {
    "high": (2.4, 1.2, 0.6, 0.3, 0.15),
    "low": (0.075, 0.0375, 0.01875, 0.009375, 0.0046875),
    "mixed": (0.6, 0.3, 0.15, 0.075, 0.0375),
}
RANK_SETS = {"high": (32,), "low": (8,), "mixed": (8, 16, 32)}
#: Mean ShareGPT lengths of the study's evaluation script (reference-study-notes §6).
MEAN_INPUT, MEAN_OUTPUT = 221.67, 196.52


def paper_workload(rates: str, ranks: str, n_adapters: int, seed: int = 0) -> Workload:
    rng = np.random.default_rng([seed, n_adapters])
    r = rng.choice(RATE_SETS[rates], n_adapters)
    k = rng.choice(RANK_SETS[ranks], n_adapters)
    return Workload(tuple(Adapter(f"{rates}-{ranks}-{i:05d}", int(k[i]), float(r[i]), MEAN_INPUT, MEAN_OUTPUT)
                          for i in range(n_adapters)))


def write_csv(workload: Workload, path) -> None:
    from twin.atomic import write_text_atomic

    lines = ["adapter_id,rank,rate_rps,input_tokens,output_tokens"]
    lines += [f"{a.adapter_id},{a.rank},{a.rate_rps},{a.input_tokens},{a.output_tokens}" for a in workload.adapters]
    write_text_atomic(path, "\n".join(lines) + "\n")
