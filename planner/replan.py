"""Nightly re-planning: the fewest GPUs that pass, then the least churn, from the plan deployed now.

The objective, in order:

1. **Every GPU passes** the plan's rule (:mod:`planner.verdict`: the SLO and the served share, judged in
   the twin as ``planner plan`` judges). Moves this needs are made whatever the budget.
2. **GPUs**: no more than a fresh plan of the same day needs, plus ``ChurnBudget.gpu_tolerance``.
3. **Churn**: adapters moved and engines restarted, within the user's budget; a GPU is consolidated
   away only while the budget allows.

How (a local search around the deployed plan; a GPU's feasibility is the twin's verdict, which no linear
model of capacity reproduces at the SLO's knee, so each step is proposed by the plan's predictor and
accepted by the twin):

* Every previous GPU keeps the adapters still in the workload, with their traffic shares, and is judged
  as it stands. One that passes is left alone: the same workload gives no change at all.
* A GPU that falls short gives up its hottest adapters, one at a time, until the predictor says the rest
  pass with the engine as started (reason ``short``); if no eviction can do it, it restarts with the
  ``--max-loras`` the predictor prefers (a restart, with its reason).
* New adapters and those given up go, hottest first, to the GPU with the most slack in the twin's last
  judgement (p99 TTFT and TPOT against their limits; then the least load) that takes them without a
  restart (its ``--max-lora-rank`` holds their rank, its ``--max-cpu-loras`` has room, and the predictor
  says it still passes), else to new GPUs packed by ``planner plan``'s greedy, confirmed.
* The twin judges every GPU that changed; one that fails goes round again (at most ``REPAIR_ROUNDS``).
* A fresh plan of the same day is packed too. While the re-plan needs more GPUs than it (plus the
  tolerance), the GPU with the fewest adapters is emptied into the others' room (reason
  ``consolidation``), if the moves budget allows and the twin passes every GPU that takes them (a
  replicated adapter's share is spread over its other replicas first, so a hot adapter that cooled gives
  up a replica and nothing else moves; a GPU that could not be emptied is not tried again); when no
  GPU can be emptied, the adapters of the least-loaded few are packed again onto fewer; and when that
  cannot reach the target either, the fresh plan is laid onto the GPUs (each of its groups on the GPU it
  shares most traffic with), within the budget. Without ``--max-moves`` the last GPU above the target is
  saved only within the adapters whose rate changed materially plus 5 % (``LAST_GPU_MOVES``).
* New groups take over the GPUs of previous instances left with nothing, the ones sharing most adapters
  first, so one engine reloads adapters instead of one stopping and another starting.

The result carries a ``changes`` section: per instance the adapters to load and unload, whether the
engine restarts and why (``--max-loras``, ``--max-lora-rank`` and ``--max-cpu-loras`` are start-up
settings), every moved adapter with its reason, and the GPUs a fresh plan would use.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from planner.confirm import Progress, check_groups, pack_confirmed, scenarios_of
from planner.greedy import plan_greedy
from planner.lower_bound import LowerBound, lower_bound
from planner.packing import GpuGroup, PackRequest, a_max_limit, best_a_max, keeps_up, passing
from planner.placement import (
    SHARE_DECIMALS,
    InstancePlan,
    Placement,
    adapter_rows,
    build_instances,
    cpu_slots,
    engine_settings,
    plan_inputs,
)
from planner.plan import UNLIMITED_GPUS
from planner.verdict import DEFAULT_BAR, DEFAULT_RUN, ServiceBar, TwinRun
from twin.atomic import file_kind, output_path
from twin.errors import BadInputError, InfeasibleError, LoraPlannerError, printable

_SHARE_EPS = 1e-9
#: Rounds of repairing GPUs the twin finds short before what is left is packed anew.
REPAIR_ROUNDS = 4
#: Rounds of placing adapters on GPUs with room, the ones the twin fails giving theirs back: near the twin's
#: knee about half the GPUs the predictor lets take more fail, so four rounds left a sixteenth unplaced.
PLACING_ROUNDS = 8
#: Receiving GPUs tried per adapter to place (the most slack in the twin first).
CANDIDATES = 16
#: GPUs tried as the one to empty per consolidation step.
CONSOLIDATION_TRIES = 40
#: Without ``--max-moves``, the last GPU above the fresh plan (plus the tolerance) is saved only while the
#: night's moves stay within the adapters whose rate changed by more than MATERIAL_CHANGE plus this share of
#: all adapters: repacking the least-loaded GPUs to save it moved 1,264 of 2,000 adapters (357 had changed)
#: on one simulated night, where keeping it a night longer costs one GPU.
LAST_GPU_MOVES = 0.05
MATERIAL_CHANGE = 0.25


@dataclass(frozen=True)
class ChurnBudget:
    """How much a re-plan may change beyond what the SLO forces."""

    max_moves: int | None = None  # adapters moved to save GPUs (None: no limit)
    max_restarts: int | None = None  # engines restarted to keep adapters in place (None: no limit)
    gpu_tolerance: int = 0  # GPUs above a fresh plan of the same day accepted without consolidating

    @classmethod
    def parse(cls, max_moves: str | None, max_restarts: int | None, gpu_tolerance: int, adapters: int) -> ChurnBudget:
        """``max_moves``: a count (``120``) or a share of the workload's adapters (``5%``)."""
        moves = None
        if max_moves is not None:
            text = max_moves.strip()
            try:
                moves = (int(float(text[:-1]) / 100.0 * adapters) if text.endswith("%") else int(text))
            except (ValueError, OverflowError):  # OverflowError: inf%
                raise BadInputError(f"--max-moves must be a count (120) or a share of the adapters (5%), "
                                    f"not {max_moves!r}") from None
            if moves < 0:
                raise BadInputError(f"--max-moves must be >= 0, not {max_moves!r}")
        if max_restarts is not None and max_restarts < 0 or gpu_tolerance < 0:
            raise BadInputError("--max-restarts and --gpu-tolerance must be >= 0")
        return cls(moves, max_restarts, gpu_tolerance)


