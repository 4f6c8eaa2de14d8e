"""``paper-greedy``: the study's caching greedy algorithm (paper Algorithms 1–2), as its code behaves.

Faithful to reference-study-notes §5.2, quirks included: adapters are tested in chunks at the
cumulative counts of :data:`PAPER_GRID`; a test compares only the current A_max and the next grid
value (A_max grows at most one grid step per test); a failed test closes the GPU for good and sends
its provisional adapters back to the front of the queue; the final test of a partly filled GPU pads
the scenario with ``n_test − pending`` adapters of the mean rate and smallest rank (the study's
over-padding). Memory feasibility is the profile's largest A_max that starts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from models.scenario import GpuScenario
from planner.packing import (
    PAPER_GRID,
    GpuGroup,
    PackRequest,
    a_max_limit,
    not_enough_gpus,
    priority_order,
)


@dataclass
class _Server:
    index: int
    committed: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    a_max: int = 0
    next_test: int = 0  # index into PAPER_GRID of the next testing point
    next_slots: int = 0  # index into PAPER_GRID of the next A_max candidate

    def test_point(self) -> int | None:
        return PAPER_GRID[self.next_test] if self.next_test < len(PAPER_GRID) else None


def plan_paper_greedy(req: PackRequest) -> list[GpuGroup]:
    queue: deque[tuple[int, deque[int]]] = deque(_zigzag_groups(req))
    servers = deque(_Server(g) for g in range(req.max_gpus))
    used: list[_Server] = []
    while True:
        while queue:
            rank, group = queue.popleft()
            if not servers:
                left = [a for _, g in [(rank, group), *queue] for a in g]
                raise not_enough_gpus(req, left, len(used))
            s = servers.popleft()
            if s not in used:
                used.append(s)
            keep_server = True
            while group:
                s.pending.append(group.popleft())
                if len(s.committed) + len(s.pending) != s.test_point():
                    continue
                if _test_and_commit(req, s):
                    if s.test_point() is None:  # grid exhausted: this GPU is full
                        keep_server = False
                        if group:
                            queue.appendleft((rank, group))
                        break
                else:
                    _merge_back(req, queue, s, rank, group)
                    keep_server = False
                    break
            if keep_server:
                servers.appendleft(s)
        failed = False
        for s in used:
            if s.pending and not _test_and_commit(req, s, final=True):
                _merge_back(req, queue, s, None, deque())
                servers = deque(x for x in servers if x is not s)
                failed = True
        if not failed:
            break
    return [GpuGroup({a: 1.0 for a in s.committed}, s.a_max) for s in used if s.committed]


def _zigzag_groups(req: PackRequest) -> list[tuple[int, deque[int]]]:
    order = priority_order(req.ranks, req.rates_rps)
    groups: list[tuple[int, deque[int]]] = []
    for i in order:
        r = int(req.ranks[i])
        if not groups or groups[-1][0] != r:
            groups.append((r, deque()))
        groups[-1][1].append(i)
    return groups


def _merge_back(req: PackRequest, queue, s: _Server, rank: int | None, rest: deque[int]) -> None:
    """Roll back s's provisional adapters into the queue front, regrouped by rank in original order."""
    returned = s.pending
    s.pending = []
    s.next_test = len(PAPER_GRID)  # closed: no more testing points
    by_rank: dict[int, list[int]] = {}
    for a in returned:
        by_rank.setdefault(int(req.ranks[a]), []).append(a)
    if rank is not None:
        rest.extendleft(reversed(by_rank.pop(rank, [])))
        if rest:
            queue.appendleft((rank, rest))
    for r in sorted(by_rank):  # other ranks in front, largest rank first
        queue.appendleft((r, deque(by_rank[r])))


def _scenario(req: PackRequest, members: list[int], pad: int, a_max: int) -> GpuScenario:
    idx = np.array(members, np.int64)
    ranks, rates = req.ranks[idx], req.rates_rps[idx]
    tin, tout = req.input_tokens[idx], req.output_tokens[idx]
    if pad > 0:
        ranks = np.concatenate([ranks, np.full(pad, ranks.min())])
        rates = np.concatenate([rates, np.full(pad, rates.mean())])
        tin = np.concatenate([tin, np.full(pad, tin.mean())])
        tout = np.concatenate([tout, np.full(pad, tout.mean())])
    return GpuScenario(ranks, rates, tin, tout, a_max, req.profile.kv.rank_for(int(ranks.max())))


def _test_and_commit(req: PackRequest, s: _Server, final: bool = False) -> bool:
    n_test = s.test_point()
    members = s.committed + s.pending
    if n_test is None:
        n_test = len(members)
    pad = n_test - len(s.pending) if final and len(members) < n_test else 0
    limit = a_max_limit(req.kv, req.ranks[members])
    cands: list[tuple[int, bool]] = []  # (A_max, is the next grid value)
    if s.a_max > 0:
        cands.append((s.a_max, False))
    if s.next_slots < len(PAPER_GRID):
        cands.append((PAPER_GRID[s.next_slots], True))
    cands = [c for c in cands if c[0] <= limit]
    if not cands:
        return False
    pred = req.predictor.predict([_scenario(req, members, pad, a) for a, _ in cands])
    pick = 0 if len(cands) == 1 or pred.throughput_tok_s[0] > pred.throughput_tok_s[1] else 1
    if pred.starved[pick]:
        return False
    a_max, advanced = cands[pick]
    s.committed = members
    s.pending = []
    s.a_max = a_max
    s.next_test += 1
    if advanced:
        s.next_slots += 1
    return True
