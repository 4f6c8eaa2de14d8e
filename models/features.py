"""Scenario features: the study's seven plus load-aware ones, computed by one numba function.

The same function serves the dataset builder and the predictors, so training and prediction can
never disagree on a feature; the packer's compiled search calls its two halves itself
(:func:`scenario_sums` once per group and load, :func:`finish_features` per A_max). Rates are
req/s, lengths are mean tokens per request.

* ``served_adapters, sum_rate, std_rate, max_rank, mean_rank, std_rank, a_max`` — the study's seven
  (population standard deviations, as its ``create_dataset.py``).
* ``max_lora_rank`` and ``kv_tokens`` (the profile's T_max for that A_max and max rank): the
  engine's start-up settings.
* ``mean_input_tokens``, ``mean_output_tokens`` (rate-weighted) and ``arriving_tok_s``: the study
  has no length features although the planner knows the lengths.
* ``rank_weighted_rate`` = Σ λ·rank.
* ``expected_active_adapters`` = Σ (1 − exp(−λ·out·RESIDENCY_S_PER_TOKEN)): adapters with a request
  in flight at a random instant if a request stays ``out × RESIDENCY_S_PER_TOKEN`` seconds;
  ``active_over_a_max`` is that over A_max (how often the adapter cap bites).
* ``kv_demand`` = in-flight KV tokens under the same residency over ``kv_tokens``.
* ``saturation_tok_s``: total tok/s of the engine kept full (:func:`saturation_tok_s`, from the
  profile's step-latency model) and ``load_over_saturation`` = arriving / that. Starved scenarios
  serve about their capacity, which the study's features can only approximate piecewise; with
  this estimate the trees learn a correction instead (5-fold CV throughput SMAPE 8.7 % → 4.9 % on
  3,000 rows of the shipped Llama set: ``benchmarks/studies/saturation_feature.py``).

Profile terms enter through one array, :func:`engine_terms`.
"""

from __future__ import annotations

import numba
import numpy as np

from twin.core import step_ms

PAPER_FEATURES = ("served_adapters", "sum_rate", "std_rate", "max_rank", "mean_rank", "std_rank", "a_max")
FEATURES = PAPER_FEATURES + (
    "max_lora_rank", "kv_tokens", "mean_input_tokens", "mean_output_tokens", "arriving_tok_s",
    "rank_weighted_rate", "expected_active_adapters", "active_over_a_max", "kv_demand",
    "saturation_tok_s", "load_over_saturation",
)
N_FEATURES = len(FEATURES)
#: Nominal seconds a request stays in the engine per output token (a decode step at moderate batch).
RESIDENCY_S_PER_TOKEN = 0.03
ARRIVING = FEATURES.index("arriving_tok_s")
SATURATION = FEATURES.index("saturation_tok_s")


def engine_terms(profile) -> np.ndarray:
    """The profile numbers the features use: max_num_seqs, max_num_batched_tokens, then the
    step-latency coefficients in ``StepLatency.as_array`` order. The reserved-slot cost (``l3``)
    is not among them: it depends on the server's A_max and max rank, which are features of their
    own, so the forests learn it from the data."""
    e = profile.engine
    return np.array([e.max_num_seqs, e.max_num_batched_tokens, *profile.step_latency.as_array()], np.float64)


@numba.njit(cache=True)
def saturation_tok_s(terms, input_tokens, output_tokens, batch_adapters, kv_tokens):
    """Total tok/s of an engine whose queue never empties (a deliberately simple steady state).

    The batch holds as many requests as the KV cache fits at their mid-decode size (capped by
    max_num_seqs), and as many decodes as the token budget leaves room for with each request's
    prompt spread over its output steps; the step takes the profile's step latency for that
    batch with ``batch_adapters`` distinct adapters.
    """
    max_seqs, budget = terms[0], terms[1]
    b = min(max_seqs, kv_tokens / (input_tokens + 0.5 * output_tokens))
    b = min(b, budget * output_tokens / (input_tokens + output_tokens))
    p = b * input_tokens / output_tokens
    return (b + p) / step_ms(terms[2:], b, p, batch_adapters) * 1000.0


#: Length of :func:`scenario_sums`' output.
N_SUMS = 12


