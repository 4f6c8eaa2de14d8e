"""Plan over a pool of GPU kinds: the cheapest fleet, per hour, where every GPU passes on its own kind's profile.

How (``make_pool_plan``):

1. Every kind packs the adapters it can serve (their rank within its profile, their requests within its
   context), as the greedy packer does before the twin judges (fast with a surrogate; a kind without one is
   packed by the twin in shorter, one-seed runs, :data:`ESTIMATE_RUN`, and balanced only where it prices
   adapters: :meth:`PoolPlanner.pack`). Each of its GPUs' price is shared
   among the GPU's adapters, half by their tokens and half evenly, so a busy adapter pays for the throughput
   it takes and an idle one for the slot it holds: the price of an adapter on that kind.
2. The mixes: each adapter on the kind where that price is lowest, a kind over its ``count`` giving up the
   fewest adapters that make its packing fit (those it is least ahead on for their price there first); and that
   mix with every kind's GPUs filled with other kinds' adapters while they still fit in the room paid for (a kind
   the twin packs asked at :data:`ESTIMATE_SHORTFALL` more traffic: its estimate's shorter runs pack tighter than
   the judging runs, and a share filled to the estimate's edge judged a GPU over it), or, on
   a kind its count left GPUs short of that count, the adapters cheaper there up to the count
   (:meth:`PoolPlanner.fill`).
3. The mixes and each single kind's packing of the whole workload, in order of packed cost, are judged as
   ``planner plan`` judges a plan: every GPU in the twin on its kind's profile and margin, repacked until all pass
   (a kind the twin packs is packed again by the twin of the judging runs; in a mix, it may keep the GPUs judged
   for an earlier option that hold only adapters it serves here, and pack the rest: :meth:`PoolPlanner.confirm`),
   until no option left could beat the cheapest judged one, which is the plan (a kind the twin packs, alone, is
   judged while within one GPU of it: its estimate can take a GPU more than the judging runs; one within a GPU of
   what a mix is expected to cost judged, its kinds with a surrogate judged already, is judged before the mix,
   which then keeps its GPUs). An option's kinds with a surrogate are judged first, and it is dropped once those
   and its other kinds' packings cost as much as the best judged. A mix is passed over, too, where its twin-packed
   kinds' GPUs, scaled by how many more the judging runs took than the estimate where that kind was judged serving
   everything alone, make it cost as much as the best judged; a mix's share that keeps judged GPUs is not packed in
   full again where that is not expected to make the mix the cheapest (:meth:`PoolPlanner.confirm`). A mix that
   judging took over a kind's count is tried as judged with that kind giving up the GPUs over its count whose
   adapters cost least on their next cheapest kind (:meth:`PoolPlanner.trimmed`: the kept GPUs need no judging
   again), and formed again with that many GPUs of room kept on the kind (:data:`RETRIMS` times at most).

Request lengths come from the pool's first kind for adapters without their own, so every kind is asked about
the same requests; a single-kind plan to compare with is ``planner plan W.csv --profile P --input-tokens I
--output-tokens O`` with the plan's recorded lengths.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from models.scenario import Predictor
from planner.confirm import Confirmation, Progress, pack_confirmed
from planner.packing import GpuGroup, PackRequest
from planner.placement import Placement, adapter_rows, build_instances, engine_settings, plan_inputs
from planner.plan import PlanOptions, pack_request, plan_groups, run_algorithm
from planner.pool import Kind, Pool
from planner.prefix_search import shares_of
from twin.errors import BadInputError, InfeasibleError
from twin.profile import Profile
from twin.workload import Workload

#: An adapter's share of its GPU's price: this part by its tokens, the rest evenly over the GPU's adapters.
TOKEN_WEIGHT = 0.5
#: Rounds of moving adapters off kinds packed past their count.
COUNT_ROUNDS = 6
#: How a kind without a surrogate is asked while kinds are priced and mixed: one seed, shorter runs than the
#: judging runs' (a kind chosen is packed again in those).
ESTIMATE_RUN = {"duration_s": 300.0, "min_requests": 5_000.0, "max_duration_s": 1800.0, "second_seed": None}
#: Packings a kind may try while filling the room left on its GPUs (PoolPlanner.fill), or while finding the
#: fewest adapters to move off it to fit its count; a kind the twin packs (seconds a packing) tries fewer, one
#: more to move than to fill (too few moved leave it over its count).
FILL_PROBES = 6
TWIN_FILL_PROBES = 3
TWIN_MOVE_PROBES = 4
#: A mix's twin-packed kind keeps the GPUs judged for an earlier option where they are at least this share of
#: its estimate's GPUs (PoolPlanner._reused): fewer save little of the packing and risk the GPU that packing
#: them apart from the rest can cost.
REUSE_SHARE = 0.5
#: How many more GPUs the judging runs are taken to pack than a twin-packed kind's estimate until one was judged
#: alone (to judge it alone before a mix it may beat: _alone_first): the 80 GB kind's judged over estimated GPUs
#: were 84/83 to 29/28 alone and 83/81 to 9/8 in mixes of random fleets. Its fill asks for this much more traffic
#: (PoolPlanner.fill): a rank-32 10,000-adapter share filled to the edge of 29 estimated GPUs judged 30.
ESTIMATE_SHORTFALL = 0.03
#: Times mixes are formed again with room kept for the GPUs judging added on a kind with a count, after a judged
#: mix came out over that count.
RETRIMS = 2


def servable(workload: Workload, ins: np.ndarray, outs: np.ndarray, profile: Profile) -> np.ndarray:
    """Which adapters of ``workload``, with mean requests of ``ins`` + ``outs`` tokens, ``profile`` can serve: its
    profiled ranks hold theirs and their requests fit its context."""
    ranks_ok = {r: profile.kv.rank_for(r) is not None for r in {a.rank for a in workload.adapters}}
    return np.array([ranks_ok[a.rank] for a in workload.adapters]) & (ins + outs <= profile.engine.max_model_len)


def _why_not(kind: Kind, rank: int, tokens: float) -> str:
    """Why ``kind`` cannot serve an adapter of ``rank`` with requests of ``tokens``."""
    kv, ctx = kind.profile.kv, kind.profile.engine.max_model_len
    why = [f"ranks up to {max(kv.lora_ranks)}"] if kv.rank_for(rank) is None else []
    why += [f"requests up to {ctx:,} tokens"] if tokens > ctx else []
    return f"{kind.name} serves {' and '.join(why)}"


@dataclass
class KindPack:
    """A kind's packing of some adapters (``members``: ascending indices into the whole workload)."""

    kind: Kind
    members: np.ndarray
    req: PackRequest
    groups: list[GpuGroup]
    confirmation: Confirmation | None = None

    @property
    def gpus(self) -> int:
        return len(self.groups)

    @property
    def cost(self) -> float:
        return self.gpus * self.kind.price


