"""A capacity-only predictor for hand-checkable packing cases, and workload builders.

``CapacityPredictor`` says a GPU delivers min(arriving, capacity) tokens/s, so with the
starvation rule (throughput < 0.9 x arriving) a GPU keeps up while arriving <= capacity / 0.9.
It tests the packers' logic, not serving fidelity (that is the twin's job).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from models.scenario import Predictions
from twin.workload import Adapter, Workload


@dataclass
class CapacityPredictor:
    capacity_tok_s: float = 1000.0
    profile_id: str = "test"
    kind: str = "capacity"
    calls: int = 0

    def predict(self, scenarios):
        self.calls += len(scenarios)
        arriving = np.array([s.arriving_tok_s for s in scenarios])
        thr = np.minimum(arriving, self.capacity_tok_s)
        return Predictions(thr, thr < 0.9 * arriving, arriving)


def workload(rates, ranks=None, tokens=(60.0, 40.0)) -> Workload:
    ranks = ranks or [8] * len(rates)
    return Workload(tuple(Adapter(f"ad-{i}", r, float(x), tokens[0], tokens[1])
                          for i, (x, r) in enumerate(zip(rates, ranks))))
