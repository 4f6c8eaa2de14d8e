"""greedy's search for the largest prefix ``queue[pos:pos+k]`` that passes the GPU test of
:func:`planner.packing.best_a_max`: exponential, then binary search over k.

Answered through ``Predictor.predict``, each question costs ~100 µs of Python, and a 4-GPU plan asks
~150 of them. With a compiled-tree predictor (the surrogate or the small trees) the whole search
runs in one compiled call that does per question what ``best_a_max`` does: the adapters' feature
sums once per load (margin-scaled, then stressed), every memory-feasible A_max, the same choice; it
gives the same plans, bit for bit (tests/test_prefix_search.py). With any other predictor (the
twin) the search asks ``best_a_max`` and keeps its answers by (pos, k) while the queue is unchanged, so
the balancing fills, which restart the search at the same positions, reuse earlier answers.

The twin answers a question in a simulated half hour to hour of the GPU (up to a second of a core for hundreds
of adapters), so where greedy knows a likely answer its search starts there instead of from one adapter: in a
balancing fill, which fills again under another load cap, where the same GPU of the fill before ended (the GPUs'
bounds move little from one cap to the next). It gallops from there, steps of 1/32 of the guess doubling, to a
passing prefix and a failing one, and bisects between them (:func:`largest_passing`). Each answer is a prefix the
twin passes; where the twin's verdict is not monotone in k (noise at the knee) it may be another one than the search
from one adapter finds, as valid.

Neither search takes a window holding one adapter twice: an adapter is in the queue twice only as
replicas of a hot adapter, each sized to most of what one GPU holds of it, so two never fit one GPU
(and a window of them would ask about their merged share, which greedy split because it failed).
"""

from __future__ import annotations

import numba
import numpy as np

from models.edge import MIN_PASS_PROBABILITY
from models.features import ARRIVING, N_FEATURES, N_SUMS, finish_features, scenario_sums, throughput_base
from models.surrogate import SurrogatePredictor
from models.trees import forest_row
from models.twin_predictor import size_cv2, size_scale
from planner.packing import STRESS_FACTOR, GroupVerdict, PackRequest, a_max_limit, aim_tpot_limit, best_a_max

Entry = tuple[int, float]  # (adapter index, share of its traffic)


def shares_of(entries: list[Entry]) -> dict[int, float]:
    """Adapter index → its summed share over ``entries`` (replicas of one adapter merge), in queue order."""
    out: dict[int, float] = {}
    for i, s in entries:
        out[i] = out.get(i, 0.0) + s
    return out


