"""What every placement algorithm works with: the request, one GPU's group, and how a group is tested.

An algorithm turns a :class:`PackRequest` into a list of :class:`GpuGroup` (adapters with the share
of their traffic routed there, plus the A_max the GPU runs with). Memory feasibility comes from
:attr:`PackRequest.kv`: the profile's KV table for stock vLLM, the unified pool of the predictor's
serving policy otherwise (``twin.policies.memory``); throughput and starvation come from the predictor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from models.scenario import GpuScenario, Predictions, Predictor
from models.twin_predictor import FewAdapters, default_size_cv2, length_cv2, size_cv2, size_scale
from planner.verdict import DEFAULT_MAX_TPOT_MS, TPOT_FACTOR, ServiceBar, group_limits
from twin.errors import BadInputError, InfeasibleError
from twin.policies.memory import UnifiedPool, kv_capacity
from twin.policies.spec import PolicySpec
from twin.profile import KVCapacity, Profile
from twin.workload import Workload

#: The study's testing points / A_max grid (reference-study-notes §5.2).
PAPER_GRID = (8, 16, 32, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 576)


@dataclass(frozen=True)
class PackRequest:
    workload: Workload
    profile: Profile
    predictor: Predictor
    max_gpus: int  # GPUs available; a plan needing more is infeasible
    ranks: np.ndarray  # int64 per adapter
    rates_rps: np.ndarray  # float64 per adapter, the rates to plan for (headroom applied)
    input_tokens: np.ndarray  # float64 mean prompt tokens per adapter
    output_tokens: np.ndarray
    seed: int = 0
    headroom: float = 0.0  # the fraction rates_rps are above the workload's (the plan records it)
    policy: PolicySpec | None = None  # the predictor's serving policy; None: stock vLLM
    margin: float = 0.0  # a GPU passes only if predicted to keep up with (1 + margin) x its load
    # The judging run's load margin where it scales with request sizes (TwinRun.size_scaled): a group whose
    # sizes vary more than the profile's default lengths is asked about that much more load, as it will be
    # judged (:meth:`aim_scale`); 0: as asked.
    size_margin: float = 0.0
    # What a packed GPU must be predicted to meet (besides not starving): the bar of the twin confirmation,
    # so that an accurate predictor needs one round; None: not starving alone (the baselines).
    bar: ServiceBar | None = None
    # Per adapter: its own latency SLO (the workload's max_ttft_s / max_tpot_ms columns), NaN where none.
    adapter_ttft_s: np.ndarray | None = None
    adapter_tpot_ms: np.ndarray | None = None
    # Pack a window only where the predictor's edge classifier (models.edge) expects it to pass its judging
    # run: set where the classifier's bar and run apply to this plan's (planner.plan.pack_request).
    edge: bool = False
    # > 0: a predictor of the profile's own GPU (the surrogate) is held to TPOT limits tighter than the
    # default, over this factor, the judging run's slowdown (:func:`aim_tpot_limit`); 0: to the limits as
    # they are (the twin, which judges on the slowed GPU itself).
    tpot_aim: float = 0.0
    # A predictor of the profile's own GPU (the surrogate) aims a group of at most ``few.adapters`` adapters at
    # the bar's rule for it (:meth:`aimed`): ``few_margin`` instead of ``margin``, its limits as ``few`` says;
    # the edge classifier, which learnt the verdicts of the larger margin, is asked at that smaller load (the
    # forests alone let through half the GPUs of mixed request lengths that their judging runs then failed:
    # docs/planning.md). None: every group alike (the twin applies the rule itself).
    few: FewAdapters | None = None
    few_margin: float = 0.0

    @classmethod
    def build(cls, workload: Workload, profile: Profile, predictor: Predictor, max_gpus: int,
              headroom: float = 0.0, input_tokens: float | None = None, output_tokens: float | None = None,
              seed: int = 0, lengths: tuple[np.ndarray, np.ndarray] | None = None) -> PackRequest:
        """``lengths``: each adapter's mean prompt and output tokens, as given (default: :func:`mean_lengths`)."""
        ads = workload.adapters
        ins, outs = lengths or mean_lengths(workload, profile, input_tokens, output_tokens)
        return cls(
            workload=workload, profile=profile, predictor=predictor, max_gpus=max_gpus,
            ranks=workload.ranks,
            rates_rps=np.array([a.rate_rps for a in ads]) * (1.0 + headroom),
            input_tokens=ins, output_tokens=outs, seed=seed, headroom=headroom,
            policy=getattr(predictor, "policy", None),  # predictors without one model stock vLLM
            adapter_ttft_s=np.array([np.nan if a.max_ttft_s is None else a.max_ttft_s for a in ads], float),
            adapter_tpot_ms=np.array([np.nan if a.max_tpot_ms is None else a.max_tpot_ms for a in ads], float),
        )

    @property
    def min_ratio(self) -> float:
        """The share of its (margin-scaled) load a packed GPU must be predicted to serve; 0: not starving only."""
        return 0.0 if self.bar is None else self.bar.min_served

    def adapter_id(self, i: int) -> str:
        return self.workload.adapters[i].adapter_id

    @cached_property
    def size_terms(self) -> tuple[float, float, float]:
        """(prompt and output length variation squared, the size variation of one adapter at the profile's
        default lengths): what :func:`models.twin_predictor.size_cv2` and ``size_scale`` need."""
        return (*length_cv2(self.profile.default_lengths()), default_size_cv2(self.profile))

    def few_covers(self, adapters: int) -> bool:
        """Is a group of this many adapters aimed at the rule for few adapters (:attr:`few`)?"""
        return self.few is not None and adapters <= self.few.adapters

    def aim_scale(self, shares: dict[int, float]) -> float:
        """The load a group is asked about, over its own: (1 + margin), or (1 + few_margin) for a group of few
        adapters, times the judging run's scaling for varied request sizes when ``size_margin`` > 0."""
        scale = 1.0 + (self.few_margin if self.few_covers(len(shares)) else self.margin)
        if self.size_margin <= 0:
            return scale
        idx = np.fromiter(shares, np.int64, len(shares))
        rates = self.rates_rps[idx] * np.fromiter(shares.values(), np.float64, len(shares))
        cv_in2, cv_out2, one = self.size_terms
        cs2 = size_cv2(rates, self.input_tokens[idx], self.output_tokens[idx], cv_in2, cv_out2)
        return scale * size_scale(cs2, one, self.size_margin)

    def aimed(self, sc: GpuScenario) -> GpuScenario:
        """``sc`` with the latency limits the packer holds its prediction to: a TPOT limit tighter than the
        default over ``tpot_aim`` (:func:`aim_tpot_limit`); for a group of few adapters, the TTFT limit less what
        :attr:`few` adds to the twin's and the TPOT one over its factor too."""
        ttft, tpot, aim = sc.max_ttft_ms, sc.max_tpot_ms, self.tpot_aim
        if self.few_covers(len(sc)):
            ttft -= self.few.ttft_ms_per_adapter * len(sc)
            aim *= (1.0 + self.few_margin) / (1.0 + self.margin) * self.few.tpot_factor
        if aim > 0:
            tpot = float(aim_tpot_limit(tpot, aim))
        return sc if (ttft, tpot) == (sc.max_ttft_ms, sc.max_tpot_ms) else replace(sc, max_ttft_ms=ttft, max_tpot_ms=tpot)

    @cached_property
    def mean_request(self) -> tuple[float, float]:
        """Mean prompt and output tokens of a request, weighted by the adapters' rates (by adapter when none
        has traffic)."""
        weights = self.rates_rps if self.rates_rps.sum() > 0 else None
        return (float(np.average(self.input_tokens, weights=weights)),
                float(np.average(self.output_tokens, weights=weights)))

    @cached_property
    def kv(self) -> KVCapacity | UnifiedPool:
        """Which A_max start and with how many KV tokens, under the request's policy."""
        return kv_capacity(self.profile, self.policy)

    @cached_property
    def arriving_tok_s(self) -> np.ndarray:
        """Per-adapter arriving token rate (input + output tokens per second)."""
        return self.rates_rps * (self.input_tokens + self.output_tokens)