@numba.njit(cache=True)
def fill_features(terms, ranks, rates, input_tokens, output_tokens, a_max, max_lora_rank, kv_tokens, out):
    """Write the ``FEATURES`` of one scenario into ``out`` (float64, length ``N_FEATURES``);
    ``terms`` is :func:`engine_terms` of the profile."""
    sums = np.empty(N_SUMS)
    scenario_sums(ranks, rates, input_tokens, output_tokens, sums)
    finish_features(terms, sums, a_max, max_lora_rank, kv_tokens, out)


@numba.njit(cache=True)
def scenario_sums(ranks, rates, input_tokens, output_tokens, sums):
    """The per-adapter sums behind the features (the part that does not depend on the start-up
    settings A_max, max_lora_rank, KV tokens): a packer testing one group under several A_max
    computes them once (:func:`finish_features` per A_max)."""
    n = ranks.shape[0]
    sum_rate = 0.0
    sum_rank = 0.0
    max_rank = 0.0
    w_in = 0.0
    w_out = 0.0
    plain_in = 0.0
    plain_out = 0.0
    arriving = 0.0
    rank_rate = 0.0
    active = 0.0
    kv_in_flight = 0.0
    for i in range(n):
        lam = rates[i]
        r = float(ranks[i])
        sum_rate += lam
        sum_rank += r
        max_rank = max(max_rank, r)
        w_in += lam * input_tokens[i]
        w_out += lam * output_tokens[i]
        plain_in += input_tokens[i]
        plain_out += output_tokens[i]
        arriving += lam * (input_tokens[i] + output_tokens[i])
        rank_rate += lam * r
        in_flight = lam * output_tokens[i] * RESIDENCY_S_PER_TOKEN
        active += 1.0 - np.exp(-in_flight)
        kv_in_flight += in_flight * (input_tokens[i] + 0.5 * output_tokens[i])
    mean_rate = sum_rate / n
    mean_rank = sum_rank / n
    var_rate = 0.0
    var_rank = 0.0
    for i in range(n):
        var_rate += (rates[i] - mean_rate) ** 2
        var_rank += (float(ranks[i]) - mean_rank) ** 2
    sums[0] = n
    sums[1] = sum_rate
    sums[2] = np.sqrt(var_rate / n)
    sums[3] = max_rank
    sums[4] = mean_rank
    sums[5] = np.sqrt(var_rank / n)
    sums[6] = w_in / sum_rate if sum_rate > 0 else plain_in / n
    sums[7] = w_out / sum_rate if sum_rate > 0 else plain_out / n
    sums[8] = arriving
    sums[9] = rank_rate
    sums[10] = active
    sums[11] = kv_in_flight


@numba.njit(cache=True)
def finish_features(terms, sums, a_max, max_lora_rank, kv_tokens, out):
    """``out`` = the features of the scenario whose :func:`scenario_sums` are ``sums``, run with these
    start-up settings."""
    n = sums[0]
    for k in range(6):
        out[k] = sums[k]
    out[6] = a_max
    out[7] = max_lora_rank
    out[8] = kv_tokens
    out[9] = sums[6]
    out[10] = sums[7]
    out[11] = sums[8]
    out[12] = sums[9]
    out[13] = sums[10]
    out[14] = sums[10] / a_max
    out[15] = sums[11] / kv_tokens
    out[16] = saturation_tok_s(terms, out[9], out[10], min(a_max, n), kv_tokens)
    out[17] = sums[8] / out[16]


@numba.njit(cache=True)
def throughput_base(x):
    """What the throughput surrogate's output multiplies: min(arriving, saturation) of a feature row.

    The regressed target is throughput over this base, near 1 both when the engine keeps up and
    when it is saturated, which trees fit far better than raw tok/s or the served fraction.
    """
    return min(x[ARRIVING], x[SATURATION])


def feature_row(terms, ranks, rates, input_tokens, output_tokens, a_max: int, max_lora_rank: int,
                kv_tokens: int) -> np.ndarray:
    """The features of one scenario as a new float64 array."""
    out = np.empty(N_FEATURES)
    fill_features(terms, np.asarray(ranks, np.int64), np.asarray(rates, np.float64),
                  np.asarray(input_tokens, np.float64), np.asarray(output_tokens, np.float64),
                  int(a_max), int(max_lora_rank), float(kv_tokens), out)
    return out
