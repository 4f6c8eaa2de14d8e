"""Judge every GPU of a saved placement in the digital twin, by the rule its plan was made with.

The GPUs are judged exactly as ``planner plan`` confirms them (:mod:`planner.verdict`): the same twin
run, the same bar (the SLO and served share the plan recorded, the profile's slowdown), the adapters'
own SLOs from the workload. With the plan's defaults, a confirmed plan evaluates with its own figures.
A pool plan's GPUs are judged kind by kind, each on its kind's profile by its kind's rule (:func:`evaluate_pool`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from planner.packing import GpuGroup, PackRequest, group_scenario
from planner.placement import Placement
from planner.verdict import (
    CONFIRM_DURATION_S,
    CONFIRM_LOAD,
    CONFIRM_SEED,
    DEFAULT_RUN,
    SECOND_SEED,
    ServiceBar,
    TwinRun,
    few_adapters,
    twin_check,
)
from twin.errors import BadInputError, ProfileError
from twin.policies.memory import kv_capacity
from twin.policies.spec import PolicySpec, policy_record
from twin.profile import Profile, recorded_profile
from twin.workload import Adapter, Workload


@dataclass
class InstanceEvaluation:
    instance_id: str
    adapters: int
    a_max: int
    max_lora_rank: int
    memory_ok: bool
    predicted_throughput_tok_s: float | None
    arriving_tok_s: float
    figures: dict[str, Any] | None  # the twin's (TwinCheck.row); None on a memory error
    misses: list[str]  # what it misses, in words
    kind: str | None = None  # a pool plan's: the kind it runs on

    @property
    def ok(self) -> bool:
        return self.memory_ok and bool(self.figures and self.figures["meets"])

    @property
    def starved(self) -> bool | None:
        return None if self.figures is None else self.figures["served"] < 0.9

    def to_dict(self) -> dict[str, Any]:
        f = self.figures or {}
        return {
            "instance_id": self.instance_id, **({} if self.kind is None else {"kind": self.kind}),
            "adapters": self.adapters, "a_max": self.a_max,
            "max_lora_rank": self.max_lora_rank, "memory_ok": self.memory_ok,
            "predicted_throughput_tok_s": self.predicted_throughput_tok_s, "arriving_tok_s": self.arriving_tok_s,
            "throughput_tok_s": f.get("throughput_tok_s"), "served": f.get("served"), "starved": self.starved,
            "ttft_ms_p99": f.get("ttft_ms_p99"), "tpot_ms_p99": f.get("tpot_ms_p99"),
            "itl_ms_mean": f.get("itl_ms_mean"), "max_ttft_ms": f.get("max_ttft_ms"),
            "max_tpot_ms": f.get("max_tpot_ms"), "ok": self.ok, "misses": self.misses,
        }


@dataclass(frozen=True)
class KindJudging:
    """How a pool plan's instances of one kind were judged."""

    name: str
    profile_id: str
    gpus: int
    bar: ServiceBar
    run: TwinRun

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.name, "profile_id": self.profile_id, "gpus": self.gpus, "slo": self.bar.to_dict(),
                "twin_run": _run_record(self.run)}


@dataclass
class Evaluation:
    instances: list[InstanceEvaluation]
    unplaced: list[str]  # workload adapters no instance serves
    missing: list[str]  # placed adapters absent from the workload (evaluated with no traffic)
    bar: ServiceBar  # a pool plan's: its first kind's, as its inputs.confirmation is (each kind's in ``kinds``)
    run: TwinRun
    policy: dict[str, Any] | None = None  # the serving policy simulated (policy_record); None: stock vLLM
    kinds: list[KindJudging] = field(default_factory=list)  # a pool plan's, per kind used; empty otherwise

    @property
    def ok(self) -> bool:
        return not self.unplaced and all(i.ok for i in self.instances)

    def to_dict(self) -> dict[str, Any]:
        return {
            **({} if self.policy is None else {"policy": self.policy}),
            "ok": self.ok, "gpus": len(self.instances), "slo": self.bar.to_dict(), "twin_run": _run_record(self.run),
            **({"kinds": [k.to_dict() for k in self.kinds]} if self.kinds else {}),
            "memory_errors": sum(not i.memory_ok for i in self.instances),
            "starving": sum(bool(i.starved) for i in self.instances),
            "failing": sum(not i.ok for i in self.instances),
            "unplaced_adapters": self.unplaced, "adapters_not_in_workload": self.missing,
            "instances": [i.to_dict() for i in self.instances],
        }