@dataclass
class PoolChoice:
    """One way to serve the workload: a packing per kind used."""

    packs: list[KindPack]
    single: str | None  # the kind's name when one kind serves everything

    @property
    def cost(self) -> float:
        return sum(p.cost for p in self.packs)

    def over_count(self, room: Callable[[Kind], int | None] = lambda k: k.spec.count) -> list[KindPack]:
        """The packs with more GPUs than ``room`` allows their kind (default: the kind's count)."""
        return [p for p in self.packs if room(p.kind) is not None and p.gpus > room(p.kind)]

    def key(self) -> tuple:
        return tuple((p.kind.name, p.members.tobytes()) for p in self.packs)


class PoolPlanner:
    """The state of one pool plan: the workload, its lengths, each kind's predictor and options."""

    def __init__(self, workload: Workload, pool: Pool, predictor_for: Callable[[Profile], Predictor],
                 opts: PlanOptions, progress: Progress | None):
        ref = pool.reference.profile
        self.opts = replace(opts, input_tokens=opts.input_tokens or ref.default_input_tokens,
                            output_tokens=opts.output_tokens or ref.default_output_tokens)
        self.workload, self.pool, self.progress = workload, pool, progress
        self.predictors = {k.name: predictor_for(k.profile) for k in pool.kinds}
        ads = workload.adapters
        self.ins = np.array([a.input_tokens or self.opts.input_tokens for a in ads], float)
        self.outs = np.array([a.output_tokens or self.opts.output_tokens for a in ads], float)
        self.servable = {k.name: servable(workload, self.ins, self.outs, k.profile) for k in pool.kinds}
        nobody = ~np.logical_or.reduce(list(self.servable.values()))
        if nobody.any():
            i, others = int(np.flatnonzero(nobody)[0]), int(nobody.sum()) - 1
            raise BadInputError(f"adapter {ads[i].adapter_id} (rank {ads[i].rank}, requests of {self.ins[i]:g} + "
                                f"{self.outs[i]:g} tokens) cannot be served by any kind of the pool ("
                                + "; ".join(_why_not(k, ads[i].rank, self.ins[i] + self.outs[i]) for k in pool.kinds)
                                + "): add a kind whose profile serves it"
                                + (f" ({others:,} other adapter(s) likewise)" if others else ""))
        self._packed: dict[tuple[str, bytes, bool, bool], KindPack] = {}
        #: Per kind with a count: GPUs its judging added to a mix's packing that then came out over the count;
        #: mixes formed later keep that much room (:meth:`room`).
        self.slack: dict[str, int] = {}
        #: Per kind the twin packs, once it was judged serving every adapter alone: its judged GPUs over the GPUs
        #: of its estimate (:data:`ESTIMATE_RUN`'s shorter runs pack a little tighter than the judging runs).
        self.estimate_shortfall: dict[str, float] = {}
        #: Per kind the twin packs, its packings judged so far (a mix's judging keeps the GPUs it can of them).
        self._twin_judged: dict[str, list[KindPack]] = {}
        #: Per kind the twin packs, (judged GPUs, estimated GPUs) of each packing of it judged in full, alone or a
        #: mix's share (:meth:`_full_expected`).
        self._in_full: dict[str, list[tuple[int, int]]] = {}

    def whole_request(self) -> PackRequest:
        """Every adapter with the lengths every kind is asked about, on the reference kind (what the placement's
        ``inputs`` and adapter rows record)."""
        ref = self.pool.reference
        return PackRequest.build(self.workload, ref.profile, self.predictors[ref.name], 1, self.opts.headroom,
                                 seed=self.opts.seed, lengths=(self.ins, self.outs))

    def room(self, kind: Kind) -> int | None:
        """GPUs of ``kind`` a mix may pack (None: no limit): its count, less :attr:`slack`."""
        count = kind.spec.count
        return None if count is None else max(count - self.slack.get(kind.name, 0), 0)

    def twin_packed(self, kind: Kind) -> bool:
        return self.predictors[kind.name].kind == "twin"

    def probes(self, kind: Kind, twin: int) -> int:
        """Packings ``kind`` may try in a search: ``twin`` where the twin packs it, else :data:`FILL_PROBES`."""
        return twin if self.twin_packed(kind) else FILL_PROBES

    def say(self, message: str) -> None:
        if self.progress:
            self.progress(message)

    def request(self, kind: Kind, members: np.ndarray, opts: PlanOptions | None = None) -> PackRequest:
        """``members``' request on ``kind`` (``opts``: other options than the plan's, with its lengths). A kind
        the twin packs asks it in :data:`ESTIMATE_RUN`'s shorter runs, to price and mix: where it is chosen it is
        packed again by the twin of the judging runs (:meth:`confirm`)."""
        opts = opts or self.opts
        sub = Workload(tuple(self.workload.adapters[i] for i in members))
        req = pack_request(sub, kind.profile, self.predictors[kind.name], opts)
        if req.predictor.kind != "twin":
            return req
        bar = opts.bar(kind.profile)
        run = replace(opts.run, **ESTIMATE_RUN)
        return replace(req, predictor=run.predictor(kind.profile, None, bar))

    def pack(self, kind: Kind, members: np.ndarray, priced: bool = False, padded: bool = False) -> KindPack:
        """The kind's packing of ``members`` without the twin's verdict (cached: packings are deterministic);
        ``padded``: a kind the twin packs at :data:`ESTIMATE_SHORTFALL` more traffic (:meth:`fill`).
        A kind the twin packs is balanced only where its adapters are ``priced`` from the packing: elsewhere only
        its GPU count is used (the twin packs it again when judging), and balancing, which keeps the count,
        is most of the twin's packing work; where the same adapters were packed to price them, that packing
        serves."""
        balance = self.opts.balance and (priced or not self.twin_packed(kind))
        padded = padded and self.twin_packed(kind)
        key = (kind.name, members.tobytes(), balance, padded)
        balanced = (kind.name, members.tobytes(), True, padded)
        if not balance and balanced in self._packed:
            return self._packed[balanced]
        if key not in self._packed:
            opts = self.opts if not padded else replace(
                self.opts, headroom=(1.0 + self.opts.headroom) * (1.0 + ESTIMATE_SHORTFALL) - 1.0)
            req = self.request(kind, members, opts)
            self._packed[key] = KindPack(kind, members, req, run_algorithm(req, replace(opts, balance=balance)))
        return self._packed[key]

    def confirm(self, pack: KindPack, reuse: bool = False, bound: float = np.inf) -> KindPack:
        """The packing judged in the twin on its kind's profile (repacked until every GPU passes): a kind packed by
        its surrogate from that packing; one the twin packs from the start, by the twin of the judging runs, as
        ``planner plan`` packs it, or with ``reuse`` from the GPUs judged for another option (:meth:`_reused`) where
        that takes no more GPUs than its estimate (else in full as well, the fewer GPUs kept: kept GPUs and the
        rest packed apart can round up to a GPU more than one packing of them all), but not where packing in full
        is expected (:meth:`_full_expected`) to cost ``bound`` or more, the most its option can spend on it to beat
        the best judged: minutes of judging for an option that would lose all the same. A packing judged already
        (:meth:`trimmed`) is as it is."""
        if pack.confirmation is not None:
            return pack
        self.say(f"kind {pack.kind.name}: judging {len(pack.members):,} adapters on {pack.kind.profile.profile_id} "
                 f"(packed on {pack.gpus} GPUs)")
        if not self.twin_packed(pack.kind):
            groups, confirmation = plan_groups(pack.req, self.opts, self.progress, first=pack.groups)
            return KindPack(pack.kind, pack.members, pack.req, groups, confirmation)
        kept = self._reused(pack) if reuse else None
        judged = None if kept is None else self._judge_rest(pack, *kept)
        if judged is not None and judged.gpus > pack.gpus and self._full_expected(pack, judged) >= bound:
            self.say(f"kind {pack.kind.name}: keeping them took {judged.gpus} GPUs, more than the {pack.gpus} of its "
                     "estimate, but packing all of its adapters again is not expected to make the option the cheapest")
        elif judged is None or judged.gpus > pack.gpus:
            if judged is not None:
                self.say(f"kind {pack.kind.name}: keeping them took {judged.gpus} GPUs, more than the {pack.gpus} of "
                         "its estimate: packing all of its adapters again")
            # the twin's estimate packed again in full runs
            full = KindPack(pack.kind, pack.members, pack.req, *plan_groups(pack.req, self.opts, self.progress))
            self._in_full.setdefault(pack.kind.name, []).append((full.gpus, pack.gpus))
            judged = full if judged is None or full.gpus <= judged.gpus else judged
        self._twin_judged.setdefault(pack.kind.name, []).append(judged)
        return judged

    def _full_expected(self, pack: KindPack, kept: KindPack) -> float:
        """What packing ``pack``'s share in full is expected to cost judged, where keeping judged GPUs (``kept``)
        took more GPUs than its estimate: that shows the estimate short for this share, so at least
        :data:`ESTIMATE_SHORTFALL` more GPUs (or as many more as the kind's packings judged in full took over
        their estimates, together), and no more than keeping them took. (Zipf, 10,000 adapters, seed 2, at
        `list`: a share estimated at 32 GPUs that keeping judged GPUs took 33 was packed in full to 33 again, 170 s,
        where 32 would have made the mix the cheapest; a hot 2,000-adapter one with the CPU kind: a share of it
        estimated at 218 GPUs, kept 263, packed in full to 261, where an earlier share had judged 255 of 212.)"""
        judged, estimated = np.sum(self._in_full.get(pack.kind.name, [(1, 1)]), axis=0)
        shortfall = max(judged / estimated, 1.0 + ESTIMATE_SHORTFALL)
        return min(kept.gpus, np.ceil(pack.gpus * shortfall - 1e-9)) * pack.kind.price

    def _reused(self, pack: KindPack) -> tuple[KindPack, list[GpuGroup], list[dict]] | None:
        """The GPUs judged for another option on ``pack``'s kind whose adapters ``pack`` all serves, from the
        option keeping the most of them, indexed as ``pack``'s (with their rows); None where they are fewer than
        :data:`REUSE_SHARE` of its estimate's GPUs. Each such GPU holds the same adapters at the same traffic, so
        the judging runs pass it again."""
        best: tuple[int, KindPack, list[int]] | None = None
        for done in self._twin_judged.get(pack.kind.name, []):
            here = np.isin(done.members, pack.members)
            whole = [k for k, g in enumerate(done.groups) if here[g.members].all()]
            count = sum(len(done.groups[k]) for k in whole)
            if whole and (best is None or count > best[0]):
                best = (count, done, whole)
        if best is None or len(best[2]) < REUSE_SHARE * pack.gpus:
            return None
        _, done, whole = best
        at = np.searchsorted(pack.members, done.members)
        groups = [GpuGroup({int(at[i]): s for i, s in done.groups[k].shares.items()}, done.groups[k].a_max,
                           done.groups[k].max_lora_rank) for k in whole]
        return done, groups, [done.confirmation.rows[k] for k in whole]

    def _judge_rest(self, pack: KindPack, done: KindPack, kept: list[GpuGroup], rows: list[dict]) -> KindPack:
        """``pack`` judged keeping the GPUs ``kept`` (judged for ``done``, with their ``rows``): the twin of the
        judging runs packs only the traffic they leave."""
        served = shares_of([e for g in kept for e in g.shares.items()])
        rest = [(i, 1.0 - served.get(i, 0.0)) for i in range(len(pack.members)) if served.get(i, 0.0) < 1.0 - 1e-9]
        self.say(f"kind {pack.kind.name}: {len(kept)} GPU(s) judged for an earlier option kept; packing the other "
                 f"{len(rest):,} adapter entries")
        if not rest:
            return KindPack(pack.kind, pack.members, pack.req, kept, replace(done.confirmation, rows=rows, wall_s=0.0))
        opts = self.opts
        groups, c = pack_confirmed(pack.req, opts.split_hot, opts.balance, opts.run, opts.bar(pack.kind.profile),
                                   self.progress, entries=rest, max_gpus=pack.req.max_gpus - len(kept))
        return KindPack(pack.kind, pack.members, pack.req, kept + groups,
                        replace(c, rows=rows + c.rows, margin=max(c.margin, done.confirmation.margin)))

    def surrogate_judged(self, option: PoolChoice) -> PoolChoice:
        """``option`` with its kinds that have a surrogate judged (seconds), the twin-packed ones as estimated:
        what the mix is expected to cost judged then rests on the twin only where judging takes minutes."""
        return PoolChoice([p if self.twin_packed(p.kind) else self.confirm(p) for p in option.packs], option.single)

    def judge(self, option: PoolChoice, bound: float = np.inf) -> PoolChoice | None:
        """``option`` with every kind's packing judged (:meth:`confirm`), kinds with a surrogate first (they judge in
        seconds); None as soon as the kinds judged and the others' packings cost ``bound`` or more (judging only
        adds GPUs to a packing, so the option cannot cost less than ``bound``)."""
        judged: dict[int, KindPack] = {}
        for i in sorted(range(len(option.packs)), key=lambda i: self.twin_packed(option.packs[i].kind)):
            costs = [judged.get(k, p).cost for k, p in enumerate(option.packs)]
            if sum(costs) >= bound:
                return None
            others = sum(c for k, c in enumerate(costs) if k != i)
            judged[i] = self.confirm(option.packs[i], reuse=option.single is None, bound=bound - others)
        return PoolChoice([judged[i] for i in range(len(option.packs))], option.single)

    def trimmed(self, judged: PoolChoice, prices: np.ndarray) -> PoolChoice | None:
        """``judged``, a mix that came out over kinds' counts, with each such kind giving up as many of its
        judged GPUs as it is over: those whose adapters cost least on their next cheapest kind (``prices``:
        kinds x adapters), which packs them with its own. The GPUs kept are judged already (the same adapters
        at the same traffic), so only the kinds that took adapters are judged again. None where a GPU to give up
        holds a replica (a share of an adapter others serve too) or an adapter of it has nowhere else to go."""
        kinds = self.pool.kinds
        choice = np.full(len(self.workload), -1)
        for p in judged.packs:
            choice[p.members] = kinds.index(p.kind)
        trimmed: dict[str, KindPack] = {}
        for p in judged.over_count():
            j = kinds.index(p.kind)
            alt = _next_cheapest(prices, p.members, j)
            whole = [k for k, g in enumerate(p.groups)
                     if all(s >= 1.0 - 1e-9 for s in g.shares.values()) and (alt[g.members] >= 0).all()]
            excess = p.gpus - p.kind.spec.count
            if len(whole) < excess:
                return None
            rehoming = [prices[alt[g.members], p.members[g.members]].sum() for g in (p.groups[k] for k in whole)]
            drop = {whole[k] for k in np.argsort(rehoming, kind="stable")[:excess]}
            moved = np.array([i for k in sorted(drop) for i in p.groups[k].shares], np.int64)
            choice[p.members[moved]] = alt[moved]
            members = np.delete(p.members, moved)
            at = np.searchsorted(members, p.members)
            keep = [k for k in range(p.gpus) if k not in drop]
            groups = [GpuGroup({int(at[i]): s for i, s in p.groups[k].shares.items()}, p.groups[k].a_max,
                               p.groups[k].max_lora_rank) for k in keep]
            trimmed[p.kind.name] = KindPack(p.kind, members, self.request(p.kind, members), groups, replace(
                p.confirmation, rows=[p.confirmation.rows[k] for k in keep]))
        packs = []
        for j, k in enumerate(kinds):
            members = np.flatnonzero(choice == j)
            before = next((p for p in judged.packs if p.kind is k), None)
            if k.name in trimmed:
                packs.append(trimmed[k.name])
            elif before is not None and np.array_equal(before.members, members):
                packs.append(before)  # judged already, unchanged
            elif len(members):
                packs.append(self.pack(k, members))
        return PoolChoice(packs, None)

    def learn_shortfall(self, estimated: PoolChoice, judged: PoolChoice) -> None:
        """Note how many more GPUs judging took than a twin-packed single kind's estimate (:meth:`expected_cost`)."""
        if estimated.single is not None and self.twin_packed(estimated.packs[0].kind):
            self.estimate_shortfall[estimated.single] = judged.packs[0].gpus / estimated.packs[0].gpus

    def expected_cost(self, option: PoolChoice, unjudged: float = 1.0) -> float:
        """What ``option`` is expected to cost judged: each kind the twin packs, where not judged yet, that many
        more GPUs than its estimate as judging its whole share alone took (:attr:`estimate_shortfall`), or
        ``unjudged`` times its estimate before that; the others, and packings judged already, as packed."""
        return sum(np.ceil(p.gpus * (self.estimate_shortfall.get(p.kind.name, unjudged)
                                     if self.twin_packed(p.kind) and p.confirmation is None else 1.0) - 1e-9)
                   * p.kind.price for p in option.packs)

    def adapter_prices(self, pack: KindPack) -> np.ndarray:
        """Per workload adapter, its share of the price of the GPUs ``pack`` put it on (inf: not in it)."""
        price = np.full(len(self.workload), np.inf)
        price[pack.members] = 0.0
        tok = pack.req.arriving_tok_s
        for g in pack.groups:
            idx = np.fromiter(g.shares, np.int64, len(g.shares))
            share = np.fromiter(g.shares.values(), float, len(g.shares))
            load = tok[idx] * share
            total = load.sum()
            part = TOKEN_WEIGHT * (load / total if total > 0 else 1.0 / len(idx)) + (1 - TOKEN_WEIGHT) / len(idx)
            np.add.at(price, pack.members[idx], part * pack.kind.price)
        return price

    def mixes(self, prices: np.ndarray, bound: float = np.inf) -> list[PoolChoice]:
        """Each adapter on its cheapest kind (``prices``: kinds x adapters), kinds over their count giving up
        the adapters they are least ahead on (for the price they take there), until every kind's packing fits;
        and that mix with its kinds' GPUs filled (:meth:`fill`) where that is cheaper and could cost less than
        ``bound``. None where the mix already costs ``bound`` or more as far as that shows without the twin
        packing (:meth:`quick_cost`)."""
        kinds = self.pool.kinds
        order = np.argsort(prices, axis=0, kind="stable")
        choice = order[0].copy()
        if self.quick_cost(choice, prices) >= bound:
            return []
        for _ in range(COUNT_ROUNDS):
            packs = self._choice(choice).packs
            over = PoolChoice(packs, None).over_count(self.room)
            if not over:
                break
            full = [self._full(k, packs) for k in kinds]
            for p in over:
                self.say(f"kind {p.kind.name}: packed on {p.gpus} GPUs where {self.room(p.kind)} are to be had: "
                         "finding the fewest adapters to move to other kinds")
                j = kinds.index(p.kind)
                alt = _next_cheapest(prices, p.members, j, {k for k in range(len(kinds)) if full[k]})
                here = prices[j, p.members]
                regret = np.where(alt >= 0, prices[np.maximum(alt, 0), p.members] / here, np.inf)
                movable = np.flatnonzero(np.isfinite(regret))
                movable = movable[np.argsort(regret[movable], kind="stable")]
                moved = movable[:self._fewest_to_move(p, movable, here)]
                choice[p.members[moved]] = alt[moved]
        over = self._choice(choice).over_count(self.room)
        if over:
            raise InfeasibleError("the pool has too few GPUs for this workload: " + "; ".join(
                f"kind {p.kind.name} needs {p.gpus}, its count is {p.kind.spec.count}"
                + (f" (less {self.slack[p.kind.name]} kept for what judging adds)" if self.slack.get(p.kind.name)
                   else "") for p in over))
        filled = self.fill(choice, prices, bound)
        return [self._choice(choice)] + ([self._choice(filled)] if (filled != choice).any() else [])

    def _fewest_to_move(self, pack: KindPack, movable: np.ndarray, here: np.ndarray) -> int:
        """How many of ``movable`` (positions in ``pack.members``, in the order they go) must leave ``pack``'s
        kind for it to fit its count: searched in at most :data:`FILL_PROBES` (:data:`TWIN_MOVE_PROBES`) packings,
        from a first guess of the price shares (``here``) worth the GPUs over the count."""
        count = self.room(pack.kind)

        def fits(n: int) -> bool:
            rest = np.delete(pack.members, movable[:n])
            return not len(rest) or self.pack(pack.kind, rest).gpus <= count

        guess = int(np.searchsorted(np.cumsum(here[movable]), (pack.gpus - count) * pack.kind.price)) + 1
        return _bisect(len(movable), guess, self.probes(pack.kind, TWIN_MOVE_PROBES), fits, fewest=True)

    def quick_cost(self, choice: np.ndarray, prices: np.ndarray) -> float:
        """What the mix ``choice`` costs: its kinds with a surrogate packed; a kind the twin packs (slow) its
        adapters' price shares rounded up to whole GPUs."""
        cost = 0.0
        for j, kind in enumerate(self.pool.kinds):
            members = np.flatnonzero(choice == j)
            if not len(members):
                continue
            if not self.twin_packed(kind):
                cost += self.pack(kind, members).cost
            else:
                cost += np.ceil(prices[j, members].sum() / kind.price - 1e-9) * kind.price
        return cost

    def _full(self, kind: Kind, packs: list[KindPack]) -> bool:
        room = self.room(kind)
        return room is not None and any(p.kind is kind and p.gpus >= room for p in packs)

    def _choice(self, choice: np.ndarray) -> PoolChoice:
        return PoolChoice([self.pack(k, np.flatnonzero(choice == j)) for j, k in enumerate(self.pool.kinds)
                           if (choice == j).any()], None)

    def fill(self, choice: np.ndarray, prices: np.ndarray, bound: float = np.inf) -> np.ndarray:
        """``choice`` with each kind's GPUs filled: the room its GPUs have left is paid for, so it takes the
        adapters of other kinds it is relatively cheapest for, as many as still fit on its GPUs (searched in at
        most :data:`FILL_PROBES` packings; a kind the twin packs, at :data:`ESTIMATE_SHORTFALL` more traffic),
        where their price shares where they are add up to a GPU there and the whole mix then costs less. A kind
        packed on fewer GPUs than its count allows, with adapters cheaper on it elsewhere (moved off to fit the
        count: the move can free more GPUs than it needed, as moving a hot adapter's replicas does), takes those
        back up to the count instead. A kind whose GPUs alone cost
        ``bound`` or more is not filled: the mix would cost more than that however it were filled."""
        for j in range(len(self.pool.kinds)):
            moved = self._fitting_others(j, choice, prices, bound)
            if not any(prices[i, moved[choice[moved] == i]].sum() >= self.pool.kinds[i].price
                       for i in np.unique(choice[moved])):
                continue  # they take less than a GPU's price where they are: none would be freed
            trial = choice.copy()
            trial[moved] = j
            if self._choice(trial).cost < self._choice(choice).cost:
                choice = trial
        return choice

    def _fitting_others(self, j: int, choice: np.ndarray, prices: np.ndarray, bound: float) -> np.ndarray:
        """The adapters of other kinds that kind ``j``'s GPUs in ``choice`` still take (:meth:`fill`)."""
        kind = self.pool.kinds[j]
        mine = choice == j
        mine_idx = np.flatnonzero(mine)
        others = np.flatnonzero(~mine & self.servable[kind.name])
        if not len(mine_idx) or not len(others) or self.pack(kind, mine_idx).cost >= bound:
            return others[:0]
        gpus = used = self.pack(kind, mine_idx).gpus
        relative = prices[j, others] / prices[choice[others], others]
        room = self.room(kind)
        if room is not None and room > gpus and (relative < 1.0).any():
            # Its count moved adapters cheaper here off it, and left GPUs of it unused: it takes them back up to
            # that count (the mix's cost then says whether the GPUs added are worth it).
            gpus, others, relative = room, others[relative < 1.0], relative[relative < 1.0]
        # Not those whose price share here exceeds the room left, nor, where it exceeds a GPU's (replicas of a
        # hot adapter), the GPUs added: they would not fit, and as the first in line would keep the others out.
        spare = gpus * kind.price - prices[j, mine].sum()
        share = prices[j, others]
        fit = share <= min(spare, max(kind.price, (gpus - used) * kind.price))
        others = others[fit][np.argsort(relative[fit], kind="stable")]
        # First guess: the others whose price shares here add up to the room left on its GPUs.
        guess = int(np.searchsorted(np.cumsum(prices[j, others]), spare))
        taken = _bisect(len(others), guess, self.probes(kind, TWIN_FILL_PROBES),
                        lambda n: self.pack(kind, np.union1d(mine_idx, others[:n]), padded=True).gpus <= gpus,
                        fewest=False)
        return others[:taken]