def mean_lengths(workload: Workload, profile: Profile, input_tokens: float | None = None,
                 output_tokens: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per adapter: mean prompt and output tokens (its own, else ``input_tokens``/``output_tokens``, else the
    profile's defaults), checked to fit the engine's context: vLLM refuses a longer request, so a workload
    whose mean request does not fit is bad input (BadInputError naming the adapter)."""
    d_in = input_tokens or profile.default_input_tokens
    d_out = output_tokens or profile.default_output_tokens
    ins = np.array([a.input_tokens or d_in for a in workload.adapters], float)
    outs = np.array([a.output_tokens or d_out for a in workload.adapters], float)
    limit = profile.engine.max_model_len
    too_long = np.flatnonzero(ins + outs > limit)
    if too_long.size:
        i = int(too_long[0])
        raise BadInputError(f"adapter {workload.adapters[i].adapter_id}: a request of {ins[i]:g} prompt + {outs[i]:g} "
                            f"output tokens does not fit max_model_len {limit} of profile {profile.profile_id}; vLLM "
                            "would refuse it (shorten input_tokens/output_tokens, or plan with a profile of a longer "
                            f"context){f' ({too_long.size} adapters in all)' if too_long.size > 1 else ''}")
    return ins, outs


@dataclass
class GpuGroup:
    """Adapters on one GPU: adapter index → share of its traffic routed here (1.0 unless split)."""

    shares: dict[int, float] = field(default_factory=dict)
    a_max: int = 0
    max_lora_rank: int | None = None  # None: the smallest profiled rank holding its adapters

    def add(self, adapter: int, share: float = 1.0) -> None:
        self.shares[adapter] = self.shares.get(adapter, 0.0) + share

    @property
    def members(self) -> list[int]:
        return list(self.shares)

    def __len__(self) -> int:
        return len(self.shares)


def group_scenario(req: PackRequest, shares: dict[int, float], a_max: int, rate_scale: float = 1.0,
                   max_lora_rank: int | None = None) -> GpuScenario:
    """The scenario of one GPU; max_lora_rank defaults to the smallest profiled rank holding its adapters."""
    idx = np.fromiter(shares, np.int64, len(shares))
    share = np.fromiter(shares.values(), np.float64, len(shares))
    limits = {}
    if req.bar is not None:
        limits = dict(zip(("max_ttft_ms", "max_tpot_ms"),
                          group_limits(req.bar, req.adapter_ttft_s[idx], req.adapter_tpot_ms[idx])))
    return GpuScenario(
        ranks=req.ranks[idx], rates_rps=req.rates_rps[idx] * share * rate_scale,
        input_tokens=req.input_tokens[idx], output_tokens=req.output_tokens[idx],
        a_max=a_max, max_lora_rank=max_lora_rank or req.profile.kv.rank_for(int(req.ranks[idx].max())), **limits,
    )


def a_max_limit(kv: KVCapacity | UnifiedPool, ranks) -> int:
    """Largest --max-loras that starts with the max_lora_rank these ranks need (0: none starts)."""
    rank = kv.rank_for(int(max(ranks)))
    return 0 if rank is None else kv.max_a_max(rank)


def a_max_candidates(kv: KVCapacity | UnifiedPool, ranks, n_adapters: int) -> list[int]:
    """A_max values worth testing for a GPU: every profiled point below n, and n itself (all resident),
    all capped by what starts in memory (``kv``: :attr:`PackRequest.kv`)."""
    limit = a_max_limit(kv, ranks)
    top = min(n_adapters, limit)
    if top < 1:
        return []
    return sorted({p for p in kv.a_max_points if p < top} | {top})


@dataclass(frozen=True)
class GroupVerdict:
    ok: bool
    a_max: int = 0
    throughput_tok_s: float = 0.0


#: Load multiplier used to rank the A_max candidates that keep up: the one with the most capacity wins.
STRESS_FACTOR = 1.5


def best_a_max(req: PackRequest, shares: dict[int, float]) -> GroupVerdict:
    """Test one GPU's group over every memory-feasible A_max candidate.

    Among candidates that pass (:func:`passing`, at the load scaled by :meth:`PackRequest.aim_scale`), pick the one
    with the most room when that load is scaled again by :data:`STRESS_FACTOR`: under a p99 TTFT limit a
    predictor of latency can check, the lowest predicted TTFT there; else the highest predicted
    throughput there. Ties go to the larger A_max. Not ok when no candidate passes or none starts in
    memory. The throughput returned is the one predicted at the margin-scaled load.
    """
    ranks = req.ranks[list(shares)]
    cands = a_max_candidates(req.kv, ranks, len(shares))
    if not cands:
        return GroupVerdict(False)
    scale = req.aim_scale(shares)
    scenarios = [group_scenario(req, shares, a, scale) for a in cands]
    nominal = req.predictor.predict(scenarios)
    keep = [a for a, ok in zip(cands, passing(req, nominal, scenarios)) if ok]
    if not keep:
        return GroupVerdict(False)
    if len(keep) == 1:
        return GroupVerdict(True, keep[0], float(nominal.throughput_tok_s[cands.index(keep[0])]))
    stressed = req.predictor.predict([group_scenario(req, shares, a, STRESS_FACTOR * scale) for a in keep])
    if req.bar is not None and stressed.ttft_ms_p99_all is not None and np.isfinite(scenarios[0].max_ttft_ms):
        score = -np.log10(stressed.ttft_ms_p99_all)
    else:
        score = stressed.throughput_tok_s
    best = max(range(len(keep)), key=lambda i: (score[i], keep[i]))
    return GroupVerdict(True, keep[best], float(nominal.throughput_tok_s[cands.index(keep[best])]))


def keeps_up(req: PackRequest, shares: dict[int, float], a_max: int, max_lora_rank: int) -> bool:
    """Does this group keep up (with ``req.margin``) with exactly this A_max and max_lora_rank (both start-up
    settings)?"""
    if int(req.ranks[list(shares)].max()) > max_lora_rank or req.kv.tokens_for(a_max, max_lora_rank) is None:
        return False
    scen = [group_scenario(req, shares, a_max, req.aim_scale(shares), max_lora_rank=max_lora_rank)]
    return bool(passing(req, req.predictor.predict(scen), scen)[0])


def aim_tpot_limit(limit_ms, slowdown: float):
    """The p99 TPOT a GPU of TPOT limit ``limit_ms`` must be predicted within on the profile's own GPU, at the
    load the packer asks about (the planned load x the slowdown): the judging runs' bound on it
    (:data:`~planner.verdict.TPOT_FACTOR` times the limit) over the ``slowdown``, where the limit is tighter than
    the default; else none (inf). Elementwise on an array of limits.

    A token takes one engine step, whose length is affine in the batch; a GPU s times slower at load L runs
    steps s times longer than the profile's GPU at load s x L (its batch is the same), so its TPOT is s
    times the one predicted there. At the default limit the packing rounds and the edge classifier already
    converge (docs/planning.md)."""
    limit_ms = np.asarray(limit_ms)
    return np.where(limit_ms < DEFAULT_MAX_TPOT_MS, limit_ms * TPOT_FACTOR / slowdown, np.inf)


def passing(req: PackRequest, pred: Predictions, scenarios: list[GpuScenario]) -> np.ndarray:
    """Which predicted scenarios a group may be packed as: not starving, serving ``req.min_ratio`` of the
    load the predictor saw, within their latency limits where the predictor predicts latency (TPOT limits
    as :func:`aim_tpot_limit` says with ``req.tpot_aim``), and, with ``req.edge``, taken by the predictor's
    edge classifier."""
    ok = ~np.asarray(pred.starved, bool)
    if req.bar is not None:
        ok &= pred.throughput_tok_s >= req.min_ratio * pred.arriving_tok_s
        ok &= pred.meets_latency([req.aimed(s) for s in scenarios])
    if req.edge and pred.passes_edge is not None:
        ok &= pred.passes_edge
    return ok


def priority_order(ranks: np.ndarray, rates: np.ndarray) -> list[int]:
    """The study's PRIORITYSORTING: rank groups largest first; within a group, rates in zigzag order
    (largest, smallest, 2nd largest, 2nd smallest, ...), ties broken by adapter index."""
    ranks, rates = np.asarray(ranks), np.asarray(rates)
    order: list[int] = []
    for rank in np.unique(ranks)[::-1]:
        members = np.flatnonzero(ranks == rank)
        group = members[np.argsort(rates[members], kind="stable")]  # stable: ties stay in index order
        zigzag = np.empty_like(group)
        zigzag[0::2] = group[::-1][:(len(group) + 1) // 2]
        zigzag[1::2] = group[:len(group) // 2]
        order += zigzag.tolist()
    return order


class NotEnoughGpusError(InfeasibleError):
    """A packing ran out of the GPUs it may use; ``adapter_ids``: the adapters it had no room for."""

    def __init__(self, message: str, adapter_ids: tuple[str, ...]):
        super().__init__(message)
        self.adapter_ids = adapter_ids


def listed(ids: list[str], shown: int = 8) -> str:
    """The first ``shown`` of ``ids``, and how many more."""
    return ", ".join(ids[:shown]) + (f" and {len(ids) - shown} more" if len(ids) > shown else "")


def not_enough_gpus(req: PackRequest, left: list[int], used: int) -> NotEnoughGpusError:
    ids = [req.adapter_id(i) for i in left]
    load = float(req.arriving_tok_s[left].sum())
    return NotEnoughGpusError(
        f"not enough GPUs: {used} GPUs are full and {len(ids)} adapters are left ({listed(ids)}; "
        f"{load:,.0f} tok/s arriving); allow more with --gpus", tuple(ids)
    )


Algorithm = Callable[[PackRequest], list[GpuGroup]]
