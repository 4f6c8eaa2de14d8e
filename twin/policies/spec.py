"""Serving policies by name: stock vLLM (the default) and the published alternatives.

A policy is a combination of an adapter-cache rule, a scheduler and a cold-start mode (see
``twin.policies.engine``) plus the papers' constants. Each preset is faithful to its paper's
mechanisms that change what the planner predicts; the fields are the choices the papers leave open,
each overridable (``planner simulate --policy chameleon --policy-param scheduler=fifo``).

=========  =====================  ==========  ==========  ============================================
name       cache                  scheduler   cold start  paper
=========  =====================  ==========  ==========  ============================================
vllm       a_max LRU slots        vLLM FIFO   inline      stock vLLM V1 (``twin.core``)
slora      discard after use      FIFO        async       S-LoRA, the baseline of Chameleon/Toppings
chameleon  F/R/S score            MLQ+quotas  async       Chameleon (MICRO '25) §4-5
toppings   discard after use      FIFO        cpu         Toppings (ATC '25) §4.1
elora      ELORA retention value  FIFO        async       ELORA §4, with its periodic swapper and
                                                         history KV (prefix cache, host tier, dependency)
=========  =====================  ==========  ==========  ============================================

Toppings' rank-aware routing (its Algorithm 1) picks a server per request among several; a twin of
one server has nothing to route, so it is not modelled here: the planner's packer decides which
adapters share a GPU. ELORA's history-KV reuse acts on multi-turn workloads
(``twin.workload.Conversations``); on single-turn ones its dependency rule reduces to "a LoRA with
running requests is never evicted" (every policy here obeys it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import numpy as np

from twin.errors import WorkloadError
from twin.policies import engine, rules

STOCK = "vllm"

_CACHE = {"discard": rules.CACHE_DISCARD, "lru": rules.CACHE_LRU, "chameleon": rules.CACHE_CHAMELEON,
          "elora": rules.CACHE_ELORA}
_SCHED = {"fifo": engine.SCHED_FIFO, "mlq": engine.SCHED_MLQ}
_COLD = {"inline": engine.COLD_INLINE, "async": engine.COLD_ASYNC, "cpu": engine.COLD_CPU}


@dataclass(frozen=True)
class PolicySpec:
    name: str
    cache: str = "discard"
    scheduler: str = "fifo"
    cold_start: str = "async"
    prefetch: bool = True  # start copying a queued request's adapter when it arrives (S-LoRA, Chameleon)
    preload_all: bool = False  # every adapter on the GPU from the start (Toppings' CACHED upper bound)
    # Chameleon cache score (§1.2: F, R, S = 0.45, 0.10, 0.45) and the use-count window (Choice).
    score_f: float = 0.45
    score_r: float = 0.10
    score_s: float = 0.45
    freq_window_s: float = 60.0
    # Chameleon scheduler (§1.3): K = 4 queues, T_refresh 5 min, WRS weights A, B = 0.4, 0.6,
    # SLO in the quota formula (the paper's P99 TTFT SLO on Splitwise: 5 s), output-length predictor
    # error (log-normal sigma; the paper's predictor is ~80 % accurate).
    queues: int = 4
    refresh_s: float = 300.0
    slo_s: float = 5.0
    wrs_a: float = 0.4
    wrs_b: float = 0.6
    output_prediction_sigma: float = 0.2
    # Opportunistic Bypass (MICRO paper §5; the blog's variant blocks the queue instead): younger
    # requests may pass a head whose adapter finds no memory, and are squashed if it finds some first.
    bypass: bool = True
    # ELORA swapper (§3.3): every 100 ms, swap in while the pool is below 70 % used; recency time
    # constant of 1 - sigmoid(t / tau) (Choice: the paper gives no unit); batch-size window 5 s.
    swap_period_s: float = 0.1
    idle_threshold: float = 0.70
    recency_tau_s: float = 1.0
    batch_window_s: float = 5.0
    # Toppings: per-layer GPU<->CPU synchronisation cost of a CPU-assisted step (§4.2: "< 1 ms").
    cpu_sync_ms: float = 1.0
    # History KV of multi-turn conversations (``twin.policies.history``): kept for the next turn
    # (prefix caching), swapped to host memory instead of dropped, and never outliving its adapter
    # on the GPU (ELORA's dependency tree). All three are ELORA's; S-LoRA reuses no history.
    prefix_cache: bool = False
    host_kv: bool = False
    dependency: bool = False

    def __post_init__(self):
        for name, table in (("cache", _CACHE), ("scheduler", _SCHED), ("cold_start", _COLD)):
            if getattr(self, name) not in table:
                raise WorkloadError(f"policy {self.name}: {name} must be one of {', '.join(table)}")
        if self.queues < 1:
            raise WorkloadError(f"policy {self.name}: queues must be >= 1")
        for name in ("freq_window_s", "refresh_s", "slo_s", "swap_period_s", "recency_tau_s", "batch_window_s"):
            if not getattr(self, name) > 0:
                raise WorkloadError(f"policy {self.name}: {name} must be > 0")
        if not 0 < self.idle_threshold <= 1:
            raise WorkloadError(f"policy {self.name}: idle_threshold must be in (0, 1]")

    def loop_settings(self) -> dict:
        """The policy's switches as the loop reads them (``engine.Server``'s fields of those names)."""
        return {"cache": _CACHE[self.cache], "scheduler": _SCHED[self.scheduler], "cold_start": _COLD[self.cold_start],
                "prefetch": bool(self.prefetch), "queues": int(self.queues), "preload_all": bool(self.preload_all),
                "bypass": bool(self.bypass)}

    def float_params(self) -> np.ndarray:
        p = np.zeros(rules.N_FLOAT_PARAMS)
        p[rules.P_SCORE_F], p[rules.P_SCORE_R], p[rules.P_SCORE_S] = self.score_f, self.score_r, self.score_s
        p[rules.P_FREQ_WINDOW_S] = self.freq_window_s
        p[rules.P_REFRESH_S], p[rules.P_SLO_S] = self.refresh_s, self.slo_s
        p[rules.P_WRS_A], p[rules.P_WRS_B] = self.wrs_a, self.wrs_b
        p[rules.P_SWAP_PERIOD_S], p[rules.P_IDLE_THRESHOLD] = self.swap_period_s, self.idle_threshold
        p[rules.P_RECENCY_TAU_S], p[rules.P_BATCH_WINDOW_S] = self.recency_tau_s, self.batch_window_s
        p[rules.P_CPU_SYNC_MS] = self.cpu_sync_ms
        return p

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


PRESETS = {
    "slora": PolicySpec("slora"),
    "chameleon": PolicySpec("chameleon", cache="chameleon", scheduler="mlq"),
    "toppings": PolicySpec("toppings", cold_start="cpu"),
    "elora": PolicySpec("elora", cache="elora", prefix_cache=True, host_kv=True, dependency=True),
}
POLICY_NAMES = (STOCK, *PRESETS)


def policy_from_name(name: str, **overrides) -> PolicySpec | None:
    """The named policy with ``overrides``; None for stock vLLM (which takes no overrides)."""
    if name == STOCK:
        if overrides:
            raise WorkloadError("policy vllm takes no policy parameters (it is the stock twin)")
        return None
    if name not in PRESETS:
        raise WorkloadError(f"unknown policy '{name}' (known: {', '.join(POLICY_NAMES)})")
    known = {f.name: f.type for f in fields(PolicySpec)} if overrides else {}
    for key in overrides:
        if key not in known or key == "name":
            raise WorkloadError(f"policy {name} has no parameter '{key}' (known: {', '.join(list(known)[1:])})")
    return replace(PRESETS[name], **overrides)


#: What a policy parameter's value must be, by its type, in words.
KIND_WORDS = {"bool": "true or false", "int": "a whole number", "float": "a finite number", "str": "a word"}


def parse_overrides(items: tuple[str, ...] | list[str]) -> dict:
    """``KEY=VALUE`` strings (CLI) to typed overrides: bools, numbers or words."""
    out: dict = {}
    types = {f.name: f.type for f in fields(PolicySpec)}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in types or key == "name":
            raise WorkloadError(f"--policy-param {item!r}: expected KEY=VALUE with KEY one of "
                                f"{', '.join(k for k in types if k != 'name')}")
        kind = types[key]
        try:
            if kind == "bool":
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                out[key] = value.lower() in ("true", "1")
            elif kind == "int":
                out[key] = int(value)
            elif kind == "float":
                out[key] = float(value)
                if not math.isfinite(out[key]):
                    raise ValueError(value)
            else:
                out[key] = value
        except ValueError:
            raise WorkloadError(f"--policy-param {item!r}: {key} must be {KIND_WORDS.get(kind, kind)}") from None
    return out


def policy_record(spec: PolicySpec | None) -> dict | None:
    """How files (placements, datasets, surrogates) record a policy: its name and the parameters that
    differ from its preset. None for stock vLLM, which files record by leaving the key out, so files
    written before policies existed read as stock."""
    if spec is None:
        return None
    preset = PRESETS[spec.name]
    return {"name": spec.name, "params": {k: v for k, v in spec.to_dict().items() if v != getattr(preset, k)}}


def policy_from_record(record, **overrides) -> PolicySpec | None:
    """The policy a file recorded (None or absent: stock vLLM), with ``overrides`` on top."""
    if record is None:
        return policy_from_name(STOCK, **overrides)
    if not isinstance(record, dict) or not isinstance(record.get("name"), str) \
            or not isinstance(record.get("params", {}), dict):
        raise WorkloadError(f"a recorded policy must be {{'name': ..., 'params': {{...}}}}, not {record!r}")
    return policy_from_name(record["name"], **{**record.get("params", {}), **overrides})


def policy_label(record: dict | None) -> str:
    """A policy record in a message: ``vllm``, ``chameleon`` or ``chameleon (queues=2)``."""
    if record is None:
        return STOCK
    params = ", ".join(f"{k}={v}" for k, v in record.get("params", {}).items())
    return record["name"] + (f" ({params})" if params else "")
