"""Workload model: the adapters a server must serve, their arrival processes and request lengths."""

from __future__ import annotations

from dataclasses import dataclass, field

import numba
import numpy as np

from twin.errors import WorkloadError


@dataclass(frozen=True)
class Adapter:
    adapter_id: str
    rank: int
    rate_rps: float
    input_tokens: float | None = None  # mean prompt length; None = workload/profile default
    output_tokens: float | None = None  # mean generation length
    path: str | None = None
    # The adapter's own latency SLO, tighter than the plan's (the planner reads it; the twin does not)
    max_ttft_s: float | None = None  # p99 time to first token, s
    max_tpot_ms: float | None = None  # p99 time per output token, ms


@dataclass(frozen=True)
class Workload:
    adapters: tuple[Adapter, ...]

    def __post_init__(self):
        if not self.adapters:
            raise WorkloadError("a workload needs at least one adapter")
        seen: set[str] = set()
        for a in self.adapters:
            if a.adapter_id in seen:
                raise WorkloadError(f"adapter_id '{a.adapter_id}' appears twice; ids must be unique")
            seen.add(a.adapter_id)
            if a.rank <= 0:
                raise WorkloadError(f"adapter '{a.adapter_id}': rank must be a positive integer")
            if not np.isfinite(a.rate_rps) or a.rate_rps < 0:
                raise WorkloadError(f"adapter '{a.adapter_id}': rate_rps must be finite and >= 0")
            for name in ("input_tokens", "output_tokens"):
                v = getattr(a, name)
                if v is not None and (not np.isfinite(v) or v < 1):
                    raise WorkloadError(f"adapter '{a.adapter_id}': {name} must be >= 1")

    @property
    def ranks(self) -> np.ndarray:
        return np.array([a.rank for a in self.adapters], np.int64)

    def __len__(self) -> int:
        return len(self.adapters)


@dataclass(frozen=True)
class Requests:
    """Pre-drawn requests of one run, sorted by arrival time."""

    arrival_s: np.ndarray  # float64
    adapter: np.ndarray  # int64 index into Workload.adapters
    input_tokens: np.ndarray  # int32; a conversation turn's prompt includes its history
    output_tokens: np.ndarray  # int32
    conversation: np.ndarray | None = None  # int64 conversation id per request (-1: single-turn); None: all single
    history_tokens: np.ndarray | None = None  # int32: tokens of the prompt that are earlier turns (prompts + replies)

    def __len__(self) -> int:
        return int(self.arrival_s.shape[0])

    def subset(self, keep: np.ndarray) -> Requests:
        """The requests where ``keep`` is true, in the same order."""
        return Requests(self.arrival_s[keep], self.adapter[keep], self.input_tokens[keep], self.output_tokens[keep],
                        None if self.conversation is None else self.conversation[keep],
                        None if self.history_tokens is None else self.history_tokens[keep])

    @property
    def conversations(self) -> int:
        """How many conversations the requests belong to (0 when every request is single-turn)."""
        return 0 if self.conversation is None or len(self) == 0 else int(self.conversation.max()) + 1


@dataclass(frozen=True)
class LengthModel:
    """How request lengths are drawn around each adapter's means.

    ``constant``: every request has the mean (rounded); ``lognormal``: a log-normal with the given
    coefficient of variation and the same mean; clipped to [1, max_tokens].
    """

    kind: str = "constant"
    input_cv: float = 0.0
    output_cv: float = 0.0

    @classmethod
    def lognormal(cls, cv: float) -> LengthModel:
        """Log-normal prompt and output lengths, both with coefficient of variation ``cv``."""
        return cls("lognormal", cv, cv)

    def describe(self) -> str:
        if self.kind == "constant" or self.input_cv <= 0 and self.output_cv <= 0:
            return "constant"
        return f"{self.kind} cv={self.input_cv:g}/{self.output_cv:g}"

    def draw(self, mean: np.ndarray, adapter: np.ndarray, cv: float, rng: np.random.Generator) -> np.ndarray:
        """Token counts of requests of adapters ``adapter`` (indices into ``mean``, each adapter's mean)."""
        if self.kind == "constant" or cv <= 0:
            return np.maximum(1, np.rint(mean)).astype(np.int32)[adapter]
        if self.kind == "lognormal":
            sigma2 = np.log1p(cv * cv)
            mu = np.log(mean) - sigma2 / 2
            # rng.lognormal(mu, sigma) draws one standard normal z per request and takes exp(mu + sigma z);
            # drawing z here and the rest compiled gives the same tokens in a fraction of the time.
            return _lognormal_tokens(mu, adapter, float(np.sqrt(sigma2)), rng.standard_normal(adapter.shape[0]))
        raise WorkloadError(f"unknown length model '{self.kind}' (constant, lognormal)")