def _run_record(run: TwinRun) -> dict[str, Any]:
    return {k: v for k, v in run.to_dict().items() if k != "by"}


def evaluation_request(placement: Placement, workload: Workload, profile: Profile, bar: ServiceBar,
                       policy: PolicySpec | None) -> PackRequest:
    """The placement's adapters as a request: the workload's traffic and lengths (else the ones the plan was
    made with), the workload's per-adapter SLOs, and placed adapters absent from it with no traffic."""
    by_id = {a.adapter_id: a for a in workload.adapters}
    adapters = []
    for plan in placement.adapters:
        a = by_id.get(plan["adapter_id"])
        if a is None:
            adapters.append(Adapter(plan["adapter_id"], int(plan["rank"]), 0.0, plan["input_tokens"],
                                    plan["output_tokens"]))
        else:
            adapters.append(Adapter(a.adapter_id, a.rank, a.rate_rps, a.input_tokens or plan["input_tokens"],
                                    a.output_tokens or plan["output_tokens"], a.path, a.max_ttft_s, a.max_tpot_ms))
    planned = {a.adapter_id for a in adapters}
    adapters += [a for a in workload.adapters if a.adapter_id not in planned]
    req = PackRequest.build(Workload(tuple(adapters)), profile, DEFAULT_RUN.predictor(profile, policy, bar), 0)
    return replace(req, bar=bar)


def evaluate_placement(placement: Placement, workload: Workload, profile: Profile, bar: ServiceBar,
                       run: TwinRun = DEFAULT_RUN, policy: PolicySpec | None = None,
                       progress: Callable[[int, int], None] | None = None) -> Evaluation:
    """Judge each instance serving its adapters' share of ``workload``'s traffic under serving ``policy``
    (None: stock vLLM, which also decides which --max-loras start)."""
    req = evaluation_request(placement, workload, profile, bar, policy)
    index = {a.adapter_id: i for i, a in enumerate(req.workload.adapters)}
    capacity = kv_capacity(profile, policy)
    groups = [GpuGroup({index[a]: s for a, s in inst.adapters.items()}, inst.a_max, inst.max_lora_rank)
              for inst in placement.instances]
    memory_ok = [capacity.tokens_for(inst.a_max, inst.max_lora_rank) is not None for inst in placement.instances]
    starts = [k for k, inst in enumerate(placement.instances) if inst.adapters and memory_ok[k]]
    scenarios = [group_scenario(req, g.shares, g.a_max, max_lora_rank=g.max_lora_rank) for g in groups]
    check = twin_check(profile, policy, [scenarios[k] for k in starts], bar, run, progress)
    out = []
    row_of = {k: j for j, k in enumerate(starts)}
    for k, (inst, sc) in enumerate(zip(placement.instances, scenarios)):
        j = row_of.get(k)
        figures = None if j is None else check.row(j, bar)
        misses = (check.misses(j, bar) if j is not None else ["would not start (memory error)"] if not memory_ok[k]
                  else ["serves no adapter (a GPU the plan should not have)"])
        out.append(InstanceEvaluation(inst.instance_id, len(inst.adapters), inst.a_max, inst.max_lora_rank,
                                      memory_ok[k], inst.predicted_throughput_tok_s, sc.arriving_tok_s, figures,
                                      misses))
    return Evaluation(out, *_gaps(placement, workload), bar, run, policy_record(policy))


def _gaps(placement: Placement, workload: Workload) -> tuple[list[str], list[str]]:
    """The workload's adapters no instance serves, and the placed adapters absent from the workload."""
    placed = {aid for inst in placement.instances for aid in inst.adapters}
    unplaced = [a.adapter_id for a in workload.adapters if a.adapter_id not in placed]
    return unplaced, sorted(placed - {a.adapter_id for a in workload.adapters})