class PrefixSearch:
    """The largest passing prefix at a queue position (:meth:`largest`), over a queue that only
    changes where the caller says so (:meth:`reset`)."""

    def __init__(self, req: PackRequest, queue: list[Entry]):
        self.req, self.queue = req, queue
        self._verdicts: dict[tuple[int, int], GroupVerdict] = {}
        self._arrays: tuple[np.ndarray, ...] | None = None
        self._limits: tuple[np.ndarray, np.ndarray] | None = None
        self._tables: tuple | None = None

    def reset(self) -> None:
        """The queue changed (a hot adapter was split): forget every answer."""
        self._verdicts.clear()
        self._arrays = None
        self._limits = None

    def compiled(self) -> bool:
        return isinstance(self.req.predictor, SurrogatePredictor)

    def entry_loads(self) -> np.ndarray:
        """Arriving tokens/s of each queue entry (its adapter's, times its share)."""
        return self._queue_arrays()[5]

    def largest(self, pos: int, k_max: int, guess: int | None = None) -> tuple[int, int]:
        """Largest k <= k_max found such that queue[pos:pos+k] passes, and its A_max; (0, 0) if k=1 fails
        (``guess``: a likely k, where the twin's search starts)."""
        ranks, rates, d_in, d_out, next_same, _ = self._queue_arrays()
        k_max = min(k_max, int(next_same[pos:pos + k_max].min()) - pos)  # no window holds an adapter twice
        if not self.compiled():
            twin = self.req.predictor.kind == "twin" and guess is not None
            return self._search(pos, k_max, min(max(guess, 1), k_max) if twin else None)
        req, pred = self.req, self.req.predictor
        t, s = pred.throughput_forest, pred.starved_forest
        ttft = pred.ttft_forest if req.bar is not None and pred.ttft_forest is not None else t
        tpot = pred.tpot_forest if req.bar is not None and pred.tpot_forest is not None else t
        edge = pred.edge.forest if req.edge and pred.edge is not None else t
        ttft_limits, tpot_limits = self._latency_limits()
        queue = (ranks[pos:], rates[pos:], d_in[pos:], d_out[pos:], ttft_limits[pos:], tpot_limits[pos:])
        aim = (1.0 + req.margin, STRESS_FACTOR, float(req.min_ratio), ttft is not t, tpot is not t,
               float(req.size_margin), *req.size_terms, edge is not t, MIN_PASS_PROBABILITY, *self._few_aim())
        k, a_max = _largest_prefix(pred.terms, queue, k_max, self._candidate_tables(), aim,
                                   tuple(_record(f) for f in (t, s, ttft, tpot, edge)))
        return int(k), int(a_max)

    def _few_aim(self) -> tuple[int, float, float, float]:
        """How a prefix of few adapters is aimed (:meth:`PackRequest.aimed`): (the most adapters it covers, 0 for
        none; 1 + its margin; its TTFT allowance per adapter, ms; what to add to the log10 TPOT limits)."""
        req, few = self.req, self.req.few
        if few is None:
            return 0, 1.0, 0.0, 0.0
        shift = 0.0 if req.tpot_aim <= 0 else -np.log10((1.0 + req.few_margin) / (1.0 + req.margin) * few.tpot_factor)
        return few.adapters, 1.0 + req.few_margin, few.ttft_ms_per_adapter, float(shift)

    def _latency_limits(self) -> tuple[np.ndarray, np.ndarray]:
        """Per queue entry: log10 of the p99 TTFT limit (ms) its adapter holds a GPU to, and of the p99 TPOT
        the packer holds the prediction to (:func:`aim_tpot_limit`); inf: none."""
        if self._limits is None:
            req = self.req
            idx = np.array([i for i, _ in self.queue], np.int64)
            if req.bar is None:
                self._limits = np.full(len(idx), np.inf), np.full(len(idx), np.inf)
            else:
                ttft_ms = np.inf if req.bar.max_ttft_s is None else req.bar.max_ttft_s * 1000.0
                tpot_ms = np.inf if req.bar.max_tpot_ms is None else req.bar.max_tpot_ms
                tpot = np.fmin(req.adapter_tpot_ms[idx], tpot_ms)
                if req.tpot_aim > 0:
                    tpot = aim_tpot_limit(tpot, req.tpot_aim)
                self._limits = np.log10(np.fmin(req.adapter_ttft_s[idx] * 1000.0, ttft_ms)), np.log10(tpot)
        return self._limits

    def _search(self, pos: int, k_max: int, guess: int | None = None) -> tuple[int, int]:
        """The search of ``_largest_prefix``, asking ``best_a_max`` (from ``guess`` where one is given)."""
        k = largest_passing(lambda k: self._verdict(pos, k).ok, k_max, guess)
        return (k, self._verdict(pos, k).a_max) if k else (0, 0)

    def _verdict(self, pos: int, k: int) -> GroupVerdict:
        key = (pos, k)
        if key not in self._verdicts:
            self._verdicts[key] = best_a_max(self.req, shares_of(self.queue[pos:pos + k]))
        return self._verdicts[key]

    def _queue_arrays(self) -> tuple[np.ndarray, ...]:
        """Per queue entry: rank, rate × share (as ``group_scenario`` multiplies), lengths, the position
        of the next entry of the same adapter (len(queue) if none), arriving tokens/s."""
        if self._arrays is None:
            req, n = self.req, len(self.queue)
            idx = np.array([i for i, _ in self.queue], np.int64)
            share = np.array([s for _, s in self.queue], np.float64)
            by_adapter = np.argsort(idx, kind="stable")  # each adapter's positions, in order
            same = idx[by_adapter[1:]] == idx[by_adapter[:-1]]
            next_same = np.full(n, n, np.int64)
            next_same[by_adapter[:-1][same]] = by_adapter[1:][same]
            self._arrays = (req.ranks[idx], req.rates_rps[idx] * share, req.input_tokens[idx],
                            req.output_tokens[idx], next_same, req.arriving_tok_s[idx] * share)
        return self._arrays

    def _candidate_tables(self) -> tuple[np.ndarray, ...]:
        """Per adapter rank of the workload (ascending): the largest A_max that starts with it, the
        max_lora_rank a group whose largest rank it is runs with (``group_scenario``'s default); the
        profiled A_max points; KV tokens by A_max (a row per rank, a column per A_max from 0 to the
        workload's adapter count: the compiled search never tests a window holding an adapter twice)."""
        if self._tables is None:
            req = self.req
            values = sorted(set(req.ranks.tolist()))
            limits = [a_max_limit(req.kv, [r]) for r in values]
            lora = [req.kv.rank_for(r) or 0 for r in values]
            top = min(max(limits), len(req.ranks))
            kv = np.full((len(values), top + 1), -1, np.int64)
            for j, (limit, rank) in enumerate(zip(limits, lora)):
                if limit >= 1:
                    kv[j] = req.kv.tokens_array(rank, top)
            self._tables = (np.array(values, np.int64), np.array(limits, np.int64), np.array(lora, np.int64),
                            np.array(sorted(req.kv.a_max_points), np.int64), kv)
        return self._tables


