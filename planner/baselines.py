"""The paper's baselines, as the study's code behaves (reference-study-notes §5.3 and §8).

* ``maxbase`` / ``maxbase-half``: next-fit in workload order up to the profile's benchmarked
  backbone throughput (no LoRA); A_max = adapters on the GPU (half, rounded, for ``-half``).
  No memory or starvation check — their plans can fail to start or starve.
* ``random``: each adapter to a uniformly drawn GPU, A_max uniform in [1, adapters on it] (seeded).
* ``latency`` (ProposedLat): each adapter, in workload order, to the GPU with the lowest summed
  request rate; A_max = adapters on it; rejected on a memory error, or when the summed predicted
  throughput plus 400 tok/s (the study's slack, an H100-sized constant) is more than 10 %
  (symmetric) below the arriving token rate — it uses the throughput regressor, not starvation.
* ``dlora``: dLoRA's proactive placement (OSDI'24) as the study adapted it: maximise the minimum
  "burst tolerance" (free KV tokens of the GPUs hosting an adapter over its expected requests in an
  hour), replicas allowed, then pad to G + N − 1 replicas; requests split evenly over replicas;
  A_max = adapters on the GPU; no memory or starvation check. One departure: dLoRA's loop never ends
  when the last unplaced adapter lowers the burst tolerance on every GPU (free KV memory already
  overcommitted, e.g. ~700+ adapters on 4 H100s); here an unplaced adapter is always accepted.
"""

from __future__ import annotations

import heapq

import numpy as np

from planner.packing import GpuGroup, PackRequest, a_max_limit, group_scenario, not_enough_gpus
from twin.errors import InfeasibleError, ProfileError

#: ProposedLat's absolute slack on the summed predicted throughput (tok/s), from the study's code.
LATENCY_SLACK_TOK_S = 400.0


def plan_maxbase(req: PackRequest, half: bool = False) -> list[GpuGroup]:
    cap = req.profile.backbone_max_throughput_tok_s
    if cap is None:
        raise ProfileError(f"profile {req.profile.profile_id} has no backbone_max_throughput_tok_s, "
                           "which the maxbase baselines pack to")
    load = req.arriving_tok_s
    groups: list[GpuGroup] = [GpuGroup()]
    used = 0.0
    for i in range(len(load)):
        while used + load[i] > cap:
            if len(groups) == req.max_gpus:
                raise not_enough_gpus(req, list(range(i, len(load))), len(groups))
            groups.append(GpuGroup())
            used = 0.0
        groups[-1].add(i)
        used += load[i]
    for g in groups:
        g.a_max = max(1, round(len(g) / 2)) if half else len(g)
    return [g for g in groups if len(g)]


def plan_random(req: PackRequest) -> list[GpuGroup]:
    rng = np.random.default_rng(req.seed)
    groups = [GpuGroup() for _ in range(req.max_gpus)]
    for i in range(len(req.ranks)):
        groups[int(rng.integers(req.max_gpus))].add(i)
    for g in groups:
        if len(g):
            g.a_max = int(rng.integers(1, len(g) + 1))
    return [g for g in groups if len(g)]


def plan_latency(req: PackRequest) -> list[GpuGroup]:
    groups = [GpuGroup() for _ in range(req.max_gpus)]
    heap = [(0.0, g) for g in range(req.max_gpus)]
    for i in range(len(req.ranks)):
        rate, g = heapq.heappop(heap)
        groups[g].add(i)
        heapq.heappush(heap, (rate + float(req.rates_rps[i]), g))
    groups = [g for g in groups if len(g)]
    for g in groups:
        g.a_max = len(g)
        limit = a_max_limit(req.kv, req.ranks[g.members])
        if g.a_max > limit:
            raise InfeasibleError(f"latency: a GPU needs --max-loras {g.a_max} but at most {limit} start "
                                  f"in memory with its ranks")
    pred = req.predictor.predict([group_scenario(req, g.shares, g.a_max) for g in groups])
    ideal = float(req.arriving_tok_s.sum())
    got = float(pred.throughput_tok_s.sum()) + LATENCY_SLACK_TOK_S
    if ideal > 0 and 2 * (ideal - got) / (ideal + got) > 0.1:
        raise InfeasibleError(f"latency: {len(groups)} GPUs are predicted to serve {got:,.0f} of "
                              f"{ideal:,.0f} tok/s arriving; allow more with --gpus")
    return groups


def dlora_lora_size_tokens(req: PackRequest) -> float:
    """KV tokens one adapter slot costs: max over A_max of (KV without LoRA − T_max(A_max)) / A_max,
    at the max_lora_rank the largest adapter needs (the study's adaptation)."""
    kv = req.profile.kv
    rank = kv.rank_for(int(req.ranks.max()))
    costs = [(kv.no_lora_tokens - t) / a for a, t in zip(kv.a_max_points, kv.tokens[rank]) if t is not None]
    return max(costs) if costs else float(kv.no_lora_tokens)


def plan_dlora(req: PackRequest) -> list[GpuGroup]:
    n, g_count = len(req.ranks), req.max_gpus
    expected = req.rates_rps * 3600.0  # expected requests in one hour (count-valued, as the study)
    lora_size = dlora_lora_size_tokens(req)
    free = np.full(g_count, float(req.profile.kv.no_lora_tokens))
    hosts = np.zeros((n, g_count), bool)
    cur = np.zeros(n)
    weighted = expected > 0

    def min_bt() -> float:
        tol = hosts[weighted].astype(float) @ free / expected[weighted]
        return float(tol.min()) if tol.size else float("inf")

    n_rep, best_bt, update = 0, 0.0, True
    unalloc = np.ones(n, bool)
    while update:
        update = False
        score = cur / (n_rep + 1e-7) - expected
        pool = np.flatnonzero(unalloc) if unalloc.any() else np.arange(n)
        nxt = int(pool[np.argmin(score[pool])])
        for e in sorted(range(g_count), key=lambda e: hosts[:, e].sum()):
            if hosts[nxt, e]:
                continue
            hosts[nxt, e] = True
            free[e] -= lora_size
            bt = min_bt() if not unalloc.any() or (unalloc.sum() == 1 and unalloc[nxt]) else 0.0
            if bt >= best_bt or unalloc[nxt]:
                cur[nxt] += 1
                n_rep += 1
                best_bt = bt
                update = True
                unalloc[nxt] = False
                break
            hosts[nxt, e] = False
            free[e] += lora_size
            if unalloc.any():
                update = True
    # init: pad to G + N - 1 replicas, round-robin over engines, lowest-index type not yet there
    t = 0
    e = 0
    while n_rep < g_count + n - 1:
        for step in range(n):
            cand = (t + step) % n
            if not hosts[cand, e]:
                hosts[cand, e] = True
                free[e] -= lora_size
                t = cand + 1
                n_rep += 1
                break
        else:  # engine e already hosts every type
            if hosts.all():
                break
        e = (e + 1) % g_count
    groups = [GpuGroup() for _ in range(g_count)]
    replicas = hosts.sum(axis=1)
    for i in range(n):
        for e in np.flatnonzero(hosts[i]):
            groups[e].add(i, 1.0 / replicas[i])
    for g in groups:
        g.a_max = len(g)
    return [g for g in groups if len(g)]
