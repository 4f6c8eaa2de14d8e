"""Run every GPU of a placement in the digital twin: throughput, arriving rate, starvation, memory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from planner.placement import Placement
from twin.policies.memory import kv_capacity
from twin.policies.spec import policy_record
from twin.profile import Profile
from twin.simulate import SimConfig, SimResult, simulate
from twin.workload import Adapter, Workload


@dataclass
class InstanceEvaluation:
    instance_id: str
    adapters: int
    a_max: int
    max_lora_rank: int
    memory_ok: bool
    predicted_throughput_tok_s: float | None
    result: SimResult | None  # None on a memory error or when no adapter routes traffic here

    @property
    def starved(self) -> bool | None:
        return None if self.result is None else self.result.starved

    def to_dict(self) -> dict[str, Any]:
        r = self.result
        return {
            "instance_id": self.instance_id, "adapters": self.adapters, "a_max": self.a_max,
            "max_lora_rank": self.max_lora_rank, "memory_ok": self.memory_ok,
            "predicted_throughput_tok_s": self.predicted_throughput_tok_s,
            "throughput_tok_s": None if r is None else r.total_throughput_tok_s,
            "arriving_tok_s": None if r is None else r.arriving_tok_s,
            "starved": self.starved,
            "itl_ms_mean": None if r is None else r.itl_ms_mean,
            "ttft_ms_p99": None if r is None else r.ttft_ms_p99,
            "preemptions": None if r is None else r.preemptions,
        }


@dataclass
class Evaluation:
    instances: list[InstanceEvaluation]
    unplaced: list[str]  # workload adapters no instance serves
    missing: list[str]  # placed adapters absent from the workload (evaluated with no traffic)
    policy: dict[str, Any] | None = None  # the serving policy simulated (policy_record); None: stock vLLM

    @property
    def ok(self) -> bool:
        return not self.unplaced and all(i.memory_ok and not i.starved for i in self.instances)

    def to_dict(self) -> dict[str, Any]:
        return {
            **({} if self.policy is None else {"policy": self.policy}),
            "ok": self.ok, "gpus": len(self.instances),
            "memory_errors": sum(not i.memory_ok for i in self.instances),
            "starving": sum(bool(i.starved) for i in self.instances),
            "unplaced_adapters": self.unplaced, "adapters_not_in_workload": self.missing,
            "instances": [i.to_dict() for i in self.instances],
        }


def evaluate_placement(placement: Placement, workload: Workload, profile: Profile, config: SimConfig,
                       progress: Callable[[int, int, str], None] | None = None) -> Evaluation:
    """Simulate each instance serving its adapters' share of ``workload``'s traffic.

    ``config.a_max`` and ``config.max_lora_rank`` are replaced by each instance's settings; every
    instance runs ``config.policy`` (None: stock vLLM), which also decides which --max-loras start.
    """
    capacity = kv_capacity(profile, config.policy)
    by_id = {a.adapter_id: a for a in workload.adapters}
    planned = {a["adapter_id"]: a for a in placement.adapters}
    placed = {aid for inst in placement.instances for aid in inst.adapters}
    out: list[InstanceEvaluation] = []
    for k, inst in enumerate(placement.instances):
        if progress:
            progress(k, len(placement.instances), inst.instance_id)
        adapters = []
        for aid, share in inst.adapters.items():
            a, plan = by_id.get(aid), planned[aid]
            if a is None:  # not in this workload: served, but with no traffic
                adapters.append(Adapter(aid, int(plan["rank"]), 0.0, plan["input_tokens"], plan["output_tokens"]))
            else:  # the workload's lengths, else the ones the plan was made with
                adapters.append(Adapter(aid, a.rank, a.rate_rps * share, a.input_tokens or plan["input_tokens"],
                                        a.output_tokens or plan["output_tokens"]))
        memory_ok = capacity.tokens_for(inst.a_max, inst.max_lora_rank) is not None
        result = None
        if memory_ok and adapters:
            cfg = replace(config, a_max=inst.a_max, max_lora_rank=inst.max_lora_rank)
            result = simulate(Workload(tuple(adapters)), profile, cfg)
        out.append(InstanceEvaluation(inst.instance_id, len(adapters), inst.a_max, inst.max_lora_rank, memory_ok,
                                      inst.predicted_throughput_tok_s, result))
    unplaced = [a.adapter_id for a in workload.adapters if a.adapter_id not in placed]
    missing = sorted(placed - set(by_id))
    return Evaluation(out, unplaced, missing, policy_record(config.policy))
