"""GPUs the packer packed and the twin judged: the edge classifier's training set (:mod:`models.edge`).

:func:`collect_judged` plans random fleet workloads (:mod:`twin.families`: each family, size and seed) as
``planner plan`` does by default (greedy with the surrogate, the profile's default bar and judging run)
but without an edge classifier, and keeps every GPU the twin judged in any packing round: its
:data:`models.features.FEATURES` at the load the first packing asks about (:meth:`PackRequest.aim_scale`
at the bar's margin: what the packer will show the classifier) and whether it passed
(:meth:`planner.verdict.TwinCheck.meets`). Repacking rounds add GPUs packed further from the edge, so
the set holds both sides of it.

The set is two files, ``judged-gpus.npz`` (arrays) and ``judged-gpus.json`` (how it was made: profile and
surrogate, bar, judging run, families, sizes, seeds); :func:`matching_set` finds one already made with the
same inputs, so ``planner train-edge`` collects again only when they change.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from models.surrogate import SurrogatePredictor, simulation_hash
from planner.confirm import pack_confirmed
from planner.packing import GpuGroup, PackRequest, group_scenario
from planner.plan import PlanOptions, pack_request
from planner.verdict import TwinCheck
from twin.atomic import write_bytes_atomic, write_json_atomic
from twin.errors import BadInputError
from twin.families import FAMILIES, family_workload
from twin.profile import Profile

ARRAYS_FILE = "judged-gpus.npz"
METADATA_FILE = "judged-gpus.json"
#: The set ``planner train-edge`` collects by default: every family, two fleet sizes, five seeds none of the
#: benchmarks (seeds 0-2) use.
DEFAULT_SIZES = (2_000, 10_000)
DEFAULT_SEEDS = (10, 11, 12, 13, 14)


@dataclass
class JudgedSet:
    X: np.ndarray  # float64 (GPUs, FEATURES) at the first packing's aim
    passed: np.ndarray  # bool: the twin's verdict
    family: np.ndarray  # int: index into metadata["inputs"]["families"]
    adapters: np.ndarray  # int: the workload's size
    seed: np.ndarray  # int: the workload's seed
    round: np.ndarray  # int: the packing round that packed the GPU (1: the first)
    metadata: dict[str, Any]

    ARRAYS = ("X", "passed", "family", "adapters", "seed", "round")

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        np.savez_compressed(buf, **{k: getattr(self, k) for k in self.ARRAYS})
        write_bytes_atomic(directory / ARRAYS_FILE, buf.getvalue())
        write_json_atomic(directory / METADATA_FILE, self.metadata)

    @classmethod
    def load(cls, directory: str | Path) -> JudgedSet:
        directory = Path(directory)
        try:
            meta = json.loads((directory / METADATA_FILE).read_text(encoding="utf-8"))
            with np.load(directory / ARRAYS_FILE, allow_pickle=False) as z:
                arrays = {k: z[k] for k in cls.ARRAYS}
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
            raise BadInputError(f"{directory}: no readable judged-GPU set ({exc})") from None
        return cls(**arrays, metadata=meta)


def inputs_of(profile: Profile, predictor: SurrogatePredictor, opts: PlanOptions, families, sizes, seeds,
              rate_scale: float) -> dict[str, Any]:
    """Everything a judged set depends on (what :func:`matching_set` compares)."""
    return {"profile_id": profile.profile_id, "profile_simulation_hash": simulation_hash(profile, predictor.policy),
            "surrogate_arrays_sha256": predictor.metadata["arrays_sha256"],
            "bar": opts.bar(profile).to_dict(), "run": opts.run.to_dict(), "families": list(families),
            "sizes": list(sizes), "seeds": list(seeds), "rate_scale": rate_scale}


def matching_set(directory: str | Path, inputs: dict[str, Any]) -> JudgedSet | None:
    """The judged set in ``directory`` when it was made from exactly ``inputs``, else None."""
    try:
        found = JudgedSet.load(directory)
    except BadInputError:
        return None
    return found if found.metadata.get("inputs") == inputs else None


def collect_judged(profile: Profile, predictor: SurrogatePredictor, families=tuple(FAMILIES), sizes=DEFAULT_SIZES,
                   seeds=DEFAULT_SEEDS, jobs: int = 1, rate_scale: float = 1.0,
                   progress: Callable[[str], None] | None = None) -> JudgedSet:
    """Plan each (family, size, seed) workload and keep every GPU the twin judged (module docstring)."""
    opts = PlanOptions(jobs=jobs)
    bar, run = opts.bar(profile), opts.run
    rows: dict[str, list] = {k: [] for k in JudgedSet.ARRAYS}
    t0 = time.perf_counter()
    for f, family in enumerate(families):
        for n in sizes:
            for seed in seeds:
                workload = family_workload(family, n, seed, rate_scale, profile.engine.max_model_len)
                req = replace(pack_request(workload, profile, predictor, opts), edge=False)
                rounds: list[tuple[list[GpuGroup], TwinCheck]] = []
                pack_confirmed(req, run=run, bar=bar, observe=lambda g, c, seen=rounds: seen.append((g, c)))
                for r, (groups, check) in enumerate(rounds, 1):
                    rows["X"].append(predictor.features(aimed(req, groups)))
                    rows["passed"].append(check.meets(bar))
                    for key, value in (("family", f), ("adapters", n), ("seed", seed), ("round", r)):
                        rows[key].append(np.full(len(groups), value))
                if progress:
                    judged = sum(len(g) for g, _ in rounds)
                    progress(f"{family} x {n:,} (seed {seed}): {judged} GPUs judged in {len(rounds)} rounds")
    arrays = {k: np.concatenate(v) for k, v in rows.items()}
    inputs = inputs_of(profile, predictor, opts, families, sizes, seeds, rate_scale)
    meta = {"inputs": inputs, "gpus": len(arrays["passed"]), "passed": int(arrays["passed"].sum()),
            "wall_s": round(time.perf_counter() - t0, 1)}
    return JudgedSet(**arrays, metadata=meta)


def aimed(req: PackRequest, groups: list[GpuGroup]):
    """The scenarios of ``groups`` at the load the first packing of ``req`` asks about."""
    return [group_scenario(req, g.shares, g.a_max, req.aim_scale(g.shares), max_lora_rank=g.max_lora_rank)
            for g in groups]