def _next_cheapest(prices: np.ndarray, members: np.ndarray, j: int, closed: set[int] = frozenset()) -> np.ndarray:
    """Per adapter of ``members``, the cheapest kind (by ``prices``: kinds x adapters) other than ``j`` and those
    ``closed`` that serves it; -1 where none does."""
    open_prices = prices[:, members].copy()
    open_prices[[j, *closed]] = np.inf
    best = open_prices.argmin(axis=0)  # ties: the first kind
    return np.where(np.isfinite(open_prices[best, np.arange(len(members))]), best, -1).astype(np.int64)


def _bisect(n: int, guess: int, probes: int, fits: Callable[[int], bool], fewest: bool) -> int:
    """The fewest (``fewest``) or the most of 0..``n`` that ``fits``, which holds from some count up (down), in at
    most ``probes`` calls: from ``guess`` (clamped to 1..n), steps away from it that double (an eighth of the
    guess first) until one lands on the other side of the edge, then halving; when they run out, the nearest
    count known to fit (``n`` is taken to fit where the fewest are asked for, 0 where the most are). A good guess
    (price shares) is near the edge, where a first halving would land far from it."""
    lo, hi = 0, n  # the count sought is in lo..hi; hi (fewest) or lo (most) is known, or taken, to fit
    mid = min(max(guess, 1), n)
    step, first, halving = max(1, mid // 8), None, False
    for _ in range(probes):
        if lo >= hi:
            break
        ok = fits(mid)
        if fewest:
            lo, hi = (lo, mid) if ok else (mid + 1, hi)
        else:
            lo, hi = (mid, hi) if ok else (lo, mid - 1)
        first = ok if first is None else first
        if not halving and ok == first:  # still on the guess's side: a step twice as far, toward the edge
            mid = min(max(mid - step if ok == fewest else mid + step, lo), hi)
            step *= 2
            halving = mid == (hi if fewest else lo)  # the end known to fit: nothing to ask there
        else:
            halving = True
        if halving:
            mid = (lo + hi) // 2 if fewest else (lo + hi + 1) // 2
    return hi if fewest else lo


@dataclass
class PoolOutcome:
    chosen: PoolChoice
    singles: list[dict[str, Any]]  # per kind: what serving everything on it costs, or why it cannot


def plan_pool(planner: PoolPlanner) -> PoolOutcome:
    """Steps 1-3 of the module's docstring."""
    kinds, n = planner.pool.kinds, len(planner.workload)
    prices = np.full((len(kinds), n), np.inf)
    singles: list[dict[str, Any]] = []
    options: list[PoolChoice] = []
    for j, k in enumerate(kinds):
        members = np.flatnonzero(planner.servable[k.name])
        row: dict[str, Any] = {"kind": k.name, "gpus": None, "cost_per_hour": None, "judged": False}
        singles.append(row)
        if not len(members):
            row["why_not"] = "cannot serve any of the adapters (rank or request length)"
            continue
        planner.say(f"kind {k.name}: packing the {len(members):,} adapters it can serve"
                     + (" with the twin (no surrogate ships)" if planner.twin_packed(k) else ""))
        pack = planner.pack(k, members, priced=True)
        prices[j] = planner.adapter_prices(pack)
        if len(members) < n:
            row["why_not"] = f"cannot serve {n - len(members):,} of the adapters (rank or request length)"
        elif k.spec.count is not None and pack.gpus > k.spec.count:
            row.update(gpus=pack.gpus, cost_per_hour=pack.cost,
                       why_not=f"needs {pack.gpus} GPUs, {k.spec.count} available")
        else:
            row.update(gpus=pack.gpus, cost_per_hour=pack.cost)
            options.append(PoolChoice([pack], k.name))
    bound = min((c.cost for c in options), default=np.inf)
    try:
        options += planner.mixes(prices, bound)
    except InfeasibleError:
        if not options:
            raise
    best: PoolChoice | None = None
    pending = sorted(options, key=_judging_order)
    seen = {o.key() for o in options}
    retrims = 0
    while pending:
        option = pending.pop(0)
        if option.single is None and (best is None or option.cost < best.cost):
            option = planner.surrogate_judged(option)
        option = _alone_first(planner, option, pending, best)
        if best is not None and option.cost >= best.cost and not _alone_within_a_gpu(planner, option, best.cost):
            continue  # judging only adds GPUs to a packing: it cannot beat the best judged
        if best is not None and option.single is None and planner.expected_cost(option) >= best.cost:
            continue  # as its twin-packed kinds judged alone show, it would not be cheaper either
        judged = planner.judge(option, np.inf if best is None or option.single is not None else best.cost)
        if judged is None:
            continue
        planner.say(("judged: " if option.single is None else f"judged, {option.single} alone: ")
                    + " + ".join(f"{p.gpus} x {p.kind.name}" for p in judged.packs) + f", {judged.cost:g}/h")
        planner.learn_shortfall(option, judged)
        _record_single(singles, judged)
        over = judged.over_count()
        if not over and (best is None or judged.cost < best.cost):
            best = judged
        elif over and option.single is None and retrims < RETRIMS:
            # That mix with the GPUs over the counts given up, and the mixes formed again keeping room for them.
            retrims += 1
            trimmed = planner.trimmed(judged, prices)
            if trimmed is not None and trimmed.key() not in seen:
                seen.add(trimmed.key())
                pending.append(trimmed)
            for p in over:
                planner.slack[p.kind.name] = planner.slack.get(p.kind.name, 0) + p.gpus - p.kind.spec.count
            planner.say("a judged mix needs more GPUs of " + ", ".join(p.kind.name for p in over)
                        + " than the pool has: trying it with the adapters of the GPUs over the count on their next "
                          "cheapest kind, and mixing again with room kept for that")
            try:
                again = planner.mixes(prices, min(bound, np.inf if best is None else best.cost))
            except InfeasibleError:
                again = []
            fresh = [o for o in again if o.key() not in seen]
            seen |= {o.key() for o in fresh}
            pending = sorted(pending + fresh, key=_judging_order)
    if best is None:
        raise InfeasibleError("judged in the twin, every way to serve the workload needs more GPUs of a kind than "
                              "the pool's count allows")
    return PoolOutcome(best, singles)


def _alone_within_a_gpu(planner: PoolPlanner, option: PoolChoice, cost: float) -> bool:
    """Is ``option`` a kind the twin packs, alone, whose packing costs less than ``cost`` (the best judged, or what
    a mix is expected to cost judged) but for one GPU? Its estimate's shorter runs can pack a GPU more than the
    judging runs (mixed lengths, seed 2: 29 GPUs of the 80 GB kind where ``planner plan --profile`` judged 28), so
    it is judged: a pool plan costs no more than ``planner plan`` of any kind alone."""
    if option.single is None or not planner.twin_packed(option.packs[0].kind):
        return False
    return option.cost - option.packs[0].kind.price < cost - 1e-9


def _alone_first(planner: PoolPlanner, option: PoolChoice, pending: list[PoolChoice],
                 best: PoolChoice | None) -> PoolChoice:
    """``option``, or, where it is a mix (its kinds with a surrogate judged: :meth:`PoolPlanner.surrogate_judged`),
    a kind the twin packs alone that will be judged however the mix judges (:func:`_alone_within_a_gpu` of what
    the mix is expected to cost judged, :data:`ESTIMATE_SHORTFALL` more GPUs of its twin-packed kinds until one was
    judged alone, and of the best judged): that one first, ``option`` back in ``pending``. The mix then keeps the
    GPUs judged for the kind alone (PoolPlanner._reused) instead of packing its share of that kind in full again,
    or is passed over where the kind alone came out cheaper (a hot 10,000-adapter fleet's mix, 2 GPUs cheaper as
    packed than the 80 GB kind alone, and that kind alone were both judged in full: 984 s, 3.5x the single-kind
    plans; a rank-32 one at `80gb-at-par`, whose 64 GB share's judging added 3 GPUs: 429 s, 2.2x, until that share
    was judged before weighing them)."""
    if option.single is not None:
        return option
    expected = planner.expected_cost(option, 1.0 + ESTIMATE_SHORTFALL)
    for alone in pending:
        if _alone_within_a_gpu(planner, alone, expected) and (best is None or _alone_within_a_gpu(
                planner, alone, best.cost)):
            pending.remove(alone)
            pending.insert(0, option)
            return alone
    return option


def _judging_order(choice: PoolChoice) -> tuple[float, bool]:
    return choice.cost, choice.single is None


def _record_single(singles: list[dict[str, Any]], choice: PoolChoice) -> None:
    if choice.single is not None:
        row = next(r for r in singles if r["kind"] == choice.single)
        row.update(gpus=choice.packs[0].gpus, cost_per_hour=choice.cost, judged=True)


def make_pool_plan(workload_path: str | os.PathLike, workload: Workload, pool: Pool,
                   predictor_for: Callable[[Profile], Predictor], opts: PlanOptions,
                   progress: Progress | None = None) -> Placement:
    """The cheapest plan of ``workload`` over ``pool``'s kinds (InfeasibleError when the pool cannot hold it)."""
    if opts.algorithm != "greedy" or not opts.confirm:
        raise BadInputError("--pool plans with --algorithm greedy, every GPU judged in the twin "
                            "(drop --algorithm / --no-confirm)")
    planner = PoolPlanner(workload, pool, predictor_for, opts, progress)
    outcome = plan_pool(planner)
    parts = []
    for p in outcome.chosen.packs:
        insts = build_instances(p.req, p.groups, twin=p.confirmation.rows)
        for n, inst in enumerate(insts):
            inst.instance_id = f"{instance_prefix(p.kind)}{n}"
        parts.append((p.kind, insts, p.confirmation.to_dict()))
    return pool_placement(workload_path, planner, parts, outcome.singles)


def instance_prefix(kind: Kind) -> str:
    return f"{kind.name}-gpu-"


def pool_placement(workload_path, planner: PoolPlanner, parts: list[tuple[Kind, list, dict | None]],
                   singles: list[dict[str, Any]]) -> Placement:
    """A pool plan from each kind's instances and confirmation (the first kind's is ``inputs.confirmation``)."""
    whole = planner.whole_request()
    inputs = plan_inputs(workload_path, whole, "greedy")
    records = {k.name: {**kind_record(k), "predictor": planner.predictors[k.name].kind} for k in planner.pool.kinds}
    instances = []
    for kind, insts, confirmation in parts:
        for inst in insts:
            inst.kind = kind.name
        instances += insts
        if confirmation is not None:
            records[kind.name]["confirmation"] = confirmation
    first = parts[0][0] if parts else planner.pool.reference
    inputs.pop("profile_path", None)
    inputs.update(first.profile.record())
    if parts and parts[0][2] is not None:
        inputs["confirmation"] = parts[0][2]
    inputs["pool"] = {"path": planner.pool.path, "sha256": planner.pool.sha256, "kinds": list(records.values()),
                      "single_kind": singles}
    return Placement(inputs=inputs, instances=instances, adapters=adapter_rows(whole),
                     engine=engine_settings(first.profile))


def kind_record(kind: Kind) -> dict[str, Any]:
    """The kind as a plan records it (``inputs.pool.kinds``): its profile by id (and file, where not shipped), and its
    engine settings."""
    return {"name": kind.name, **kind.profile.record(), "price_per_hour": kind.price,
            "count": kind.spec.count, "node_selector": kind.spec.selector(), "resource": kind.resource,
            "engine": engine_settings(kind.profile)}
