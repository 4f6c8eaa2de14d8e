"""The policies' decision rules as small compiled functions (used by the event loop, tested alone).

Eviction scores (lowest is evicted first), Chameleon's queue cut-offs and quotas, ELORA's target
LoRA count. Constants and formulas cite ``shared/reference/serving-policies-notes.md`` (§1 Chameleon,
§3 ELORA) and the papers' sections; choices the papers leave open are marked "Choice".
"""

from __future__ import annotations

import numba as nb
import numpy as np

# Adapter-cache eviction rules.
CACHE_DISCARD, CACHE_LRU, CACHE_CHAMELEON, CACHE_ELORA = 0, 1, 2, 3

# Indices into the float parameter vector (``twin.policies.spec.PolicySpec.float_params``).
P_SCORE_F, P_SCORE_R, P_SCORE_S = 0, 1, 2
P_FREQ_WINDOW_S = 3
P_REFRESH_S, P_SLO_S, P_WRS_A, P_WRS_B = 4, 5, 6, 7
P_SWAP_PERIOD_S, P_IDLE_THRESHOLD, P_RECENCY_TAU_S, P_BATCH_WINDOW_S = 8, 9, 10, 11
P_CPU_SYNC_MS = 12
N_FLOAT_PARAMS = 13


@nb.njit(cache=True)
def decayed(count, stamp, now, window_s):
    """A use counter decayed with time constant ``window_s`` (Choice: the papers' "uses within a
    time frame" as an exponentially decaying count, so no per-use history is kept)."""
    return count * np.exp(-(now - stamp) / window_s)


@nb.njit(cache=True)
def eviction_scores(mode, now, cand, freq, freq_t, last_used, size_tokens, load_ms, params):
    """Keep-value of every candidate adapter (``cand[a]``); the lowest is evicted first.

    * LRU and discard-after-use: last use time.
    * Chameleon (§1.2): ``F*Frequency + R*Recency + S*Size`` with F, R, S = 0.45, 0.10, 0.45.
      Choice (the paper gives no normalisation): each term scaled to [0, 1] over the candidates —
      frequency / max frequency, recency 1 - age / max age, size / max size.
    * ELORA (§3.3, eq. 5): ``cost * visit * (1 - sigmoid(t / tau))`` with cost = the adapter's
      transfer time, visit = its share of recent uses, t = time since last use. Eq. 4's factor
      ``min(1, Now_LoRA / Low_lora)`` is the same for every LoRA candidate, so it cannot change
      which LoRA goes first; it decides how many LoRAs the swapper keeps (see ``low_lora``) and, in
      ``engine._make_room``, weighs a LoRA against history KV.
    """
    na = cand.shape[0]
    out = np.full(na, np.inf)
    w = params[P_FREQ_WINDOW_S]
    if mode == CACHE_CHAMELEON or mode == CACHE_ELORA:
        f = np.zeros(na)
        fmax, amax, smax, ftot = 0.0, 0.0, 0.0, 0.0
        for a in range(na):
            f[a] = decayed(freq[a], freq_t[a], now, w)
            ftot += f[a]
            if cand[a]:
                fmax = max(fmax, f[a])
                amax = max(amax, now - last_used[a])
                smax = max(smax, size_tokens[a])
        for a in range(na):
            if not cand[a]:
                continue
            age = now - last_used[a]
            if mode == CACHE_CHAMELEON:
                fn = f[a] / fmax if fmax > 0 else 0.0
                rn = 1.0 - age / amax if amax > 0 else 1.0
                sn = size_tokens[a] / smax if smax > 0 else 0.0
                out[a] = params[P_SCORE_F] * fn + params[P_SCORE_R] * rn + params[P_SCORE_S] * sn
            else:
                visit = f[a] / ftot if ftot > 0 else 0.0
                out[a] = load_ms[a] * visit * (1.0 - 1.0 / (1.0 + np.exp(-age / params[P_RECENCY_TAU_S])))
    else:
        for a in range(na):
            if cand[a]:
                out[a] = last_used[a]
    return out


@nb.njit(cache=True)
def low_lora(freq, freq_t, now, window_s, batch_size):
    """ELORA eq. 3: expected distinct LoRAs in a batch, ``sum_i 1 - (1 - p_i)^BS``."""
    na = freq.shape[0]
    f = np.zeros(na)
    tot = 0.0
    for a in range(na):
        f[a] = decayed(freq[a], freq_t[a], now, window_s)
        tot += f[a]
    if tot <= 0:
        return 0.0
    s = 0.0
    for a in range(na):
        s += 1.0 - (1.0 - f[a] / tot) ** batch_size
    return s


@nb.njit(cache=True)
def kmeans_boundaries(values, k):
    """Chameleon's queue cut-offs (§1.3): 1-D K-means on recent WRS values, boundaries at the
    midpoints of consecutive centroids. Choice: K is fixed (minimal WCSS always picks K_max), the
    centroids start at the (i + 0.5)/K quantiles and Lloyd's iterations run to convergence."""
    x = np.sort(values)
    n = x.shape[0]
    bounds = np.full(k - 1, np.inf)
    if n == 0:
        return bounds
    c = np.empty(k)
    for i in range(k):
        c[i] = x[min(n - 1, int((i + 0.5) * n / k))]
    for _ in range(100):
        s = np.zeros(k)
        m = np.zeros(k)
        j = 0
        for v in x:
            while j < k - 1 and v >= (c[j] + c[j + 1]) / 2:
                j += 1
            s[j] += v
            m[j] += 1
        moved = False
        for i in range(k):
            if m[i] > 0 and s[i] / m[i] != c[i]:
                c[i] = s[i] / m[i]
                moved = True
        c = np.sort(c)
        if not moved:
            break
    for i in range(k - 1):
        bounds[i] = (c[i] + c[i + 1]) / 2
    return bounds


@nb.njit(cache=True)
def queue_of(wrs, bounds):
    q = 0
    while q < bounds.shape[0] and wrs >= bounds[q]:
        q += 1
    return q


@nb.njit(cache=True)
def mlq_quotas(max_size, duration_s, rate, slo_s, total_tokens):
    """Chameleon's per-queue token quotas (§1.3, K x M/M/1): ``Tok_min = S * D * (1/SLO + lambda)``;
    the rest of ``total_tokens`` is shared in proportion to the queues' arrival rates (Choice: the
    paper's "initial weights" are not defined). If the minima exceed the total they are scaled down
    to fit (Choice: the paper states only the constraint)."""
    k = max_size.shape[0]
    tok = max_size * duration_s * (1.0 / slo_s + rate)
    need = tok.sum()
    if need >= total_tokens:
        return tok * (total_tokens / need) if need > 0 else np.full(k, total_tokens / k)
    lam = rate.sum()
    rest = total_tokens - need
    for q in range(k):
        tok[q] += rest * (rate[q] / lam if lam > 0 else 1.0 / k)
    return tok
