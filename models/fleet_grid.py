"""The ``fleet`` scenario grid: GPU fills like the ones the packer asks about on real fleets.

The paper grid spreads three rates and three ranks round-robin over 8-384 adapters; a planner run
on a fleet asks about something else: a run of adapters from a workload's queue, with the rates of a
real population (log-uniform, Zipf, a hot adapter's share, thousands near idle, mixed lengths), and
loaded close to what one GPU serves, where a surrogate's error decides whether a GPU meets its SLO.
Each scenario of this grid:

1. draws a workload of ``adapters_per_workload`` adapters from one of ``families``
   (:mod:`twin.families`, the family chosen round-robin over scenario ids);
2. orders it as a packer's queue does, rank groups largest first, and shuffles each group;
3. takes a window of that queue from a random position, as long as it takes for its arriving tokens
   to reach a load fraction drawn uniformly from ``load_range`` of one GPU's nominal capacity
   (:func:`nominal_capacity_tok_s`), at most ``max_served`` adapters (one adapter hotter than that
   load is cut to it, as a replica's share of its traffic is);
4. runs it at an A_max drawn uniformly among those that start in memory (the profiled points below
   its adapter count, and the count itself).

Every draw comes from ``SeedSequence([seed, scenario_id])``, so a row rebuilds alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from models.features import engine_terms, saturation_tok_s
from twin.errors import BadInputError
from twin.families import FAMILIES, family_workload
from twin.policies.memory import kv_capacity
from twin.policies.spec import PolicySpec
from twin.profile import Profile


@dataclass(frozen=True)
class FleetGrid:
    name: str = "fleet"
    scenarios: int = 12_000
    families: tuple[str, ...] = tuple(FAMILIES)
    adapters_per_workload: int = 2_000
    load_range: tuple[float, float] = (0.2, 1.0)
    max_served: int = 1_024
    length_scale: tuple[float, float] = (0.5, 2.0)  # families without lengths of their own: × profile defaults
    duration_s: float = 3600.0
    seed: int = 0
    max_in_flight: int = 0
    kind: str = "fleet"

    @classmethod
    def from_dict(cls, raw: Any, where: str = "grid") -> FleetGrid:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise BadInputError(f"{where}: unknown fleet grid keys {unknown} (known: {sorted(known)})")
        grid = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
        grid.validate(where)
        return grid

    def validate(self, where: str = "grid") -> None:
        bad = [f for f in self.families if f not in FAMILIES]
        if bad or not self.families:
            raise BadInputError(f"{where}: families must name some of {', '.join(FAMILIES)} (got {bad or 'none'})")
        for name in ("load_range", "length_scale"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi < float("inf"):
                raise BadInputError(f"{where}: {name} must be [lo, hi] with 0 < lo <= hi")
        if min(self.scenarios, self.adapters_per_workload, self.max_served) < 1 or not self.duration_s > 0:
            raise BadInputError(f"{where}: scenarios, adapters_per_workload, max_served and duration_s must be > 0")

    def to_dict(self) -> dict[str, Any]:
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        if not d["max_in_flight"]:
            del d["max_in_flight"]
        return d

    def points(self) -> list[int]:
        return list(range(self.scenarios))

    def spec(self, profile: Profile, scenario_id: int, point, policy: PolicySpec | None = None) -> dict[str, Any]:
        """The scenario's spec (see the module docstring); lengths are per adapter."""
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, scenario_id]))
        family = self.families[scenario_id % len(self.families)]
        wl = family_workload(family, self.adapters_per_workload, int(rng.integers(2**31)),
                             max_model_len=profile.engine.max_model_len)
        ranks = wl.ranks
        rates = np.array([a.rate_rps for a in wl.adapters])
        lo, hi = np.log(self.length_scale[0]), np.log(self.length_scale[1])
        d_in = profile.default_input_tokens * np.exp(rng.uniform(lo, hi))
        d_out = profile.default_output_tokens * np.exp(rng.uniform(lo, hi))
        ins = np.array([a.input_tokens or d_in for a in wl.adapters]).round(1)
        outs = np.array([a.output_tokens or d_out for a in wl.adapters]).round(1)
        queue = np.lexsort((rng.random(ranks.shape[0]), -ranks))  # rank groups largest first, shuffled within
        loads = rates[queue] * (ins[queue] + outs[queue])
        target = rng.uniform(*self.load_range) * nominal_capacity_tok_s(profile)
        pos = int(rng.integers(queue.shape[0]))
        cum = np.cumsum(loads[pos:])
        k = int(min(np.searchsorted(cum, target) + 1, self.max_served, cum.shape[0]))
        idx = queue[pos:pos + k]
        rates = rates[idx]
        if k == 1 and loads[pos] > target:
            rates = rates * (target / loads[pos])
        capacity = kv_capacity(profile, policy)
        max_lora_rank = profile.kv.rank_for(int(ranks[idx].max()))
        limit = capacity.max_a_max(max_lora_rank) if max_lora_rank is not None else 0
        top = min(k, limit)
        choices = sorted({p for p in capacity.a_max_points if p < top} | {top}) if top >= 1 else [max(1, k)]
        a_max = int(rng.choice(choices))
        kv_tokens = None if max_lora_rank is None else capacity.tokens_for(a_max, max_lora_rank)
        return {
            "scenario_id": scenario_id, "profile_id": profile.profile_id, "seed": int(rng.integers(2**31)),
            "served_adapters": k, "a_max": a_max, "max_lora_rank": max_lora_rank or 0,
            "ranks": ranks[idx].astype(np.int64), "rates_rps": rates.astype(np.float64),
            "input_tokens": float(np.average(ins[idx], weights=rates)) if rates.sum() > 0 else float(ins[idx].mean()),
            "output_tokens": float(np.average(outs[idx], weights=rates)) if rates.sum() > 0 else float(outs[idx].mean()),
            "adapter_input_tokens": ins[idx], "adapter_output_tokens": outs[idx],
            "duration_s": self.duration_s, "kv_tokens": kv_tokens or 0, "memory_error": kv_tokens is None,
        }


def nominal_capacity_tok_s(profile: Profile) -> float:
    """What one GPU of ``profile`` serves with its queue full at the default lengths and one adapter: the
    scale a fleet grid's load fractions are drawn against."""
    kv = profile.kv.no_lora_tokens
    return float(saturation_tok_s(engine_terms(profile), profile.default_input_tokens,
                                  profile.default_output_tokens, 1.0, float(kv)))