@numba.njit(cache=True)
def _lognormal_tokens(mu, adapter, sigma, z):
    """max(1, round(exp(mu[adapter] + sigma z))) as int32: token counts of log-normal draws."""
    out = np.empty(adapter.shape[0], np.int32)
    for i in range(adapter.shape[0]):
        out[i] = max(1.0, np.rint(np.exp(mu[adapter[i]] + sigma * z[i])))
    return out


@dataclass(frozen=True)
class PoissonArrivals:
    """Independent Poisson arrivals per adapter at its mean rate."""

    name: str = field(default="poisson", init=False)

    def adapter_times(self, rate: float, duration: float, rng: np.random.Generator) -> np.ndarray:
        times = self.unordered_times(rate, duration, rng)
        times.sort()
        return times

    def unordered_times(self, rate: float, duration: float, rng: np.random.Generator) -> np.ndarray:
        """:meth:`adapter_times` before they are sorted (the same draws): :func:`draw_requests` orders every
        adapter's at once."""
        if rate <= 0:
            return np.empty(0)
        return rng.uniform(0.0, duration, rng.poisson(rate * duration))


@dataclass(frozen=True)
class UnpredictableArrivals:
    """The paper's non-stationary arrivals (§8.2).

    Each adapter starts Poisson at its rate; every ``period_s`` it redraws its inter-arrival
    distribution (exponential or log-normal with shape ``lognormal_sigma``, both with mean
    1/rate) and multiplies or divides its rate by ``factor``, the multiplier clipped to
    [1/clip, clip] of the base rate. The paper leaves the log-normal shape and the clip open;
    the study's code used factor 1.5 and clip 7.5 (we default to the paper's factor 2).
    """

    period_s: float = 300.0
    factor: float = 2.0
    clip: float = 7.5
    lognormal_sigma: float = 1.0
    name: str = field(default="unpredictable", init=False)

    def adapter_times(self, rate: float, duration: float, rng: np.random.Generator) -> np.ndarray:
        if rate <= 0:
            return np.empty(0)
        out = []
        mult, lognormal = 1.0, False
        start = 0.0
        t = 0.0
        while start < duration:
            end = min(start + self.period_s, duration)
            r = rate * mult
            mean_gap = 1.0 / r
            while True:
                k = int(r * (end - t) * 1.3) + 16
                if lognormal:
                    s = self.lognormal_sigma
                    gaps = rng.lognormal(np.log(mean_gap) - s * s / 2, s, k)
                else:
                    gaps = rng.exponential(mean_gap, k)
                times = t + np.cumsum(gaps)
                inside = times[times < end]
                out.append(inside)
                if inside.shape[0] < k:
                    t = end if inside.shape[0] == 0 else inside[-1]
                    break
                t = inside[-1]
            # Redraw for the next period.
            lognormal = bool(rng.integers(2))
            mult = mult * self.factor if rng.integers(2) else mult / self.factor
            mult = min(max(mult, 1.0 / self.clip), self.clip)
            start = end
        return np.concatenate(out) if out else np.empty(0)


