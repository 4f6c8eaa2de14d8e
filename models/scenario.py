"""What the planner asks: given one GPU's adapters and ``--max-loras``, what throughput, does it starve, and
what latency? A :class:`Predictor` answers for a batch of :class:`GpuScenario` (backends: ``models.predictor``).

Memory feasibility is not a prediction: callers check ``twin.policies.kv_capacity(profile,
policy).tokens_for`` first; a scenario the engine cannot start with raises
:class:`twin.errors.InfeasibleError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from twin.policies.spec import PolicySpec


@dataclass(frozen=True)
class GpuScenario:
    """One GPU's load: per-adapter ranks, rates and mean lengths, and the A_max it runs with."""

    ranks: np.ndarray  # int64, one per adapter
    rates_rps: np.ndarray  # float64
    input_tokens: np.ndarray  # float64 mean prompt tokens per adapter
    output_tokens: np.ndarray  # float64 mean output tokens per adapter
    a_max: int
    max_lora_rank: int | None = None  # None: the smallest profiled rank holding every adapter
    # The latency SLO the GPU must meet (the strictest of its adapters'); inf: none.
    max_ttft_ms: float = float("inf")  # p99 time to first token over every arrival
    max_tpot_ms: float = float("inf")  # p99 time per output token over finished requests

    @property
    def arriving_tok_s(self) -> float:
        return float(np.dot(self.rates_rps, self.input_tokens + self.output_tokens))

    def __len__(self) -> int:
        return int(self.ranks.shape[0])


@dataclass(frozen=True)
class Predictions:
    throughput_tok_s: np.ndarray  # float64, one per scenario
    starved: np.ndarray  # bool
    arriving_tok_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # Latency, where the predictor gives it (None otherwise): p99 TTFT over every arrival
    # (``SimResult.ttft_ms_p99_all``) and p99 time per output token; from the twin, also mean ITL.
    ttft_ms_p99_all: np.ndarray | None = None
    tpot_ms_p99: np.ndarray | None = None
    itl_ms_mean: np.ndarray | None = None
    ttft_ms_p999_all: np.ndarray | None = None  # from the twin: p99.9 TTFT over every arrival
    # from a judging run: p99.9 TTFT and p99 TPOT within its bounds (planner.verdict)
    within_bounds: np.ndarray | None = None
    passes_edge: np.ndarray | None = None  # from a surrogate's edge classifier (models.edge): the packer may take

    def meets_latency(self, scenarios: Sequence[GpuScenario]) -> np.ndarray:
        """Which scenarios are predicted within their latency SLO (true where a figure is not predicted)."""
        ok = np.ones(len(scenarios), bool)
        for figure, limit in ((self.ttft_ms_p99_all, "max_ttft_ms"), (self.tpot_ms_p99, "max_tpot_ms")):
            if figure is not None:
                ok &= ~(figure > np.array([getattr(s, limit) for s in scenarios]))  # NaN (no request): no miss
        return ok if self.within_bounds is None else ok & self.within_bounds


class Predictor(Protocol):
    profile_id: str
    kind: str
    policy: PolicySpec | None

    def predict(self, scenarios: Sequence[GpuScenario]) -> Predictions: ...