class _Slot:
    """One GPU while it is re-planned: its adapters and the engine it runs; ``prev`` is the previous instance
    it is (None: a GPU new tonight)."""

    def __init__(self, prev: InstancePlan | None, shares: dict[int, float], a_max: int, max_lora_rank: int,
                 max_cpu_loras: int, row: dict | None = None):
        self.prev = prev
        self.shares = shares
        self.a_max, self.max_lora_rank, self.max_cpu_loras = a_max, max_lora_rank, max_cpu_loras
        self.restart: list[str] = []  # why its engine restarts (empty: it does not; a new GPU starts anyway)
        self.changed = prev is None
        self.row = row

    @classmethod
    def kept(cls, prev: InstancePlan, shares: dict[int, float]) -> _Slot:
        return cls(prev, shares, prev.a_max, prev.max_lora_rank, prev.max_cpu_loras)

    def state(self) -> tuple:
        """What a trial may change, to :meth:`restore` it."""
        return dict(self.shares), self.a_max, self.max_lora_rank, self.max_cpu_loras, list(self.restart), self.changed, \
            self.row

    def restore(self, state: tuple) -> None:
        self.shares, self.a_max, self.max_lora_rank, self.max_cpu_loras, self.restart, self.changed, self.row = state

    @property
    def group(self) -> GpuGroup:
        return GpuGroup(dict(self.shares), self.a_max, self.max_lora_rank)

    @property
    def pressure(self) -> float:
        """How close the twin's last judgement put this GPU to its SLO: the larger of p99 TTFT and p99 TPOT
        over their limits (0 when it was not judged in the twin). The twin's knee, not the load in tokens,
        says which GPUs have room: at 10k adapters most GPUs the predictor let take more failed in the twin."""
        row = self.row or {}
        return max((row.get(f) or 0.0) / (row.get(limit) or np.inf)
                   for f, limit in (("ttft_ms_p99", "max_ttft_ms"), ("tpot_ms_p99", "max_tpot_ms")))

    def room_for(self, rank: int) -> bool:
        """Whether one more adapter of ``rank`` can load without a restart."""
        return rank <= self.max_lora_rank and len(self.shares) < self.max_cpu_loras


class _Judge:
    """The plan's rule on a list of groups: the twin's verdict when confirming, else the predictor's."""

    def __init__(self, req: PackRequest, run: TwinRun, bar: ServiceBar, confirm: bool):
        self.req, self.run, self.bar, self.confirm = req, run, bar, confirm

    def check(self, groups: list[GpuGroup]) -> tuple[np.ndarray, list[dict | None]]:
        if not groups:
            return np.zeros(0, bool), []
        if self.confirm:
            check = check_groups(self.req, groups, self.run, self.bar)
            return check.meets(self.bar), [check.row(k, self.bar) for k in range(len(groups))]
        scenarios = scenarios_of(self.req, groups)
        return passing(self.req, self.req.predictor.predict(scenarios), scenarios), [None] * len(groups)


