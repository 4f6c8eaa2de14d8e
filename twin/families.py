"""Random fleet workloads: families of adapter populations nobody hand-picked, for benchmarks and tests.

Each family draws ``n`` adapters from one seed. Rates are at H100 scale (a GPU of the shipped H100
profiles serves ~25-35 req/s of ~420-token requests); ``rate_scale`` shrinks or grows them for
another profile. Lengths are left to the profile's defaults except in ``mixed-lengths``.

* ``log-uniform``: ranks 8/16/32, rates log-uniform in [0.001, 2] req/s.
* ``zipf``: ranks 8/16/32, rate of the k-th most popular adapter ∝ k^-1.1, 0.1 req/s on average.
* ``hot``: ``log-uniform`` plus a few adapters hotter than one GPU (40-150 req/s).
* ``rank32``: every adapter rank 32, rates log-uniform in [0.001, 2] req/s.
* ``near-idle``: 95 % of adapters near idle (1e-4 to 1e-2 req/s), the rest log-uniform in [0.01, 2].
* ``mixed-lengths``: ``log-uniform`` with each adapter's mean prompt in [32, 4096] and output in
  [16, 1024] tokens, log-uniform, capped so a request fits ``max_model_len``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from twin.workload import Adapter, Workload

RANKS = (8, 16, 32)


def _log_uniform(rng: np.random.Generator, lo: float, hi: float, n: int) -> np.ndarray:
    return np.exp(rng.uniform(np.log(lo), np.log(hi), n))


def _mixed_ranks(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.choice(RANKS, n)


def _log_uniform_family(rng, n):
    return _mixed_ranks(rng, n), _log_uniform(rng, 0.001, 2.0, n), None


def _zipf(rng, n):
    popularity = rng.permutation(n) + 1.0
    rates = popularity ** -1.1
    return _mixed_ranks(rng, n), rates * (0.1 * n / rates.sum()), None


def _hot(rng, n):
    ranks, rates, _ = _log_uniform_family(rng, n)
    hot = rng.choice(n, min(n, int(rng.integers(2, 6))), replace=False)
    rates[hot] = rng.uniform(40.0, 150.0, hot.shape[0])
    return ranks, rates, None


def _rank32(rng, n):
    return np.full(n, 32), _log_uniform(rng, 0.001, 2.0, n), None


def _near_idle(rng, n):
    idle = rng.random(n) < 0.95
    rates = np.where(idle, _log_uniform(rng, 1e-4, 1e-2, n), _log_uniform(rng, 0.01, 2.0, n))
    return _mixed_ranks(rng, n), rates, None


def _mixed_lengths(rng, n):
    ranks, rates, _ = _log_uniform_family(rng, n)
    return ranks, rates, (_log_uniform(rng, 32, 4096, n), _log_uniform(rng, 16, 1024, n))


FAMILIES: dict[str, Callable] = {
    "log-uniform": _log_uniform_family, "zipf": _zipf, "hot": _hot, "rank32": _rank32,
    "near-idle": _near_idle, "mixed-lengths": _mixed_lengths,
}


def family_workload(family: str, n: int, seed: int, rate_scale: float = 1.0,
                    max_model_len: int | None = None) -> Workload:
    """``n`` adapters of ``family`` drawn from ``seed`` (rates in req/s times ``rate_scale``)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family '{family}'; choose one of {', '.join(FAMILIES)}")
    rng = np.random.default_rng(np.random.SeedSequence([seed, n, sorted(FAMILIES).index(family)]))
    ranks, rates, lengths = FAMILIES[family](rng, n)
    rates = np.array([float(f"{r:.6g}") for r in rates * rate_scale])  # as the CSV writes them
    if lengths is None:
        ins = outs = [None] * n
    else:
        ins, outs = (np.round(x, 1) for x in lengths)
        if max_model_len is not None:  # keep every request of the mean lengths within the context
            scale = np.minimum(1.0, 0.5 * max_model_len / (ins + outs))
            ins, outs = np.maximum(1.0, np.floor(ins * scale)), np.maximum(1.0, np.floor(outs * scale))
        ins, outs = ins.tolist(), outs.tolist()
    width = len(str(n - 1))
    return Workload(tuple(Adapter(f"{family}-{i:0{width}d}", int(ranks[i]), float(rates[i]), ins[i], outs[i])
                          for i in range(n)))


def write_workload_csv(workload: Workload, path) -> None:
    """workload.csv with the optional length columns only when some adapter sets them."""
    lengths = any(a.input_tokens is not None for a in workload.adapters)
    with open(path, "w", encoding="utf-8") as f:
        f.write("adapter_id,rank,rate_rps" + (",input_tokens,output_tokens" if lengths else "") + "\n")
        for a in workload.adapters:
            tail = f",{a.input_tokens:g},{a.output_tokens:g}" if lengths else ""
            f.write(f"{a.adapter_id},{a.rank},{a.rate_rps:.6g}{tail}\n")


def fleet_nights(family: str, n: int, seed: int, nights: int, churn: float = 0.01, walk_sd: float = 0.1,
                 weekly: float = 0.3, hot_night: int = 10, hot_rps: float = 40.0, cooling: float = 0.7):
    """The workloads of ``nights`` nights of one fleet, night 0 first: ``family``'s adapters, then each night
    every rate takes a log-normal random-walk step (SD ``walk_sd``) and follows a weekly cycle (a sine of
    amplitude ``weekly``); each adapter retires with probability ``churn`` and about ``churn`` x n new
    ones join; on ``hot_night`` one adapter jumps to ``hot_rps`` (more than one GPU serves), then cools by
    ``cooling`` a night back to its walk."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, n, 7]))  # a longer run extends a shorter one
    base = list(family_workload(family, n, seed).adapters)
    walk = np.zeros(len(base))
    heat = np.ones(len(base))
    born = len(base)
    for night in range(nights):
        if night:
            walk += rng.normal(0.0, walk_sd, len(base))
            heat = np.maximum(1.0, heat * cooling)
            keep = rng.random(len(base)) >= churn
            joined = list(family_workload(family, max(1, rng.poisson(churn * n)), seed + 1000 * night).adapters)
            joined = [replace(a, adapter_id=f"{family}-new-{born + k}") for k, a in enumerate(joined)]
            born += len(joined)
            base = [a for a, k in zip(base, keep) if k] + joined
            walk = np.concatenate([walk[keep], np.zeros(len(joined))])
            heat = np.concatenate([heat[keep], np.ones(len(joined))])
        cycle = 1.0 + weekly * np.sin(2.0 * np.pi * night / 7.0)
        if night == hot_night:
            j = int(rng.integers(len(base)))
            heat[j] = hot_rps / (base[j].rate_rps * np.exp(walk[j]) * cycle)
        yield Workload(tuple(replace(a, rate_rps=float(f"{a.rate_rps * np.exp(w) * cycle * h:.6g}"))
                             for a, w, h in zip(base, walk, heat)))