@dataclass(frozen=True)
class Conversations:
    """Multi-turn chat: an adapter's requests are the turns of conversations.

    Conversations of an adapter start by its arrival process at ``rate / turns``, so ``rate_rps``
    stays the adapter's request (turn) rate. Each has a geometric number of turns with mean ``turns``
    (>= 1) and exponential gaps with mean ``think_s`` between one turn's arrival and the next
    (Choice: arrivals are open-loop, so a turn may arrive before the previous reply is done; it then
    reuses at most the history of an earlier turn). A turn's prompt is the whole conversation so far (every earlier
    prompt and reply) plus new tokens drawn around the adapter's mean input length; turns past the
    run's duration are dropped. LMSYS-Chat-1M averages 2.0 turns per conversation.
    """

    turns: float = 2.0
    think_s: float = 30.0

    def __post_init__(self):
        if not (np.isfinite(self.turns) and self.turns >= 1):
            raise WorkloadError("conversation turns (mean) must be >= 1")
        if not (np.isfinite(self.think_s) and self.think_s >= 0):
            raise WorkloadError("conversation think time must be finite and >= 0")

    def describe(self) -> str:
        return f"{self.turns:g} turns, think {self.think_s:g} s"

    def turn_times(self, starts: np.ndarray, duration: float, rng: np.random.Generator):
        """Arrival times of every turn of conversations starting at ``starts``, with each turn's
        conversation (index into ``starts``), in conversation order."""
        count = rng.geometric(1.0 / self.turns, starts.shape[0])
        conv = np.repeat(np.arange(starts.shape[0]), count)
        first = np.cumsum(count) - count  # position of each conversation's first turn
        gaps = rng.exponential(self.think_s, conv.shape[0]) if self.think_s > 0 else np.zeros(conv.shape[0])
        gaps[first] = 0.0
        csum = np.cumsum(gaps)
        times = starts[conv] + csum - np.repeat(csum[first], count)
        keep = times < duration
        return times[keep], conv[keep]


def draw_requests(
    workload: Workload,
    duration_s: float,
    seed: int,
    arrivals=PoissonArrivals(),
    lengths: LengthModel = LengthModel(),
    default_input_tokens: float = 1.0,
    default_output_tokens: float = 1.0,
    conversations: Conversations | None = None,
) -> Requests:
    """Draw one run's requests from the workload's per-adapter arrival processes (single-turn, or the
    turns of ``conversations``). An arrival process gives each adapter's times sorted (``adapter_times``); one that
    also offers them as drawn (``unordered_times``, the same draws: :class:`PoissonArrivals`) gives single turns
    that way, and :func:`arrival_order` orders all at once."""
    rng = np.random.default_rng(seed)
    times, convs = [], []
    n_conv = 0
    single = getattr(arrivals, "unordered_times", arrivals.adapter_times)  # single turns are ordered below
    for a in workload.adapters:
        if conversations is None:
            t = single(a.rate_rps, duration_s, rng)
        else:
            starts = arrivals.adapter_times(a.rate_rps / conversations.turns, duration_s, rng)
            t, c = conversations.turn_times(starts, duration_s, rng)
            convs.append(c + n_conv)
            n_conv += starts.shape[0]
        times.append(t)
    arrival = np.concatenate(times) if times else np.empty(0)
    adapter = np.repeat(np.arange(len(times), dtype=np.int64), [t.shape[0] for t in times])
    order = arrival_order(arrival)
    arrival, adapter = arrival[order], adapter[order]
    mean_in = np.array([a.input_tokens or default_input_tokens for a in workload.adapters])
    mean_out = np.array([a.output_tokens or default_output_tokens for a in workload.adapters])
    ins = lengths.draw(mean_in, adapter, lengths.input_cv, rng)
    outs = lengths.draw(mean_out, adapter, lengths.output_cv, rng)
    if conversations is None:
        return Requests(arrival, adapter, ins, outs)
    conv = np.concatenate(convs)[order]
    prompts, history = _with_history(conv, ins, outs)
    return Requests(arrival, adapter, prompts, outs, conversation=conv, history_tokens=history)