class _Replan:
    def __init__(self, previous: Placement, req: PackRequest, judge: _Judge, budget: ChurnBudget, split_hot: bool,
                 progress: Progress | None):
        self.req, self.judge, self.budget, self.split_hot, self.progress = req, judge, budget, split_hot, progress
        index = {a.adapter_id: i for i, a in enumerate(req.workload.adapters)}
        self.slots: list[_Slot] = []
        self.freed: list[InstancePlan] = []  # previous instances left with nothing
        served, replicas = np.zeros(len(index)), np.zeros(len(index))
        for prev in previous.instances:
            shares = {index[a]: s for a, s in prev.adapters.items() if a in index}
            if not shares:
                self.freed.append(prev)
                continue
            self.slots.append(_Slot.kept(prev, shares))
            for i, s in shares.items():
                served[i] += s
                replicas[i] += 1
        # Shares were written rounded: three replicas of a third read back as 0.999999, served in full, not
        # a 1e-6 share to place on another GPU (a re-plan of the same workload must change nothing), and two
        # halves as 1.000001, which merged on one GPU would be more than the adapter's traffic: each adapter
        # served in full gets shares that sum to 1.
        written = replicas * 0.5 * 10.0 ** -SHARE_DECIMALS + _SHARE_EPS
        whole = (np.abs(served - 1.0) <= written) & (served != 1.0)
        for slot in self.slots:
            for i in slot.shares:
                if whole[i]:
                    slot.shares[i] /= served[i]
        served[whole] = 1.0
        self.pending: dict[int, float] = {int(i): float(1.0 - s) for i, s in enumerate(served) if 1.0 - s > written[i]}
        self.moves: dict[int, str] = {}  # adapter index -> why it left its previous GPU
        self.kept_whole: set[_Slot] = set()  # GPUs the others could not absorb: they only fill up meanwhile
        self.cap: int | None = None  # moves allowed in all, without --max-moves (``moves_left``)
        self.held_back: list[str] = []  # what the churn budget kept the re-plan from doing, in words
        before = {a["adapter_id"]: a["rate_rps"] for a in previous.adapters}
        self.changed_materially = materially_changed(before, {a.adapter_id: a.rate_rps for a in req.workload.adapters})

    def log(self, msg: str) -> None:
        if self.progress:
            self.progress(msg)

    def load(self, shares: dict[int, float]) -> float:
        return float(sum(self.req.arriving_tok_s[i] * s for i, s in shares.items()))

    # -- repair ------------------------------------------------------------------------------------------

    def repair(self) -> None:
        """Every previous GPU passes again (``fix_short``), the adapters waiting go where there is room
        (``fill_room``), and what is left gets new GPUs."""
        self.fix_short()
        self.fill_room()
        self.pack_new()

    def fix_short(self) -> None:
        """Judge every GPU as it stands; the short ones shed adapters (or restart) and are judged again, for
        ``REPAIR_ROUNDS`` rounds; a GPU still short then gives up all its adapters."""
        todo = list(self.slots)
        for rounds in range(1, REPAIR_ROUNDS + 1):
            ok, rows = self.judge.check([s.group for s in todo])
            for s, row in zip(todo, rows):
                s.row = row
            todo = [s for s, good in zip(todo, ok) if not good]
            if not todo:
                break
            self.log(f"re-plan: {len(todo)} GPU(s) fall short with the new traffic; repairing them (round {rounds})")
            for s in todo:
                self.shed(s, rounds, everything=rounds == REPAIR_ROUNDS)
            todo = [s for s in todo if s.shares]
        self.drop_empty()

    def drop_empty(self) -> None:
        for s in [s for s in self.slots if not s.shares]:
            self.drop(s)

    def drop(self, slot: _Slot) -> None:
        self.slots.remove(slot)
        if slot.prev is not None:
            self.freed.append(slot.prev)

    def shed(self, slot: _Slot, rounds: int, everything: bool = False) -> None:
        """Make a short GPU pass by the predictor: its hottest adapters leave, or else its engine restarts with
        the A_max the predictor prefers. A GPU the predictor passes as it is (the twin did not) gives up one
        more adapter each round; with ``everything`` it gives up all."""
        req = self.req
        shares = dict(slot.shares)
        order = sorted(shares, key=lambda i: -req.arriving_tok_s[i] * shares[i])
        gone: list[int] = []
        must = len(order) if everything else rounds if keeps_up(req, shares, slot.a_max, slot.max_lora_rank) else 0
        while shares and (len(gone) < must or not keeps_up(req, shares, slot.a_max, slot.max_lora_rank)):
            i = order[len(gone)]
            gone.append(i)
            del shares[i]
        if not everything and len(gone) > max(1, len(slot.shares) // 4) and self.may_restart():
            verdict = best_a_max(req, slot.shares)
            if verdict.ok and verdict.a_max != slot.a_max:  # a new --max-loras keeps every adapter
                self.restart(slot, verdict.a_max, f"fell short with its traffic at --max-loras {slot.a_max}; "
                                                  f"{verdict.a_max} serves it without moving {len(gone)} adapters")
                return
        for i in gone:
            self.pending[i] = self.pending.get(i, 0.0) + slot.shares.pop(i)
            self.moves.setdefault(i, "short: its GPU fell short of the SLO with the new traffic")
        slot.changed = True

    @property
    def restarts(self) -> int:
        return sum(1 for s in self.slots if s.restart and s.prev is not None)

    def may_restart(self) -> bool:
        return self.budget.max_restarts is None or self.restarts < self.budget.max_restarts

    def restart(self, slot: _Slot, a_max: int, why: str) -> None:
        """Start ``slot``'s engine again with ``a_max`` (and the rank and host slots its adapters need),
        recording every start-up setting that changes and why."""
        rank = self.req.profile.kv.rank_for(int(self.req.ranks[list(slot.shares)].max()))
        if slot.prev is None:  # a new GPU is not running yet: it starts with what it needs
            slot.a_max, slot.max_lora_rank, slot.max_cpu_loras = a_max, rank, cpu_slots(len(slot.shares), a_max)
            return
        settings, reasons = engine_change((slot.a_max, slot.max_lora_rank, slot.max_cpu_loras), a_max, rank,
                                          len(slot.shares), why)
        if not reasons:
            return
        slot.restart += reasons
        slot.a_max, slot.max_lora_rank, slot.max_cpu_loras = settings
        slot.changed = True

    def fill_room(self) -> None:
        """Put waiting adapters, hottest first, on the least-loaded GPUs that take them without a restart (the
        predictor's check), judge the GPUs that took some, and take back what a GPU the judge fails took (that
        GPU takes no more); ``PLACING_ROUNDS`` rounds."""
        full: set[int] = set()
        for _ in range(PLACING_ROUNDS):
            took = self.place_pending(full)
            if not took:
                return
            ok, rows = self.judge.check([s.group for s in took])
            for (s, added), good, row in zip(took.items(), ok, rows):
                if good:
                    s.row, s.changed = row, True
                    continue
                for i, share in added.items():
                    s.shares[i] -= share
                    if s.shares[i] <= _SHARE_EPS:
                        del s.shares[i]
                    self.pending[i] = self.pending.get(i, 0.0) + share
                full.add(id(s))
            if ok.all():
                return

    def place_pending(self, full: set[int]) -> dict[_Slot, dict[int, float]]:
        """One pass of :meth:`fill_room`: per GPU that took adapters, what it took."""
        req = self.req
        open_slots = [s for s in self.slots if id(s) not in full]
        loads = {id(s): self.load(s.shares) for s in open_slots}
        took: dict[_Slot, dict[int, float]] = {}
        for i, share in sorted(self.pending.items(), key=lambda e: -req.arriving_tok_s[e[0]] * e[1]):
            rank = int(req.ranks[i])
            fits = sorted((s for s in open_slots if s.room_for(rank) or i in s.shares),
                          key=lambda s: (s.max_lora_rank != rank, s.pressure, loads[id(s)]))
            for s in fits[:CANDIDATES]:
                trial = {**s.shares, i: s.shares.get(i, 0.0) + share}
                if keeps_up(req, trial, s.a_max, s.max_lora_rank):
                    s.shares = trial
                    loads[id(s)] += req.arriving_tok_s[i] * share
                    took.setdefault(s, {})[i] = share
                    del self.pending[i]
                    break
        return took

    def pack_new(self) -> None:
        """New GPUs for what is still pending: greedy, confirmed like a fresh plan."""
        if not self.pending:
            return
        entries = list(self.pending.items())
        self.log(f"packing {len(entries)} adapter entries on new GPUs")
        groups, rows = self.packed(entries, self.req.max_gpus - len(self.slots))
        kv = self.req.kv
        for g, row in zip(groups, rows):
            rank = g.max_lora_rank or kv.rank_for(int(self.req.ranks[g.members].max()))
            self.slots.append(_Slot(None, dict(g.shares), g.a_max, rank, cpu_slots(len(g), g.a_max), row))
        self.pending.clear()

    def packed(self, entries, max_gpus: int) -> tuple[list[GpuGroup], list[dict | None]]:
        if self.judge.confirm:
            groups, conf = pack_confirmed(self.req, self.split_hot, True, self.judge.run, self.judge.bar, None,
                                          entries=entries, max_gpus=max_gpus)
            return groups, conf.rows
        groups = plan_greedy(self.req, self.split_hot, True, entries, max_gpus)
        return groups, [None] * len(groups)

    # -- consolidation -----------------------------------------------------------------------------------

    def consolidate(self, fresh: list[GpuGroup], rows: list[dict | None]) -> None:
        """Empty GPUs into the others' room while the re-plan needs more than the fresh plan ``fresh`` + the
        tolerance and the moves budget allows (each emptied GPU judged away by the twin on every GPU that takes
        its adapters). If that cannot reach the target, the fresh plan itself is laid onto the GPUs, each of its
        groups on the GPU it shares most traffic with, when the budget allows the moves."""
        target = len(fresh) + self.budget.gpu_tolerance
        while len(self.slots) > target:
            if len(self.slots) == target + 1 and self.budget.max_moves is None:
                self.cap = self.changed_materially + int(LAST_GPU_MOVES * len(self.req.arriving_tok_s))
            if not self.empty_one() and not self.merge_lightest(len(self.slots) - target):
                break
        if len(self.slots) > target and self.take_over(list(self.slots), fresh, rows,
                                                       "consolidation: the fresh plan of the day needs fewer GPUs"):
            self.log(f"consolidation: laid the fresh plan onto the GPUs; {len(self.slots)} GPUs")

    def moves_left(self) -> float:
        """Moves the budget still allows: ``--max-moves``, else the cap on saving the last GPU once it is
        the one left to save (:data:`LAST_GPU_MOVES`), else no limit."""
        cap = self.budget.max_moves if self.budget.max_moves is not None else self.cap
        return np.inf if cap is None else cap - len(self.moves)

    def empty_one(self) -> bool:
        """Empty one GPU into the others: new GPUs first (no adapter of theirs has moved in yet), then the
        fewest adapters (the fewest moves), then the lightest (the easiest to absorb)."""
        open_slots = [s for s in self.slots if s not in self.kept_whole]
        fewest = sorted(open_slots, key=lambda s: (s.prev is not None, len(s.shares), self.load(s.shares)))
        lightest = sorted(open_slots, key=lambda s: (s.prev is not None, self.load(s.shares)))
        tried: set[int] = set()
        for victim in fewest[:CONSOLIDATION_TRIES] + lightest[:CONSOLIDATION_TRIES]:
            if id(victim) in tried or victim.prev is not None and len(victim.shares) > self.moves_left():
                continue
            tried.add(id(victim))
            others = [s for s in self.slots if s is not victim]
            saved = {id(s): s.state() for s in others}
            if self.absorb(victim, others):
                if victim.prev is not None:
                    for i in victim.shares:
                        self.moves.setdefault(i, "consolidation: its GPU was emptied to save a GPU")
                self.drop(victim)
                self.log(f"consolidation: emptied {'a new GPU' if victim.prev is None else victim.prev.instance_id}"
                         f" ({len(victim.shares)} adapters); {len(self.slots)} GPUs")
                return True
            for s in others:  # undo the trial
                s.restore(saved[id(s)])
            self.kept_whole.add(victim)
        return False

    def merge_lightest(self, excess: int) -> bool:
        """Pack the adapters of the ``k`` least-loaded GPUs again onto fewer, judged like a fresh plan, for ``k``
        from ``excess`` + 1, doubling (the fewest GPUs touched first): what emptying one GPU at a time cannot do
        when every GPU has a little room and none has enough for a whole GPU's adapters. Each new group goes to
        the GPU it shares most traffic with, so only the other adapters move; within the moves and restarts
        budget."""
        by_load = sorted(self.slots, key=lambda s: self.load(s.shares))
        k = excess + 1
        while k <= len(by_load):
            chosen, k = by_load[:k], 2 * k
            pooled: dict[int, float] = {}
            for slot in chosen:
                for i, share in slot.shares.items():
                    pooled[i] = pooled.get(i, 0.0) + share
            try:
                groups, rows = self.packed(list(pooled.items()), len(chosen) - 1)
            except InfeasibleError:
                continue
            if self.take_over(chosen, groups, rows, "consolidation: its GPU was emptied to save a GPU"):
                self.log(f"consolidation: packed the adapters of the {len(chosen)} least-loaded GPUs onto {len(groups)}; "
                         f"{len(self.slots)} GPUs")
                return True
        return False

    def take_over(self, chosen: list[_Slot], groups: list[GpuGroup], rows: list[dict | None], why: str) -> bool:
        """Put ``groups`` on ``chosen`` GPUs (the most shared traffic first; the GPUs left over are emptied) if
        the moves and restarts this takes fit the budget; a moved adapter's reason is ``why``. False leaves
        everything as it was."""
        home = self.homes(chosen, groups)
        group_on = {b: a for a, b in home.items()}
        moved = {i for b, slot in enumerate(chosen) if slot.prev is not None for i in slot.shares
                 if b not in group_on or i not in groups[group_on[b]].shares}
        saved = {id(s): s.state() for s in chosen}
        for a, b in home.items():
            slot, group = chosen[b], groups[a]
            slot.shares, slot.row, slot.changed = dict(group.shares), rows[a], True
            self.restart(slot, group.a_max, f"it took a new group of adapters ({why})")
        over_budget = len(moved - set(self.moves)) > self.moves_left() or (
            self.budget.max_restarts is not None and self.restarts > self.budget.max_restarts)
        if over_budget:
            for slot in chosen:
                slot.restore(saved[id(slot)])
            return False
        for i in moved:
            self.moves.setdefault(i, why)
        for b, slot in enumerate(chosen):
            if b not in group_on:
                slot.shares = {}
                self.drop(slot)
        return True

    def homes(self, chosen: list[_Slot], groups: list[GpuGroup]) -> dict[int, int]:
        """Group index -> index of the GPU in ``chosen`` it goes to: greedily, the pair sharing the most traffic
        first; groups sharing none with any GPU left take the free GPUs last. Only pairs that share an adapter
        are scored, so a fleet-wide take-over costs the adapters' count, not groups x GPUs."""
        of_adapter: dict[int, list[tuple[int, float]]] = {}
        for a, g in enumerate(groups):
            for i, share in g.shares.items():
                of_adapter.setdefault(i, []).append((a, share))
        overlap: dict[tuple[int, int], float] = {}
        for b, slot in enumerate(chosen):
            for i, held in slot.shares.items():
                for a, share in of_adapter.get(i, ()):
                    overlap[a, b] = overlap.get((a, b), 0.0) + min(share, held) * self.req.arriving_tok_s[i]
        home: dict[int, int] = {}
        taken: set[int] = set()
        for _, a, b in sorted(((v, a, b) for (a, b), v in overlap.items() if v > 0), reverse=True):
            if a not in home and b not in taken:
                home[a] = b
                taken.add(b)
        free = [b for b in range(len(chosen)) if b not in taken]
        for a in reversed(range(len(groups))):
            if a not in home:
                home[a] = free.pop()
        return home

    def absorb(self, victim: _Slot, others: list[_Slot]) -> bool:
        """Move every adapter of ``victim`` onto ``others`` (changing them in place): each to a GPU the
        predictor says takes it, then the twin judges the GPUs that took some; one it fails gives its new
        adapters back to be placed elsewhere (and takes no more), for ``PLACING_ROUNDS`` rounds. False when an
        adapter finds no GPU that passes."""
        req = self.req
        why = (f"took adapters of {victim.prev.instance_id}, emptied to save a GPU" if victim.prev is not None
               else "took adapters planned for a new GPU, so that GPU need not start")
        waiting = dict(victim.shares)
        closed: set[int] = set()
        for _ in range(PLACING_ROUNDS):
            open_slots = [s for s in others if id(s) not in closed]
            before = {id(s): s.state() for s in open_slots}
            loads = {id(s): self.load(s.shares) for s in open_slots}
            took: dict[_Slot, dict[int, float]] = {}
            for i, share in sorted(waiting.items(), key=lambda e: -req.arriving_tok_s[e[0]] * e[1]):
                parts = self.spread(i, share, [s for s in open_slots if i in s.shares])
                if not parts:
                    rank = int(req.ranks[i])  # GPUs whose rank holds it first (no restart for rank), least loaded first
                    order = sorted(open_slots, key=lambda s: (s.max_lora_rank < rank, s.pressure, loads[id(s)]))
                    target = self.receiver(i, share, order, why)
                    if target is None:
                        return False
                    parts = {target: share}
                for target, part in parts.items():
                    loads[id(target)] += req.arriving_tok_s[i] * part
                    added = took.setdefault(target, {})
                    added[i] = added.get(i, 0.0) + part
            waiting = {}
            ok, rows = self.judge.check([s.group for s in took])
            for (s, added), good, row in zip(took.items(), ok, rows):
                if good:
                    s.row, s.changed = row, True
                    continue
                s.restore(before[id(s)])  # its adapters and engine as before this round
                for i, share in added.items():
                    waiting[i] = waiting.get(i, 0.0) + share
                closed.add(id(s))
            if not waiting:
                return True
        return False

    def spread(self, i: int, share: float, holders: list[_Slot]) -> dict[_Slot, float]:
        """Spread ``share`` of a replicated adapter ``i`` over the GPUs already serving it, in proportion to
        their shares, if the predictor says each still passes (they change in place); else nothing. A hot
        adapter whose traffic fell gives up a replica so, moving nothing else."""
        if not holders:
            return {}
        held = sum(s.shares[i] for s in holders)
        parts = {s: share * s.shares[i] / held for s in holders}
        trials = {s: {**s.shares, i: s.shares[i] + part} for s, part in parts.items()}
        if not all(keeps_up(self.req, t, s.a_max, s.max_lora_rank) for s, t in trials.items()):
            return {}
        for s, t in trials.items():
            s.shares = t
        return parts

    def receiver(self, i: int, share: float, order: list[_Slot], why: str) -> _Slot | None:
        """The first GPU of ``order`` taking adapter ``i`` as it runs, else (a restart, within the budget, for
        reason ``why``) at the A_max the predictor prefers; it is changed to hold ``i``."""
        req, rank = self.req, int(self.req.ranks[i])
        for s in order[:CANDIDATES]:
            if s.room_for(rank) or i in s.shares:
                trial = {**s.shares, i: s.shares.get(i, 0.0) + share}
                if keeps_up(req, trial, s.a_max, s.max_lora_rank):
                    s.shares = trial
                    return s
        if not self.may_restart():
            return None
        for s in order[:CANDIDATES]:
            trial = {**s.shares, i: s.shares.get(i, 0.0) + share}
            verdict = best_a_max(req, trial)
            if verdict.ok:
                s.shares = trial
                self.restart(s, verdict.a_max, why)
                return s
        return None


def materially_changed(before: dict[str, float], after: dict[str, float], threshold: float = MATERIAL_CHANGE) -> int:
    """Adapters in both workloads whose rate changed by more than ``threshold`` (relative, either way)."""
    bound = np.log1p(threshold)
    return sum(1 for a, r in after.items()
               if a in before and abs(np.log(max(r, 1e-9) / max(before[a], 1e-9))) > bound)


def replan(previous: Placement, workload_path, req: PackRequest, split_hot: bool = True, confirm: bool = False,
           run: TwinRun = DEFAULT_RUN, bar: ServiceBar = DEFAULT_BAR, budget: ChurnBudget = ChurnBudget(),
           progress: Progress | None = None, id_prefix: str = "gpu-", with_bound: bool = True) -> Placement:
    """Re-plan ``req``'s workload from ``previous`` (module docstring); with ``confirm`` every GPU is judged in
    the twin, else by the request's predictor. New instances are named ``id_prefix`` and a number. With
    ``with_bound`` the lower bound is worked out beside it (``inputs.lower_bound``; a pool re-plan, one
    re-plan per kind, records none, as a pool plan)."""
    judge = _Judge(req, run, bar, confirm)
    bound = lower_bound(req, bar, run.jobs) if with_bound else None  # beside the re-plan, in the twin's workers
    work = _Replan(previous, req, judge, budget, split_hot, progress)
    for s in work.slots:  # a previous engine whose settings no longer start (a new profile) must restart
        if req.kv.tokens_for(s.a_max, s.max_lora_rank) is None or int(req.ranks[list(s.shares)].max()) > s.max_lora_rank:
            verdict = best_a_max(req, s.shares)
            work.restart(s, verdict.a_max if verdict.ok else max(1, a_max_limit(req.kv, req.ranks[list(s.shares)])),
                         "the engine as started no longer fits the profile's memory or the adapters' ranks")
    if budget.max_restarts is not None and work.restarts > budget.max_restarts:
        raise InfeasibleError(f"{work.restarts} engine(s) must restart (their start-up settings no longer fit the "
                              f"profile's memory or their adapters' ranks), more than --max-restarts "
                              f"{budget.max_restarts}; the previous plan is left as it was")
    work.repair()
    # a yardstick: the GPUs allowed (--gpus, a pool kind's count) bound the re-plan, not it (a fresh packing can
    # take more than a plan that was packed otherwise, e.g. as part of a pool plan; it then saves no GPU)
    fresh, fresh_rows = work.packed(None, UNLIMITED_GPUS)
    work.consolidate(fresh, fresh_rows)
    excess = len(work.slots) - len(fresh) - budget.gpu_tolerance
    if excess > 0:
        caps = [f"--max-moves {budget.max_moves}"] if budget.max_moves is not None else []
        caps += [f"--max-restarts {budget.max_restarts}"] if budget.max_restarts is not None else []
        work.held_back.append(f"{excess} GPU(s) above a fresh plan of the day ({len(fresh)}) kept: no GPU could be "
                              "emptied " + (f"within {' and '.join(caps)}" if caps else "within the moves allowed"))
    work.drop_empty()
    if len(work.slots) > req.max_gpus:
        raise InfeasibleError(f"the re-plan needs {len(work.slots)} GPUs, more than the "
                              f"{req.max_gpus} allowed by --gpus")
    placement = _placement(previous, workload_path, req, work, len(fresh), bar if confirm else None,
                           None if bound is None else bound(), id_prefix)
    failing = [i.instance_id for i in placement.instances if not i.ok]
    if confirm and failing:  # every step above keeps only GPUs the twin passed: this is a bug's safety net
        raise InfeasibleError(f"the re-plan has {len(failing)} GPU(s) that fail in the twin "
                              f"({', '.join(failing[:5])}); the previous plan is left as it was")
    return placement


def _placement(previous: Placement, workload_path, req: PackRequest, work: _Replan, fresh_gpus: int,
               bar: ServiceBar | None, bound: LowerBound | None, id_prefix: str) -> Placement:
    slots = sorted(work.slots, key=lambda s: s.prev is None)  # previous GPUs first
    instances = build_instances(req, [s.group for s in slots], twin=[s.row for s in slots] if bar is not None else None)
    for inst, s in zip(instances, slots):  # kept GPUs keep their ids and, without a restart, their engine
        inst.max_cpu_loras = s.max_cpu_loras
        if s.prev is not None:
            inst.instance_id = s.prev.instance_id
    restarts_left = np.inf if work.budget.max_restarts is None else work.budget.max_restarts - work.restarts
    reused = _name_new_instances(previous, [i for i, s in zip(instances, slots) if s.prev is None], work.freed,
                                 restarts_left, work.held_back, id_prefix)
    instances.sort(key=lambda i: _instance_number(i.instance_id))
    inputs = plan_inputs(workload_path, req, "greedy")
    if bar is not None:
        inputs["confirmation"] = {**work.judge.run.to_dict(), **bar.to_dict(),
                                  "failing_gpus": sum(not i.ok for i in instances),
                                  "worst_served": min((i.twin["served"] for i in instances if i.twin), default=None),
                                  "worst_ttft_ms_p99": max((i.twin["ttft_ms_p99"] or 0 for i in instances if i.twin),
                                                           default=None)}
    if bound is not None:
        inputs["lower_bound"] = bound.to_dict()
    placement = Placement(inputs, instances, adapter_rows(req), engine_settings(req.profile))
    restart_reasons = {s.prev.instance_id: s.restart for s in work.slots if s.restart and s.prev is not None}
    restart_reasons.update(reused)
    placement.changes = changes(previous, placement, restart_reasons,
                                {req.adapter_id(i): why for i, why in work.moves.items()}, fresh_gpus)
    placement.changes["held_back"] = work.held_back
    return placement


def _name_new_instances(previous: Placement, new: list[InstancePlan], free: list[InstancePlan],
                        restarts_left: float, held_back: list[str], id_prefix: str) -> dict[str, list[str]]:
    """Name the new instances, reusing the GPUs of previous instances left with nothing: each such GPU takes
    the new group sharing most adapters with it, so it unloads and loads the fewest. A reuse that restarts
    the engine counts against ``restarts_left``; beyond it the GPU stops and the group starts on a new one
    (said in ``held_back``). Returns, per reused GPU whose engine must restart, why."""
    unnamed = list(new)
    restarted: dict[str, list[str]] = {}
    for prev in free:
        if not unnamed:
            break
        running, held = (prev.a_max, prev.max_lora_rank, prev.max_cpu_loras), set(prev.adapters)
        for inst in sorted(unnamed, key=lambda i: -len(held.intersection(i.adapters))):  # most shared first
            settings, why = engine_change(running, inst.a_max, inst.max_lora_rank, len(inst.adapters),
                                          "a new group of adapters takes over this GPU")
            if not why or len(restarted) < restarts_left:
                break
        else:  # every group would restart it, and the budget allows no more restarts
            held_back.append(f"{prev.instance_id} stops rather than restart for a new group of adapters: "
                             "--max-restarts allows no more restarts")
            continue
        unnamed.remove(inst)
        inst.instance_id = prev.instance_id
        inst.a_max, inst.max_lora_rank, inst.max_cpu_loras = settings
        if why:
            restarted[prev.instance_id] = why
    next_id = 1 + max((_instance_number(p.instance_id) for p in previous.instances), default=-1)
    for k, inst in enumerate(unnamed):
        inst.instance_id = f"{id_prefix}{next_id + k}"
    return restarted


def engine_change(running: tuple[int, int, int], a_max: int, max_lora_rank: int, n_adapters: int,
                  why: str) -> tuple[tuple[int, int, int], list[str]]:
    """An engine started with ``running`` (--max-loras, --max-lora-rank, --max-cpu-loras) that must serve
    ``n_adapters`` at ``a_max`` and ``max_lora_rank``: the settings it then runs with, and one reason per
    setting that differs from ``running`` (none: no restart). Host slots that still hold every adapter
    stay as started; ``why`` is the reason of a new --max-loras."""
    old_a_max, old_rank, old_cpu = running
    cpu = old_cpu if old_cpu >= max(n_adapters, a_max) else cpu_slots(n_adapters, a_max)
    reasons = []
    if a_max != old_a_max:
        reasons.append(f"--max-loras {old_a_max} -> {a_max}: {why}")
    if max_lora_rank != old_rank:
        reasons.append(f"--max-lora-rank {old_rank} -> {max_lora_rank}: the largest rank it serves")
    if cpu != old_cpu:
        reasons.append(f"--max-cpu-loras {old_cpu} -> {cpu}: it holds {n_adapters} adapters and loads up to "
                       f"{a_max} at once, more than the engine kept in host memory")
    return (a_max, max_lora_rank, cpu), reasons


def _instance_number(instance_id: str) -> int:
    tail = instance_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def changes(previous: Placement, new: Placement, restarts: dict[str, list[str]], reasons: dict[str, str],
            fresh_gpus: int | None = None) -> dict[str, Any]:
    """The ``changes`` section: per instance what loads, unloads and why it restarts; moved adapters with
    their reason; added, dropped, new and removed."""
    before = {p.instance_id: p for p in previous.instances}
    after = {p.instance_id: p for p in new.instances}
    per_instance = []
    for iid, inst in after.items():
        old = before.get(iid)
        old_adapters = set(old.adapters) if old else set()
        per_instance.append({
            "instance_id": iid, "status": "kept" if old else "new",
            "restart": iid in restarts, "restart_because": restarts.get(iid, []),
            "load": sorted(set(inst.adapters) - old_adapters), "unload": sorted(old_adapters - set(inst.adapters)),
            "a_max": [old.a_max if old else None, inst.a_max],
        })
    removed = sorted(set(before) - set(after))
    old_routes, new_routes = previous.routes(), new.routes()
    moved = sorted(a for a in new_routes if a in old_routes and
                   {r["instance_id"] for r in old_routes[a]} != {r["instance_id"] for r in new_routes[a]})
    return {
        "previous_workload_sha256": previous.inputs.get("workload", {}).get("sha256"),
        "instances": per_instance, "removed_instances": removed,
        "moved_adapters": moved,
        "moves": [{"adapter_id": a, "from": sorted({r["instance_id"] for r in old_routes[a]}),
                   "to": sorted({r["instance_id"] for r in new_routes[a]}),
                   "reason": reasons.get(a, "new capacity: its traffic share moved with a replica")} for a in moved],
        "added_adapters": sorted(set(new_routes) - set(old_routes)),
        "dropped_adapters": sorted(set(old_routes) - set(new_routes)),
        "restarts": sorted(restarts), "new_instances": [p["instance_id"] for p in per_instance if p["status"] == "new"],
        **({} if fresh_gpus is None else {"fresh_plan_gpus": fresh_gpus}),
    }


class AlreadyRunningError(LoraPlannerError):
    """Another re-plan holds the lock on the same output."""

    exit_code = 4


@contextmanager
def exclusive(out: str | os.PathLike):
    """Hold an exclusive ``flock`` on ``OUT.lock`` for the duration; refuse at once if another process holds it.
    The lock sits beside the file the write replaces (the real file a symlink names: twin.atomic.output_path),
    so every name of one plan shares it. The lock itself must be a regular file: a symlink planted there is
    refused, not followed (its target would be truncated), as are a directory, FIFO or device. The kernel drops the lock when its holder dies, so a lock file left by a killed run blocks nothing; a run
    removes its own lock file when done (while it still holds the lock, and a run that opened the removed
    file sees it is gone and opens the new one)."""
    lock = Path(f"{output_path(out, '--out')}.lock")
    while True:
        fd = _open_lock(lock)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise AlreadyRunningError(f"another re-plan (pid {holder}) is writing {out}; wait for it to finish") from None
        try:
            opened, there = os.fstat(fd), os.lstat(lock)
            same = (opened.st_dev, opened.st_ino) == (there.st_dev, there.st_ino)
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the file was removed by the run that held it: lock the one there now
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)


def _open_lock(lock: Path) -> int:
    """The lock file, opened (made if missing) without following a symlink; only a regular file is taken."""
    shown = printable(str(lock))
    try:
        fd = os.open(lock, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        why = "is a symbolic link" if exc.errno == errno.ELOOP else f"cannot be opened ({exc.strerror})"
        raise BadInputError(f"the re-plan lock {shown} {why}; remove it (no re-plan is running) or choose "
                            "another --out") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise BadInputError(f"the re-plan lock {shown} is {file_kind(mode)}; remove it or choose another --out")
    return fd


__all__ = ["AlreadyRunningError", "ChurnBudget", "changes", "exclusive", "replan"]
