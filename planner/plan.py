"""Make a placement: workload + profile + predictor + algorithm → :class:`Placement`."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from models.scenario import Predictor
from models.twin_predictor import FewAdapters
from planner.baselines import plan_dlora, plan_latency, plan_maxbase, plan_random
from planner.confirm import Confirmation, Progress, judged, pack_confirmed
from planner.greedy import plan_greedy
from planner.lower_bound import lower_bound
from planner.packing import GpuGroup, PackRequest
from planner.paper_greedy import plan_paper_greedy
from planner.placement import Placement, adapter_rows, build_instances, engine_settings, plan_inputs
from planner.verdict import TAIL_FACTOR, ServiceBar, TwinRun, few_adapters
from twin.errors import BadInputError
from twin.profile import Profile
from twin.workload import Workload


@dataclass(frozen=True)
class AlgorithmSpec:
    run: Callable[..., list[GpuGroup]]
    needs_gpus: bool  # spreads over every GPU it is given, so --gpus must say how many
    summary: str


ALGORITHMS: dict[str, AlgorithmSpec] = {
    "greedy": AlgorithmSpec(plan_greedy, False, "ours: largest feasible prefix per GPU, best A_max, rebalanced"),
    "paper-greedy": AlgorithmSpec(plan_paper_greedy, False, "the study's greedy (Algorithms 1-2, fixed testing points)"),
    "maxbase": AlgorithmSpec(plan_maxbase, False, "next-fit to the backbone's max throughput, A_max = adapters"),
    "maxbase-half": AlgorithmSpec(lambda r: plan_maxbase(r, half=True), False, "maxbase with A_max = adapters / 2"),
    "random": AlgorithmSpec(plan_random, True, "uniform GPU per adapter, uniform A_max (seeded)"),
    "dlora": AlgorithmSpec(plan_dlora, True, "dLoRA proactive placement (burst tolerance, replicas)"),
    "latency": AlgorithmSpec(plan_latency, True, "ProposedLat: least-loaded GPU by request rate, checked by the model"),
}

#: --gpus default for algorithms that pack (plan as many GPUs as the workload needs).
UNLIMITED_GPUS = 1_000_000


@dataclass(frozen=True)
class PlanOptions:
    algorithm: str = "greedy"
    gpus: int | None = None
    headroom: float = 0.0
    seed: int = 0
    input_tokens: float | None = None
    output_tokens: float | None = None
    split_hot: bool = True
    balance: bool = True
    confirm: bool = True  # judge every GPU in the twin (greedy: and repack the ones that fall short)
    jobs: int = 1  # processes for the twin confirmation
    objective: str = "slo"  # slo: the latency SLO and the served share; throughput: the served share alone
    max_ttft_s: float | None = None  # the SLO's p99 TTFT [verdict.DEFAULT_MAX_TTFT_S with objective slo]
    max_tpot_ms: float | None = None  # the SLO's p99 TPOT [verdict.DEFAULT_MAX_TPOT_MS with objective slo]
    min_served: float | None = None  # share of arriving tokens served [verdict.CONFIRM_RATIO]
    slowdown: float | None = None  # the twin's GPU this much slower [the profile's planning.slowdown]
    # with ``slowdown`` given, how a GPU of few adapters is judged instead (a re-plan keeps its plan's rule);
    # without, the profile's rule (planner.verdict.few_adapters)
    few: FewAdapters | None = None
    tail_factor: float | None = TAIL_FACTOR  # judging runs' bound on p99.9 TTFT, times the limit (None: none)
    size_scaled: bool = True  # judging runs' margin scaled by the variation of request sizes (verdict.TwinRun)

    def bar(self, profile: Profile) -> ServiceBar:
        """What the twin requires of each GPU of this plan (before its adapters' own SLOs)."""
        given = self.slowdown is not None
        bar = ServiceBar.for_objective(self.objective, self.slowdown if given else profile.planning_slowdown(self.objective),
                                       self.min_served, self.max_ttft_s, self.max_tpot_ms)
        return replace(bar, few=self.few if given else few_adapters(profile, self.objective))

    @property
    def run(self) -> TwinRun:
        """The twin runs judging each GPU (their length follows the objective; the slowdown does not matter)."""
        bar = ServiceBar.for_objective(self.objective, 1.0, self.min_served, self.max_ttft_s, self.max_tpot_ms)
        return TwinRun.for_bar(bar, self.jobs, self.tail_factor, self.size_scaled)


def limits_of(bar: ServiceBar) -> dict[str, Any]:
    """The :class:`PlanOptions` fields that ask for ``bar``'s limits as they are, as a re-plan judges by a plan's
    recorded bar: a bar with one latency limit is asked for as ``throughput`` with that limit (``slo`` would add
    the default of the limit it lacks: ServiceBar.for_objective)."""
    both = bar.max_ttft_s is not None and bar.max_tpot_ms is not None
    return {"objective": "slo" if both else "throughput", "max_ttft_s": bar.max_ttft_s,
            "max_tpot_ms": bar.max_tpot_ms, "min_served": bar.min_served}


def pack_request(workload: Workload, profile: Profile, predictor: Predictor, opts: PlanOptions) -> PackRequest:
    spec = _spec(opts.algorithm)
    if spec.needs_gpus and opts.gpus is None:
        raise BadInputError(f"--algorithm {opts.algorithm} spreads adapters over a given number of GPUs; "
                            "say how many with --gpus N")
    bar = opts.bar(profile)
    if predictor.kind == "twin":  # the twin as predictor answers with the judging run itself
        predictor = opts.run.predictor(profile, getattr(predictor, "policy", None), bar)
    req = PackRequest.build(workload, profile, predictor, opts.gpus or UNLIMITED_GPUS, opts.headroom,
                            opts.input_tokens, opts.output_tokens, opts.seed)
    if opts.algorithm != "greedy":
        return req
    # greedy aims at the bar: the twin as predictor at the judging run's load; a model of the profile's own
    # twin at the load of the slower one (not also x the judging run's 1.05: the surrogate is cautious there
    # on average, and the GPUs it puts past the edge are repacked; benchmarks/studies/packing_aim.py), times
    # the judging run's scaling for varied request sizes, which a group of mixed lengths is judged with; and
    # by the predictor's edge classifier where it learnt the verdicts of this bar or a laxer one (models.edge);
    # a TPOT limit tighter than the default is scaled by the slowdown (planner.packing.aim_tpot_limit)
    if predictor.kind == "twin":
        return replace(req, bar=bar, margin=opts.run.load - 1.0)
    edge = getattr(predictor, "edge", None)
    return replace(req, bar=bar, margin=bar.slowdown - 1.0, size_margin=opts.run.size_margin,
                   edge=edge is not None and edge.applies(bar.to_dict(), opts.run.to_dict()), tpot_aim=bar.slowdown,
                   few=bar.few, few_margin=0.0 if bar.few is None else bar.few.slowdown - 1.0)


def _spec(name: str) -> AlgorithmSpec:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise BadInputError(f"unknown algorithm '{name}'; choose one of {', '.join(ALGORITHMS)}") from None


def run_algorithm(req: PackRequest, opts: PlanOptions) -> list[GpuGroup]:
    if opts.algorithm == "greedy":
        return plan_greedy(req, split_hot=opts.split_hot, balance=opts.balance)
    return _spec(opts.algorithm).run(req)


def plan_groups(req: PackRequest, opts: PlanOptions, progress: Progress | None = None,
                first: list[GpuGroup] | None = None) -> tuple[list[GpuGroup], Confirmation | None]:
    """Run the algorithm; with ``opts.confirm`` judge every GPU in the twin (greedy repacks the ones that
    fall short until all pass, from ``first`` where its first packing was made already; the other algorithms
    are judged as they pack)."""
    if not opts.confirm:
        return run_algorithm(req, opts), None
    bar = opts.bar(req.profile)
    if opts.algorithm == "greedy":
        return pack_confirmed(req, opts.split_hot, opts.balance, opts.run, bar, progress, first=first)
    groups = run_algorithm(req, opts)
    return groups, judged(req, groups, opts.run, bar, progress)


def make_plan(workload_path: str | os.PathLike, workload: Workload, profile: Profile, predictor: Predictor,
              opts: PlanOptions, progress: Progress | None = None) -> Placement:
    """Plan ``workload``; raises :class:`InfeasibleError` when the algorithm finds no plan."""
    req = pack_request(workload, profile, predictor, opts)
    inputs = plan_inputs(workload_path, req, opts.algorithm)
    bound = lower_bound(req, opts.bar(profile), opts.jobs)
    groups, confirmation = plan_groups(req, opts, progress)
    if confirmation is not None:
        inputs["confirmation"] = confirmation.to_dict()
    inputs["lower_bound"] = bound().to_dict()
    return Placement(
        inputs=inputs,
        instances=build_instances(req, groups, twin=None if confirmation is None else confirmation.rows),
        adapters=adapter_rows(req),
        engine=engine_settings(profile),
    )