#: Buckets of :func:`arrival_order` up to this many requests are put in order by insertion.
SMALL_BUCKET = 16


@numba.njit(cache=True)
def arrival_order(arrival):
    """The stable order of ``arrival`` (``np.argsort(arrival, kind="stable")``: equal times keep their order, so
    requests arriving together are in adapter order), in linear time for times spread over the run: each time
    goes to one of n/2 equal buckets, in order of position, and each bucket is sorted on its own. Five times
    faster than NumPy's stable sort on an hour of a GPU's arrivals."""
    n = arrival.shape[0]
    order = np.empty(n, np.int64)
    if n == 0:
        return order
    lo, hi = arrival.min(), arrival.max()
    buckets = max(1, n // 2)
    scale = (buckets - 1) / (hi - lo) if hi > lo else 0.0
    if not (np.isfinite(hi - lo) and np.isfinite(scale)):  # NaN, or a spread no bucket width can span
        return np.argsort(arrival, kind="mergesort")
    start = np.zeros(buckets + 1, np.int64)
    bucket = np.empty(n, np.int64)
    for i in range(n):
        b = min(int((arrival[i] - lo) * scale), buckets - 1)
        bucket[i] = b
        start[b + 1] += 1
    for b in range(buckets):
        start[b + 1] += start[b]
    fill = start[:-1].copy()
    for i in range(n):
        order[fill[bucket[i]]] = i
        fill[bucket[i]] += 1
    for b in range(buckets):
        s, e = start[b], start[b + 1]
        if e - s > SMALL_BUCKET:  # many equal or crowded times (bursts): a stable sort of the bucket
            seg = order[s:e].copy()
            order[s:e] = seg[np.argsort(arrival[seg], kind="mergesort")]
            continue
        for j in range(s + 1, e):
            cur = order[j]
            t = arrival[cur]
            k = j - 1
            while k >= s and arrival[order[k]] > t:
                order[k + 1] = order[k]
                k -= 1
            order[k + 1] = cur
    return order


def _with_history(conv: np.ndarray, new_in: np.ndarray, outs: np.ndarray):
    """(prompts, history tokens) of turns in arrival order: each prompt carries every earlier turn of
    its conversation, prompt and reply."""
    by_conv = np.argsort(conv, kind="stable")  # turns of one conversation stay in arrival order
    c = conv[by_conv]
    turn_tokens = new_in[by_conv].astype(np.int64) + outs[by_conv]
    csum = np.cumsum(turn_tokens) - turn_tokens  # tokens of all earlier turns, across conversations
    start = np.r_[True, c[1:] != c[:-1]]
    history = csum - np.maximum.accumulate(np.where(start, csum, 0))
    out = np.empty_like(history)
    out[by_conv] = history
    return (new_in + out).astype(np.int32), out.astype(np.int32)


def trace_requests(workload: Workload, arrival_s, adapter_ids, input_tokens, output_tokens) -> Requests:
    """Requests replayed from a trace (per-request times and lengths)."""
    index = {a.adapter_id: i for i, a in enumerate(workload.adapters)}
    try:
        adapter = np.array([index[x] for x in adapter_ids], np.int64)
    except KeyError as exc:
        raise WorkloadError(f"trace names adapter {exc.args[0]!r}, which the workload does not have") from None
    arrival = np.asarray(arrival_s, np.float64)
    ins = np.asarray(input_tokens, np.int64)
    outs = np.asarray(output_tokens, np.int64)
    if not (np.all(np.isfinite(arrival)) and np.all(arrival >= 0)):
        raise WorkloadError("trace arrival times must be finite and >= 0")
    if np.any(ins < 1) or np.any(outs < 1):
        raise WorkloadError("trace request lengths must be >= 1")
    order = np.argsort(arrival, kind="stable")
    return Requests(arrival[order], adapter[order], ins[order].astype(np.int32), outs[order].astype(np.int32))