#: The twin's search gallops from its guess in steps of the guess over this, doubling.
GALLOP_DIVISOR = 32


def largest_passing(ok, k_max: int, guess: int | None = None) -> int:
    """The largest k <= k_max the search finds with ``ok(k)`` (0: not even k = 1): from k = 1 by doubling, or
    galloping from ``guess`` (1 <= guess <= k_max), then bisecting. Where ``ok`` is monotone, the largest k it
    holds for, whatever the guess."""
    lo, hi = _doubling(ok, k_max) if guess is None else _galloping(ok, guess, k_max)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _doubling(ok, k_max: int) -> tuple[int, int]:
    """(lo, hi): ``ok(lo)`` and not ``ok(hi)``, found from k = 1 by doubling k (hi = lo + 1 where lo is ``k_max``;
    (0, 1) where k = 1 fails)."""
    if not ok(1):
        return 0, 1
    lo, k = 1, 2
    while k <= k_max:
        if not ok(k):
            return lo, k
        lo, k = k, k * 2
    if lo == k_max or ok(k_max):
        return k_max, k_max + 1
    return lo, k_max


def _galloping(ok, guess: int, k_max: int) -> tuple[int, int]:
    """(lo, hi) as :func:`_doubling` finds them, from ``guess`` (1 <= guess <= k_max) up or down in steps of
    ``guess`` / :data:`GALLOP_DIVISOR`, doubling; ``k_max`` first where it is within a step of the guess (a balancing
    fill's cap, which mostly passes)."""
    step = max(1, guess // GALLOP_DIVISOR)
    if k_max - guess <= step:
        if ok(k_max):
            return k_max, k_max + 1
        hi = k_max
    elif ok(guess):
        lo = guess
        while True:
            k = min(lo + step, k_max)
            if not ok(k):
                return lo, k
            if k == k_max:
                return k_max, k_max + 1
            lo, step = k, step * 2
    else:
        hi = guess
    while hi > 1:
        k = max(1, hi - step)
        if ok(k):
            return k, hi
        hi, step = k, step * 2
    return 0, 1


def _record(forest) -> tuple[np.ndarray, ...]:
    """A packed forest as the kernels take it: (nodes, thresholds, leaf_row, leaf_value, roots)."""
    return forest.nodes, forest.thresholds, forest.leaf_row, forest.leaf_value, forest.roots


@numba.njit(cache=True)
def _largest_prefix(terms, queue, k_max, tables, aim, forests):
    """PrefixSearch._search over compiled verdicts: (k, A_max), (0, 0) when the first adapter alone fails.

    ``queue``: per entry from the search's position, (rank, rate, input tokens, output tokens, log10 of the
    p99 TTFT limit in ms, log10 of the p99 TPOT the prediction is held to); ``tables``:
    :meth:`PrefixSearch._candidate_tables`; ``aim``: (1 + the margin, the stress factor on top of it, the
    served share required, whether the TTFT forest predicts the TTFT limit, the same of TPOT, the size margin
    and the three size terms of :meth:`PackRequest.aim_scale`, whether the edge classifier must give
    "passes", the least probability it must give, then :meth:`PrefixSearch._few_aim`); ``forests``: the
    throughput, starved, TTFT, TPOT and edge forests as :func:`_record` gives them."""
    ranks, rates, input_tokens, output_tokens, ttft_limits, tpot_limits = queue
    rank_values = tables[0]
    need = np.empty(k_max, np.int64)  # row of rank_values holding each prefix's largest rank
    limit = np.empty(k_max)  # each prefix's TTFT limit: the strictest of its entries'
    tpot_limit = np.empty(k_max)  # and its TPOT limit
    top_rank = 0
    strictest = strictest_tpot = np.inf
    for i in range(k_max):
        top_rank = max(top_rank, ranks[i])
        need[i] = np.searchsorted(rank_values, top_rank)
        strictest = min(strictest, ttft_limits[i])
        limit[i] = strictest
        strictest_tpot = min(strictest_tpot, tpot_limits[i])
        tpot_limit[i] = strictest_tpot
    group = (ranks, rates, input_tokens, output_tokens, need, limit, tpot_limit)
    # buffers: rates scaled, the nominal and stressed feature sums, a feature row, its float32 copy with the
    # edge classifier's own feature after it, a forest's outputs
    work = (np.empty(k_max), np.empty(N_SUMS), np.empty(N_SUMS), np.empty(N_FEATURES),
            np.empty(N_FEATURES + 1, np.float32), np.empty(2))
    a_first = _prefix_verdict(1, terms, group, tables, aim, work, forests)
    if a_first == 0:
        return 0, 0
    lo, lo_a, hi, k = 1, a_first, -1, 2
    while k <= k_max:
        a = _prefix_verdict(k, terms, group, tables, aim, work, forests)
        if a:
            lo, lo_a, k = k, a, k * 2
        else:
            hi = k
            break
    if hi < 0:
        if lo == k_max:
            return lo, lo_a
        a = _prefix_verdict(k_max, terms, group, tables, aim, work, forests)
        if a:
            return k_max, a
        hi = k_max
    while hi - lo > 1:
        mid = (lo + hi) // 2
        a = _prefix_verdict(mid, terms, group, tables, aim, work, forests)
        if a:
            lo, lo_a = mid, a
        else:
            hi = mid
    return lo, lo_a


@numba.njit(cache=True)
def _prefix_verdict(k, terms, group, tables, aim, work, forests):
    """``best_a_max`` of the first k adapters of ``group`` (the queue's arrays, then per prefix the row of
    its largest rank and its TTFT and TPOT limits): the chosen A_max, 0 if none passes. Candidates as
    ``a_max_candidates``: every profiled point below top = min(k, A_max limit), then top. With a TTFT limit
    and a latency forest, the passing candidate with the lowest p99 TTFT at the stressed load wins, else the
    one with the highest stressed throughput (ties: the larger A_max)."""
    ranks, rates, input_tokens, output_tokens, need, ttft_limit, tpot_limit = group
    _, limits, lora_ranks, points, kv = tables
    (scale, stress, min_ratio, use_ttft, use_tpot, size_margin, cv_in2, cv_out2, one_cs2, use_edge, edge_min,
     few_k, few_scale, few_ttft_ms, few_tpot_shift) = aim
    buf, nominal, stressed, x, x32, out = work
    throughput, starved, ttft, tpot, edge = forests
    row = need[k - 1]
    top = min(k, limits[row])
    if top < 1:
        return 0
    rank = lora_ranks[row]
    lim = ttft_limit[k - 1]
    tpot_lim = tpot_limit[k - 1]
    if k <= few_k:  # PackRequest.aimed
        scale = few_scale
        if lim < np.inf:
            lim = np.log10(max(10.0 ** lim - few_ttft_ms * k, 1e-3))
        tpot_lim = tpot_lim + few_tpot_shift
    latency = use_ttft and lim < np.inf
    per_token = use_tpot and tpot_lim < np.inf
    if size_margin > 0:
        scale = scale * size_scale(size_cv2(rates[:k], input_tokens[:k], output_tokens[:k], cv_in2, cv_out2),
                                   one_cs2, size_margin)
    for i in range(k):
        buf[i] = rates[i] * scale
    scenario_sums(ranks[:k], buf[:k], input_tokens[:k], output_tokens[:k], nominal)
    have_stressed = False
    best, best_score = 0, 0.0
    n_points = 0
    while n_points < points.shape[0] and points[n_points] < top:
        n_points += 1
    for c in range(n_points + 1):
        a = points[c] if c < n_points else top
        tokens = float(kv[row, a])
        _features32(terms, nominal, a, rank, tokens, x, x32)
        if not _passes(x, x32, out, min_ratio, throughput, starved):
            continue
        if latency and _predict(x32, out, ttft) > lim:
            continue
        if per_token and _predict(x32, out, tpot) > tpot_lim:
            continue
        if use_edge:
            x32[N_FEATURES] = min(1.0, a / x[0])  # models.edge.edge_features
            if _predict(x32, out, edge, 1) < edge_min:
                continue
        if not have_stressed:
            for i in range(k):
                buf[i] = rates[i] * (stress * scale)
            scenario_sums(ranks[:k], buf[:k], input_tokens[:k], output_tokens[:k], stressed)
            have_stressed = True
        _features32(terms, stressed, a, rank, tokens, x, x32)
        if latency:
            score = -_predict(x32, out, ttft)
        else:
            score = _throughput(x, x32, out, throughput)
        if best == 0 or score >= best_score:  # candidates ascend: a tie goes to the larger A_max
            best, best_score = a, score
    return best


@numba.njit(cache=True)
def _features32(terms, sums, a_max, max_rank, kv, x, x32):
    """The feature row of a scenario (``x``) and its float32 copy, what the forests read (``x32`` may be longer:
    the edge classifier's own feature follows)."""
    finish_features(terms, sums, a_max, max_rank, kv, x)
    for f in range(x.shape[0]):
        x32[f] = x[f]


@numba.njit(cache=True, inline="always")
def _predict(x32, out, forest, output=0):
    """One output of a forest (a :func:`_record`) for the row ``x32``: a latency forest's log10 ms, a
    classifier's probability of class ``output``."""
    forest_row(forest[0], forest[1], forest[2], forest[3], forest[4], x32, out)
    return out[output]


@numba.njit(cache=True, inline="always")
def _throughput(x, x32, out, forest):
    return _predict(x32, out, forest) * throughput_base(x)


@numba.njit(cache=True, inline="always")
def _passes(x, x32, out, min_ratio, throughput, starved):
    """Of the feature row in ``x``/``x32``: not starved, and serving ``min_ratio`` of its load if > 0 (the
    throughput forest runs only then)."""
    _predict(x32, out, starved)
    if out[1] > out[0]:
        return False
    return min_ratio <= 0 or _throughput(x, x32, out, throughput) >= min_ratio * x[ARRIVING]