def evaluate_pool(placement: Placement, workload: Workload,
                  judge: Callable[[Placement, Profile], tuple[ServiceBar, TwinRun]], policy: PolicySpec | None = None,
                  progress: Callable[[int, int], None] | None = None) -> Evaluation:
    """A pool plan judged kind by kind: each kind's instances (:meth:`Placement.by_kind`) on its kind's profile, by
    the bar and run ``judge`` gives for that kind's part and profile (:func:`plan_bar`, :func:`judging_run`, which
    read the kind's own confirmation), serving the workload's traffic of the adapters routed to them. One
    Evaluation, its instances in the plan's order; the adapters not placed or not in the workload are the whole
    plan's."""
    judged: dict[str, InstanceEvaluation] = {}
    kinds = []
    for kind, part in placement.by_kind():
        profile = recorded_profile(kind)
        bar, run = judge(part, profile)
        try:  # the whole workload: the kind's part takes its adapters' traffic (none where all are missing)
            ev = evaluate_placement(part, workload, profile, bar, run, policy, progress)
        except ProfileError as exc:  # an instance its kind's profile knows nothing of (an unprofiled rank)
            raise ProfileError(f"kind {kind['name']} ({profile.profile_id}): {exc}") from None
        for i in ev.instances:
            judged[i.instance_id] = replace(i, kind=kind["name"])
        kinds.append(KindJudging(kind["name"], profile.profile_id, len(part.instances), bar, run))
    if not kinds:
        raise BadInputError("the pool plan has no instance to evaluate")
    return Evaluation([judged[i.instance_id] for i in placement.instances], *_gaps(placement, workload),
                      kinds[0].bar, kinds[0].run, policy_record(policy), kinds)


def plan_bar(placement: Placement, profile: Profile, objective: str | None = None, min_served: float | None = None,
             max_ttft_s: float | None = None, max_tpot_ms: float | None = None,
             slowdown: float | None = None) -> ServiceBar:
    """The bar a saved plan was judged by (its recorded confirmation, its margin rule too; for a plan that records
    none, the default SLO on the profile's slowdown), with any of the arguments given replacing its part
    (``slowdown``: every GPU on that margin; another ``objective``: the profile's margins for it)."""
    conf = placement.inputs.get("confirmation")
    base = (ServiceBar.from_dict(conf) if isinstance(conf, dict) and "objective" in conf
            else ServiceBar(slowdown=profile.planning_slowdown()))
    if objective is not None and objective != base.objective:
        base = replace(ServiceBar.for_objective(objective, profile.planning_slowdown(objective), base.min_served),
                       few=few_adapters(profile, objective))
    bar = replace(base, min_served=base.min_served if min_served is None else min_served,
                  max_ttft_s=base.max_ttft_s if max_ttft_s is None else max_ttft_s,
                  max_tpot_ms=base.max_tpot_ms if max_tpot_ms is None else max_tpot_ms)
    return bar if slowdown is None else bar.flat(slowdown)


def judging_run(placement: Placement, seed: int, load: float | None = None, **kw) -> TwinRun:
    """How to judge a saved plan with arrival ``seed``: with the plan's own seed as the plan was judged (its
    load, seeds and run lengths, so a confirmed plan evaluates with its own figures); with another
    seed, an hour of the planned traffic once (an independent check of what the plan promised). ``load``
    overrides the traffic multiple; ``kw`` the other :class:`TwinRun` fields (``duration_s`` None: as above)."""
    conf = placement.inputs.get("confirmation")
    conf = conf if isinstance(conf, dict) else {}
    own = seed == conf.get("seed", CONFIRM_SEED)
    plan_load = float(conf.get("load") or CONFIRM_LOAD) if own else 1.0
    second = conf.get("second_seed", SECOND_SEED) if own else None
    third = conf.get("third_seed") if own else None  # none before plans recorded one
    tail = conf.get("tail_factor") if own else None  # no bound before plans recorded one
    tpot = conf.get("tpot_factor") if own else None
    kw.setdefault("size_scaled", bool(conf.get("size_scaled")) if own else False)
    if kw.get("duration_s") is None:  # with the plan's seed as long as the plan's runs were, else an hour
        kw["duration_s"] = float(conf.get("duration_s") or CONFIRM_DURATION_S) if own else CONFIRM_DURATION_S
        if own and conf.get("min_requests"):
            kw.update(min_requests=float(conf["min_requests"]),
                      max_duration_s=float(conf.get("max_duration_s") or CONFIRM_DURATION_S))
    return TwinRun(seed=seed, load=plan_load if load is None else load, second_seed=second, tail_factor=tail,
                   tpot_factor=tpot, third_seed=third, **kw)
