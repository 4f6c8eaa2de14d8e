"""Make a placement: workload + profile + predictor + algorithm → :class:`Placement`."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from models.predictor import Predictor
from planner.baselines import plan_dlora, plan_latency, plan_maxbase, plan_random
from planner.confirm import CONFIRM_RATIO, Confirmation, Progress, ServiceBar, pack_confirmed
from planner.greedy import plan_greedy
from planner.packing import GpuGroup, PackRequest
from planner.paper_greedy import plan_paper_greedy
from planner.placement import Placement, adapter_rows, build_instances, engine_settings, plan_inputs
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
    confirm: bool = True  # greedy with a surrogate: confirm every GPU in the twin, repack if one falls short
    jobs: int = 1  # processes for the twin confirmation
    max_ttft_s: float | None = None  # confirmation also requires the twin's p99 TTFT within this
    min_served: float | None = None  # confirmation's share of arriving tokens served [CONFIRM_RATIO]

    @property
    def bar(self) -> ServiceBar:
        """What the twin confirmation requires of each GPU."""
        return ServiceBar(CONFIRM_RATIO if self.min_served is None else self.min_served, self.max_ttft_s)


def pack_request(workload: Workload, profile: Profile, predictor: Predictor, opts: PlanOptions) -> PackRequest:
    spec = _spec(opts.algorithm)
    if spec.needs_gpus and opts.gpus is None:
        raise BadInputError(f"--algorithm {opts.algorithm} spreads adapters over a given number of GPUs; "
                            "say how many with --gpus N")
    return PackRequest.build(workload, profile, predictor, opts.gpus or UNLIMITED_GPUS, opts.headroom,
                             opts.input_tokens, opts.output_tokens, opts.seed)


def _spec(name: str) -> AlgorithmSpec:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise BadInputError(f"unknown algorithm '{name}'; choose one of {', '.join(ALGORITHMS)}") from None


def run_algorithm(req: PackRequest, opts: PlanOptions) -> list[GpuGroup]:
    if opts.algorithm == "greedy":
        return plan_greedy(req, split_hot=opts.split_hot, balance=opts.balance)
    return _spec(opts.algorithm).run(req)


def confirms(req: PackRequest, opts: PlanOptions) -> bool:
    """Is this plan checked in the twin? Greedy plans made with a model other than the twin itself, and
    every greedy plan with a TTFT limit or a share to serve."""
    asked = opts.max_ttft_s is not None or opts.min_served is not None
    if asked and not (opts.confirm and opts.algorithm == "greedy"):
        raise BadInputError("--max-ttft and --min-served are checked by the twin confirmation, which runs for "
                            "--algorithm greedy only: drop --no-confirm (and, for `plan`, any other --algorithm)")
    return opts.confirm and opts.algorithm == "greedy" and (req.predictor.kind != "twin" or asked)


def plan_groups(req: PackRequest, opts: PlanOptions,
                progress: Progress | None = None) -> tuple[list[GpuGroup], Confirmation | None]:
    """Run the algorithm, confirmed in the twin where :func:`confirms` says so (else no confirmation)."""
    if confirms(req, opts):
        return pack_confirmed(req, opts.split_hot, opts.balance, opts.jobs, opts.bar, progress)
    return run_algorithm(req, opts), None


def make_plan(workload_path: str | os.PathLike, workload: Workload, profile: Profile, predictor: Predictor,
              opts: PlanOptions, progress: Progress | None = None) -> Placement:
    """Plan ``workload``; raises :class:`InfeasibleError` when the algorithm finds no plan."""
    req = pack_request(workload, profile, predictor, opts)
    inputs = plan_inputs(workload_path, req, opts.algorithm, opts.headroom)
    groups, confirmation = plan_groups(req, opts, progress)
    if confirmation is not None:
        inputs["confirmation"] = confirmation.to_dict()
    return Placement(
        inputs=inputs,
        instances=build_instances(req, groups),
        adapters=adapter_rows(req),
        engine=engine_settings(profile),
    )
