"""Run the twin on one server: workload + profile + A_max → throughput, latencies, starvation.

Window convention (the study's and the benchmark client's): requests arrive over
[0, duration); the run is cut at ``duration`` and requests unfinished then are not counted.
Throughput counts the input + output tokens of requests that finished inside the measurement
window [warmup, duration], divided by its length; the arriving token rate counts every request
that arrived inside it, finished or not. A short window therefore under-reports throughput.
Latency statistics are over finished requests (the benchmark's convention), except the ITL
percentiles, which come from a histogram of every inter-token gap (unfinished requests included);
``ttft_ms_mean_study`` also counts each unfinished arrival with the whole window (the study's).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numba
import numpy as np

from twin import core
from twin.errors import InfeasibleError, ProfileError, WorkloadError
from twin.metrics import percentiles
from twin.policies.memory import kv_capacity
from twin.profile import Profile
from twin.states import FINISHED, REJECTED
from twin.workload import Conversations, LengthModel, PoissonArrivals, Requests, Workload, draw_requests

STARVATION_THRESHOLD = 0.9
#: The most requests one simulation draws (about 1.5 GB of per-request arrays): more than any one GPU
#: serves in hours; :func:`expected_requests` says how many a workload would draw.
MAX_SIM_REQUESTS = 20_000_000


@dataclass(frozen=True)
class SimConfig:
    a_max: int
    duration_s: float = 3600.0
    warmup_s: float = 0.0
    seed: int = 0
    arrivals: Any = field(default_factory=PoissonArrivals)
    lengths: LengthModel | None = None  # None: the profile's (Profile.default_lengths)
    input_tokens: float | None = None  # default mean prompt length (else the profile's)
    output_tokens: float | None = None
    max_lora_rank: int | None = None  # default: smallest profiled rank holding every adapter
    max_in_flight: int = 0  # client-side cap on requests in flight; 0 = none
    timeseries_dt_s: float = 0.0  # sample running/waiting/KV use every this many s; 0 = off
    trace_events: int = 0  # record up to this many scheduler events (tests)
    request_times: bool = False  # keep each request's first-token and finish times (SimResult.request_times)
    policy: Any = None  # a twin.policies.PolicySpec; None = stock vLLM (twin.core)
    conversations: Conversations | None = None  # multi-turn chat; None = single-turn requests


@dataclass
class SimResult:
    profile_id: str
    a_max: int
    max_lora_rank: int
    kv_tokens: int
    served_adapters: int
    window_s: float
    total_throughput_tok_s: float
    input_throughput_tok_s: float
    output_throughput_tok_s: float
    arriving_tok_s: float
    starved: bool
    itl_ms_mean: float
    itl_ms_p50: float
    itl_ms_p99: float
    ttft_ms_mean: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    ttft_ms_mean_study: float
    #: p99 TTFT over every arrival of the window, a request with no first token by its end counted with its
    #: wait so far (a lower bound): what a latency SLO is judged on, since a collapsed server finishes few
    #: requests and the p99 of those alone can look fine.
    ttft_ms_p99_all: float
    ttft_ms_p999_all: float  # the same at p99.9: a burst of waits shows here before it reaches the p99
    tpot_ms_p99: float  # per finished request of >= 2 output tokens: (finish - first token) / (tokens - 1)
    arrived_requests: int
    finished_requests: int
    rejected_requests: int
    preemptions: int
    adapter_loads: int
    engine_steps: int
    busy_fraction: float
    sim_wall_s: float
    timeseries: np.ndarray | None = None  # columns: t_s, running, waiting, kv_used_fraction
    trace: np.ndarray | None = None  # columns: step_start_s, request, tokens, event kind
    request_times: np.ndarray | None = None  # per request: first_token_s, finish_s (NaN: did not happen)
    policy: str = "vllm"
    lengths: str = "constant"  # how request lengths were drawn: constant, lognormal cv=X/Y, or trace
    policy_stats: dict[str, Any] | None = None  # cache hit rate, evictions, load stalls, ... (non-stock)
    conversations: str | None = None  # how multi-turn requests were drawn; None: single-turn

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("trace")
        d.pop("request_times")
        ts = d.pop("timeseries")
        if ts is not None:
            d["timeseries"] = {
                "t_s": ts[:, 0].tolist(), "running": ts[:, 1].astype(int).tolist(),
                "waiting": ts[:, 2].astype(int).tolist(), "kv_used_fraction": ts[:, 3].round(4).tolist(),
            }
        return d


def expected_requests(workload: Workload, duration_s: float) -> float:
    """Requests a run of ``duration_s`` draws on average (every adapter's rate times the duration)."""
    return float(sum(a.rate_rps for a in workload.adapters)) * duration_s


def resolve_max_lora_rank(workload: Workload, profile: Profile, requested: int | None = None) -> int:
    """The max_lora_rank a server holding ``workload`` runs with (validated against the profile)."""
    need = int(workload.ranks.max())
    rank = profile.kv.rank_for(need) if requested is None else requested
    if rank is None or requested is not None and requested not in profile.kv.tokens:
        served = ", ".join(map(str, profile.kv.lora_ranks))
        raise ProfileError(f"profile {profile.profile_id} cannot serve rank {need if rank is None else requested} "
                           f"(profiled max_lora_rank values: {served})")
    if need > rank:
        raise WorkloadError(f"an adapter has rank {need} > max_lora_rank {rank}")
    return rank


def draw_settings(profile: Profile, config: SimConfig) -> tuple:
    """What a run's requests are drawn with besides its workload (:func:`draw_requests`' other arguments): neither
    ``config.a_max`` nor ``max_lora_rank``, so runs of one GPU at several ``--max-loras`` may share them."""
    return (config.duration_s, config.seed, config.arrivals, config.lengths or profile.default_lengths(),
            config.input_tokens or profile.default_input_tokens,
            config.output_tokens or profile.default_output_tokens, config.conversations)


def config_requests(workload: Workload, profile: Profile, config: SimConfig) -> Requests:
    """The requests :func:`simulate` draws for a run of ``config`` when it is given none."""
    return draw_requests(workload, *draw_settings(profile, config))


def simulate(
    workload: Workload, profile: Profile, config: SimConfig, requests: Requests | None = None
) -> SimResult:
    """Simulate one vLLM server serving ``workload`` with ``--max-loras config.a_max``.

    Raises :class:`InfeasibleError` when the profile says the engine would not start
    (a memory error) with this A_max and max_lora_rank. With ``config.policy`` set, the server runs
    that serving policy (``twin.policies``): memory is one pool of the profile's no-LoRA KV tokens,
    so any A_max starts and it only caps the distinct adapters of one batch.
    """
    if config.a_max < 1:
        raise WorkloadError("a_max (--max-loras) must be >= 1")
    if not config.duration_s > config.warmup_s >= 0:
        raise WorkloadError("duration must be > warm-up >= 0")
    eng = profile.engine
    rank = resolve_max_lora_rank(workload, profile, config.max_lora_rank)
    kv_tokens = kv_capacity(profile, config.policy).tokens_for(config.a_max, rank)
    if kv_tokens is None:
        limit = profile.kv.max_a_max(rank)
        raise InfeasibleError(
            f"memory error: with max_lora_rank {rank} the engine of profile {profile.profile_id} "
            f"starts with at most --max-loras {limit} (asked {config.a_max})"
        )
    t0 = time.perf_counter()
    drawn = "trace" if requests is not None else (config.lengths or profile.default_lengths()).describe()
    if requests is None:
        requests = config_requests(workload, profile, config)
    n_ad = len(workload)
    load_ms = np.array([profile.adapter_load.load_ms(rank, a.rank) for a in workload.adapters])
    lat = np.array(profile.step_latency.for_server(config.a_max, rank).as_array())
    so = profile.scheduler_overhead
    sched = np.array([so.k1_us, so.k2_us, so.k3_us, so.intercept_us, float(n_ad)])
    # Requests longer than max_model_len are refused by the server (HTTP 400): the engine never sees them.
    too_long = np.add(requests.input_tokens, requests.output_tokens, dtype=np.int64) > eng.max_model_len
    served = requests.subset(~too_long) if too_long.any() else requests
    arrival = served.arrival_s
    if profile.step_latency.arrival_delay:
        arrival = arrival + profile.step_latency.arrival_delay / 1000.0  # the engine sees a request this late
    if config.policy is not None:
        from twin.policies.run import run_policy

        out, kv_tokens, stats = run_policy(config.policy, workload, profile, served, arrival, load_ms, lat, sched,
                                           config, config.seed)
        res = _summarise(profile, config, rank, kv_tokens, n_ad, requests, *_restore(out, too_long),
                         int(too_long.sum()), time.perf_counter() - t0, drawn)
        res.policy, res.policy_stats = config.policy.name, stats
        return res
    usable_blocks = kv_tokens // eng.block_size - 1  # vLLM keeps one null block
    adapter = np.ascontiguousarray(served.adapter, np.int64)
    ad_start, ad_order = core.group_by(adapter, n_ad)
    out = core.simulate_core(
        # Unsigned adapter ids spare numba's negative-index checks (see core.simulate_core).
        arrival, adapter.view(np.uint64), served.input_tokens, served.output_tokens,
        ad_start, ad_order, load_ms,
        float(config.duration_s), int(config.a_max), int(usable_blocks), int(eng.block_size),
        int(eng.max_num_batched_tokens), int(eng.max_num_seqs),
        eng.admission_rule == "full_prompt", lat, sched,
        int(config.max_in_flight), float(config.timeseries_dt_s), int(config.trace_events), core.itl_edges(),
    )
    wall = time.perf_counter() - t0
    return _summarise(profile, config, rank, kv_tokens, n_ad, requests, *_restore(out, too_long), int(too_long.sum()),
                      wall, drawn)


def _restore(out: tuple, refused: np.ndarray) -> tuple:
    """An engine's outputs over the requests it saw, back in terms of all requests (``refused`` ones
    never ran: rejected, no token times; trace rows renumbered)."""
    if not refused.any():
        return out
    state, first_tok, finish, *rest = out
    seen = np.flatnonzero(~refused)
    full_state = np.full(refused.shape[0], REJECTED, state.dtype)
    full_first, full_finish = np.full(refused.shape[0], -1.0), np.full(refused.shape[0], -1.0)
    full_state[seen], full_first[seen], full_finish[seen] = state, first_tok, finish
    trace = rest[-1]
    if trace.shape[0]:
        trace = trace.copy()
        trace[:, 1] = seen[trace[:, 1].astype(np.int64)]
    return (full_state, full_first, full_finish, *rest[:-1], trace)


def _nan_unset(times: np.ndarray) -> np.ndarray:
    """The engine loop's times with NaN for its "not yet" (-1)."""
    return np.where(times >= 0, times, np.nan)


def _percentile_from_hist(hist: np.ndarray, q: float) -> float:
    total = hist.sum()
    if total == 0:
        return float("nan")
    idx = int(np.searchsorted(np.cumsum(hist), q / 100.0 * total))
    # bin idx covers [lo + (idx-1)/bpd, lo + idx/bpd) decades; report its centre
    x = core.ITL_HIST_LO + (idx - 0.5) / core.ITL_HIST_BINS_PER_DECADE
    return float(10.0 ** x)


@numba.njit(cache=True)
def request_outcomes(arrival, state, first_tok, finish, in_len, out_len, t_lo, t_hi):
    """One pass over the requests. Of those that finished in [t_lo, t_hi]: their prompt and output tokens (sums),
    TTFT (ms), first-to-last token time (s), and TPOT (ms) where they have two tokens or more. Of those that
    arrived in [t_lo, t_hi): their tokens (sum) and how long each waited for a first token (until ``t_hi`` if
    none). Lists keep request order, and token sums are exact integers, so the figures are NumPy's over
    masked arrays to the last bit."""
    n = arrival.shape[0]
    ttft, span, tpot, waited = np.empty(n), np.empty(n), np.empty(n), np.empty(n)
    in_done = out_done = tok_arr = 0
    d = m = a = 0
    for i in range(n):
        if state[i] == FINISHED and t_lo <= finish[i] <= t_hi:
            in_done += in_len[i]
            out_done += out_len[i]
            ttft[d] = (first_tok[i] - arrival[i]) * 1000.0
            span[d] = finish[i] - first_tok[i]
            if out_len[i] >= 2:
                tpot[m] = span[d] / (out_len[i] - 1.0) * 1000.0
                m += 1
            d += 1
        if t_lo <= arrival[i] < t_hi:
            tok_arr += in_len[i] + out_len[i]
            waited[a] = (first_tok[i] if first_tok[i] >= 0 else t_hi) - arrival[i]
            a += 1
    return float(in_done), float(out_done), float(tok_arr), ttft[:d], span[:d], tpot[:m], waited[:a]


def _summarise(profile, config, rank, kv_tokens, n_ad, req, state, first_tok, finish, itl_hist, counters, busy_s,
               ts, trace, too_long, wall, lengths) -> SimResult:
    t_lo, t_hi = config.warmup_s, config.duration_s
    window = t_hi - t_lo
    in_sum, out_sum, arrived_sum, ttft, span, tpot, waited = request_outcomes(
        req.arrival_s, state, first_tok, finish, req.input_tokens, req.output_tokens, float(t_lo), float(t_hi))
    in_thr = in_sum / window
    out_thr = out_sum / window
    arriving = arrived_sum / window
    total = in_thr + out_thr
    n_done = ttft.shape[0]
    n_arr = waited.shape[0]
    # A finished request's inter-token gaps sum to its finish minus first-token time, over (tokens - 1) gaps.
    gaps = out_sum - n_done  # output lengths are >= 1 (draw_requests, trace_requests)
    itl_mean = float(span.sum() / gaps * 1000.0) if gaps > 0 else float("nan")
    ttft_mean = float(ttft.mean()) if n_done else float("nan")
    waited_p99, waited_p999 = percentiles(waited, [99, 99.9]) * 1000.0 if n_arr else (float("nan"),) * 2
    ttft_p50, ttft_p99 = (percentiles(ttft, 50), percentiles(ttft, 99)) if n_done else (float("nan"),) * 2
    ttft_study = ((ttft.sum() + (n_arr - n_done) * window * 1000.0) / n_arr) if n_arr else float("nan")
    preemptions, loads, rejected, steps = (int(x) for x in counters[:4])
    return SimResult(
        profile_id=profile.profile_id, a_max=config.a_max, max_lora_rank=rank, kv_tokens=kv_tokens,
        served_adapters=n_ad, window_s=window,
        total_throughput_tok_s=float(total), input_throughput_tok_s=float(in_thr),
        output_throughput_tok_s=float(out_thr), arriving_tok_s=float(arriving),
        starved=bool(total < STARVATION_THRESHOLD * arriving),
        itl_ms_mean=itl_mean, itl_ms_p50=_percentile_from_hist(itl_hist, 50),
        itl_ms_p99=_percentile_from_hist(itl_hist, 99),
        ttft_ms_mean=ttft_mean,
        ttft_ms_p50=float(ttft_p50), ttft_ms_p99=float(ttft_p99),
        ttft_ms_mean_study=float(ttft_study),
        ttft_ms_p99_all=float(waited_p99), ttft_ms_p999_all=float(waited_p999),
        tpot_ms_p99=float(percentiles(tpot, 99)) if tpot.size else float("nan"),
        arrived_requests=n_arr, finished_requests=n_done, rejected_requests=rejected + too_long,
        preemptions=preemptions, adapter_loads=loads, engine_steps=steps,
        busy_fraction=float(min(1.0, busy_s / t_hi)), sim_wall_s=wall,
        timeseries=ts if config.timeseries_dt_s > 0 else None,
        trace=trace if config.trace_events > 0 else None, lengths=lengths,
        request_times=_nan_unset(np.column_stack([first_tok, finish])) if config.request_times else None,
        conversations=config.conversations.describe() if config.conversations and req.conversation is not None
        else None,
    )
