"""Measure one (hardware, model, engine) triple on real vLLM and fit a twin profile from it.

The experiments (each saved as ``<work_dir>/raw/<name>.json`` when it completes; a rerun skips
finished ones, so an interrupted profile resumes) are the smallest set that fixes every profile term:

* ``kv-a<A>-r<R>``: start-up only. T_max = ``num_gpu_blocks × block_size`` from
  ``vllm:cache_config_info`` for each (A_max, max_lora_rank) of the grid, or the start-up failure
  (memory errors are what makes a grid point infeasible). ``kv-nolora``: the same without LoRA.
* ``backbone``: B simultaneous base-model requests (short prompt, equal outputs) per batch size, once
  with short and once with long outputs; the makespan difference per extra token is the step time
  of B decodes → k4, k5.
* ``prefill``: one request at a time with prompts of P tokens (each one step: P ≤ the batched-token
  budget); TTFT's slope in P → kp. On a GPU the prompts are long (256–2048 tokens): shorter ones
  leave the step bound by reading the weights, and their slope (0.013 ms/token on an H100, 8B) is half
  what a prompt token costs in the compute-bound steps of a loaded server (0.027).
* ``lora``: the same with the B requests spread over A_B adapters (A_B ≤ A_max); the step time above
  the backbone's → the additive LoRA term l0 + l1·B + l2·A_B (k6 = 0, k7 = 100). Its batches span the
  backbone's (the CLI takes the smallest of at least 8, the middle and the largest): on an H100 a fit
  over 8–64 gave l1 < 0, a negative LoRA overhead at the 512 requests of a loaded engine. The fit keeps
  each term >= 0 (a plain fit on a noisy CPU gave l0 = -23 ms: a one-request step costing less than
  nothing).
* ``load-r<R>``: ``--max-loras 1``; single requests alternating between two adapters of rank r
  (each request swaps the GPU slot) against requests repeating one adapter: the TTFT difference is
  the slot activation (load) latency for (max_lora_rank R, adapter rank r).
* ``sched-r<R>``: ``--max-loras 1``; a few running requests of one adapter while W requests of
  another adapter wait (each step's waiting scan skips them all): ITL slope in W → k2.

With ``lean`` (for a short GPU lease) two engines do it all: ``kv-nolora``, then one LoRA engine at the largest
rank running every other experiment (:meth:`Profiler.run_lean`); the KV grid follows from the slots' bytes
(:func:`lean_kv_tokens`). A ``deadline`` stops the work before a step that would not finish in time
(:mod:`serving_harness.lease`).

Every experiment drives the server through the same load generator and streaming API as real
workloads, so the fitted step time includes the API server's and the client's share of the CPU.
Each engine first serves a few untimed requests: the first ones after start-up pay one-off costs
(on an H100 the very first burst made a batch-1 step time come out at −11 ms).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import numpy as np

from serving_harness.engine import Engine, EngineConfig, StartResult
from serving_harness.lease import Lease
from serving_harness.loadgen import RunRecords, run_load
from serving_harness.machine import machine_facts
from serving_harness.metrics import cache_config, parse_prometheus
from serving_harness.synth import ModelShape, model_shape, write_adapters
from twin.atomic import write_json_atomic
from twin.errors import BadInputError, EngineStartError
from twin.profile import SCHEMA_VERSION, profile_from_dict, write_profile
from twin.workload import Adapter, Workload, trace_requests


@dataclass(frozen=True)
class ProfileSpec:
    """What to measure: the engine settings and the experiment grid."""

    profile_id: str
    model_dir: str
    device: str = "cpu"
    gpu: int | None = None
    load_format: str = "auto"
    kv_cache_bytes: int | None = 4 << 20
    gpu_memory_utilization: float | None = None
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 2048
    lora_ranks: tuple[int, ...] = (8, 16, 32)
    a_max_points: tuple[int, ...] = (1, 8, 32)
    latency_rank: int = 16  # max_lora_rank of the latency experiments' engine
    latency_a_max: int = 8
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48)
    adapter_counts: tuple[int, ...] = (1, 2, 4, 8)
    lora_batch_sizes: tuple[int, ...] = (8, 16, 32)
    prompt_lengths: tuple[int, ...] = (16, 128, 256, 512)
    waiting_counts: tuple[int, ...] = (0, 64, 256)
    decode_tokens: int = 80
    repeats: int = 5
    default_input_tokens: float = 128.0
    default_output_tokens: float = 32.0
    #: Two engine starts instead of one per grid point (see :meth:`Profiler.run_lean`), for a short GPU lease.
    lean: bool = False

    def __post_init__(self):
        if self.latency_rank not in self.lora_ranks:
            raise BadInputError(f"latency rank {self.latency_rank} must be one of the profiled ranks {self.lora_ranks}")
        if self.lean and self.latency_rank != max(self.lora_ranks):
            raise BadInputError("a lean profile's one LoRA engine runs at the largest rank: latency rank "
                                f"{self.latency_rank} must be {max(self.lora_ranks)}")
        if max(self.adapter_counts) > self.latency_a_max:
            raise BadInputError("adapter counts of the LoRA experiment must not exceed its A_max")


#: Rough upper estimates (s) of each experiment once its engine runs, by device: a lease stops before a step
#: these say would not finish (the step's work would be lost), and resumes there next time.
EXPERIMENT_S = {
    "cpu": {"kv": 5, "backbone": 240, "prefill": 60, "lora": 300, "load": 90, "sched": 120},
    "cuda": {"kv": 5, "backbone": 90, "prefill": 30, "lora": 120, "load": 60, "sched": 60},
}
#: KV tokens one ``--max-loras`` slot costs beyond its buffers' bytes: on the H100 80GB (vLLM 0.22) a slot took
#: 4.4 % (rank 16) and 5.0 % (rank 32) more KV than its A/B buffers (datasets/measured/h100-80gb-llama-3.1-8b).
SLOT_KV_OVERHEAD = 1.05


def experiment_estimate_s(name: str, device: str) -> float:
    """What experiment ``name`` (``kv-*``, ``load-*``, ``sched-*``, ``backbone``, ...) is expected to take."""
    table = EXPERIMENT_S.get(device, EXPERIMENT_S["cuda"])
    return float(table[name.split("-")[0]])


def lean_kv_tokens(shape: ModelShape, spec: ProfileSpec, measured_tokens: int, block_size: int) -> dict[str, list[int | None]]:
    """A lean profile's KV grid from its one LoRA engine's KV (``latency_a_max`` slots of the largest rank):
    vLLM sizes the KV cache from the memory left after the slots, so each slot of rank r more (or fewer)
    moves it by that slot's bytes (times :data:`SLOT_KV_OVERHEAD`) over a token's KV bytes; with an explicit
    KV size (``--kv-cache-memory-bytes``) slots take nothing from it. A point whose KV holds no
    ``max_model_len`` sequence is a start-up failure (None), as vLLM V1 refuses it."""
    def slot(r: int) -> float:
        if spec.kv_cache_bytes:
            return 0.0
        return shape.lora_slot_bytes(r) * SLOT_KV_OVERHEAD / shape.kv_bytes_per_token

    anchor = measured_tokens + spec.latency_a_max * slot(spec.latency_rank)
    out: dict[str, list[int | None]] = {}
    for r in spec.lora_ranks:
        cells = []
        for a in spec.a_max_points:
            tokens = int((anchor - a * slot(r)) // block_size * block_size)
            cells.append(tokens if tokens >= spec.max_model_len else None)
        out[str(r)] = cells
    return out


@dataclass
class Progress:
    """Calls ``report(done, total, label)`` as experiments finish (the CLI draws a bar with it)."""

    total: int
    report: Callable[[int, int, str], None] = lambda done, total, label: None
    done: int = 0

    def step(self, label: str) -> None:
        self.done += 1
        self.report(self.done, self.total, label)


def _single_burst(names_and_lengths: list[tuple[str, int, int]], arrivals: list[float]):
    """A trace of requests (adapter name, input tokens, output tokens) at the given times."""
    names = sorted({n for n, _, _ in names_and_lengths})
    workload = Workload(tuple(Adapter(n, 1, 0.0) for n in names))
    return trace_requests(workload, arrivals, [n for n, _, _ in names_and_lengths],
                          [i for _, i, _ in names_and_lengths], [o for _, _, o in names_and_lengths]), names


def run_trace(base_url: str, items: list[tuple[str, int, int]], arrivals: list[float], vocab_size: int,
              timeout_s: float = 300.0) -> RunRecords:
    """Send a small trace and wait for every request (up to ``timeout_s``); every one must succeed."""
    requests, names = _single_burst(items, arrivals)
    window = max(arrivals) + 1e-3
    rec = run_load(base_url, requests, names, window, vocab_size=vocab_size, drain_s=timeout_s)
    if not np.all(rec.error == ""):
        raise RuntimeError(f"profiling requests failed: {sorted(set(rec.error.tolist()) - {''})}")
    return rec


def decode_itl_ms(records: RunRecords, rows: np.ndarray | None = None) -> float:
    """Mean inter-token latency (ms) over the decode of ``rows`` (all finished requests by default)."""
    ok = records.error == ""
    if rows is not None:
        ok &= rows
    if not ok.any():
        raise RuntimeError(f"no request finished: {set(records.error.tolist())}")
    gaps = (records.output_tokens[ok] - 1).sum()
    return float((records.finish_s[ok] - records.first_token_s[ok]).sum() / gaps * 1000.0)


class Profiler:
    """Runs the experiments of a :class:`ProfileSpec` under ``work_dir`` and fits the profile."""

    def __init__(self, spec: ProfileSpec, work_dir: str | os.PathLike, python: str | None = None,
                 progress: Progress | None = None, deadline: float | None = None):
        self.spec = spec
        self.work = Path(work_dir)
        self.raw = self.work / "raw"
        self.python = python
        self.shape = model_shape(spec.model_dir)
        self.progress = progress
        self.lease = Lease(self.work, spec.device, deadline)

    # ------------------------------------------------------------------------------------------
    # Engines and adapters

    def adapters(self, rank: int, count: int) -> dict[str, str]:
        """``count`` synthetic adapters of ``rank`` under the work dir (made once)."""
        names = {f"r{rank}-{i}": rank for i in range(count)}
        root = self.work / "adapters"
        missing = {n: r for n, r in names.items() if not (root / n / "adapter_config.json").is_file()}
        if missing:
            write_adapters(root, self.shape, missing, base_model=self.spec.model_dir, seed=rank * 1000)
        return {n: str(root / n) for n in names}

    def engine_config(self, a_max: int, max_lora_rank: int, adapters: dict[str, str],
                      enable_lora: bool = True) -> EngineConfig:
        s = self.spec
        return EngineConfig(
            model=s.model_dir, served_model_name="base", adapters=tuple(adapters.items()), enable_lora=enable_lora,
            max_loras=a_max, max_lora_rank=max_lora_rank, max_cpu_loras=max(a_max, len(adapters)),
            max_num_batched_tokens=s.max_num_batched_tokens, max_num_seqs=s.max_num_seqs,
            max_model_len=s.max_model_len, kv_cache_bytes=s.kv_cache_bytes,
            gpu_memory_utilization=s.gpu_memory_utilization, device=s.device, gpu=s.gpu, load_format=s.load_format,
        )

    def _engine(self, config: EngineConfig, name: str) -> Engine:
        kwargs = {"python": self.python} if self.python else {}
        return Engine(config, self.work / "logs" / f"{name}.log", **kwargs)

    def _start(self, engine: Engine, name: str, first_experiment: str) -> StartResult:
        """Start ``engine`` if the lease has time for it and its first experiment; record the start."""
        self.lease.need(self.lease.start_estimate_s() + experiment_estimate_s(first_experiment, self.spec.device),
                        f"starting engine {name}")
        started = engine.start()
        self.lease.record_start(name, started.startup_s, started.status)
        return started

    def check_resumable(self) -> None:
        """Record the settings in ``work_dir/spec.json`` (the spec less its id and model path, plus the
        model's shape); refuse to resume results measured with other ones, which would be fitted
        together. Without spec.json only KV points (``raw/kv-*.json``, e.g. copied from a run with the
        same engine settings) are taken."""
        path = self.work / "spec.json"
        mine = {k: v for k, v in json.loads(json.dumps(asdict(self.spec))).items()
                if k not in ("profile_id", "model_dir")}
        mine["model_shape"] = asdict(self.shape)
        if path.is_file():
            # a setting added since that work dir was measured reads as its default there
            defaults = {f.name: f.default for f in fields(ProfileSpec) if f.default is not MISSING and f.name in mine}
            theirs = {**json.loads(json.dumps(defaults)), **json.loads(path.read_text(encoding="utf-8"))}
            differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
            if differ:
                raise BadInputError(f"{self.work} holds measurements made with other settings ("
                                    + ", ".join(f"{k}: {theirs.get(k)} there, {mine.get(k)} now" for k in differ)
                                    + "); use another --work-dir")
        else:
            unknown = sorted(p.name for p in self.raw.glob("*.json") if not p.name.startswith("kv-"))
            if unknown:
                raise BadInputError(f"{self.raw} holds {', '.join(unknown)} but no spec.json says how they were "
                                    "measured; keep only kv-*.json there or use another --work-dir")
            write_json_atomic(path, mine)

    def _done(self, name: str) -> dict | None:
        path = self.raw / f"{name}.json"
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

    def _save(self, name: str, result: dict) -> dict:
        write_json_atomic(self.raw / f"{name}.json", result)
        if self.progress:
            self.progress.step(name)
        return result

    def _with_engine(self, name: str, config: EngineConfig, experiments: dict[str, Callable[[str], dict]]):
        """Start one engine if any of ``experiments`` (name → fn(base_url)) is unfinished; run those."""
        todo = {k: fn for k, fn in experiments.items() if self._done(k) is None}
        if not todo:
            return
        with self._engine(config, name) as engine:
            started = self._start(engine, name, next(iter(todo)))
            if not started.ok:
                raise _not_started(name, started)
            self.warm_up(engine.base_url, [n for n, _ in config.adapters])
            for key, fn in todo.items():
                self.lease.need(experiment_estimate_s(key, self.spec.device), f"experiment {key}")
                self._save(key, fn(engine.base_url))

    # ------------------------------------------------------------------------------------------
    # Experiments

    def experiment_names(self) -> list[str]:
        s = self.spec
        if s.lean:
            return ["kv-nolora", "kv-lean", "backbone", "prefill", "lora", "load-lean", f"sched-r{s.latency_rank}"]
        names = ["kv-nolora", *(f"kv-a{a}-r{r}" for r in s.lora_ranks for a in s.a_max_points)]
        names += ["backbone", "prefill", "lora"]
        names += [f"load-r{r}" for r in s.lora_ranks] + [f"sched-r{s.latency_rank}"]
        return names

    def kv_point(self, name: str, config: EngineConfig) -> dict:
        # Out of memory at a KV point with LoRA is what it measures; any other failure is not, and would fail the
        # next engine alike: it stops the profile unsaved (a rerun tries it again, as it does one saved before).
        if (done := self._done(name)) is not None and _measured(done.get("status"), config):
            return done
        with self._engine(config, name) as engine:
            started = self._start(engine, name, name)
            if not _measured(started.status, config):
                raise _not_started(name, started)
            row = {"a_max": config.max_loras, "max_lora_rank": config.max_lora_rank, "enable_lora": config.enable_lora,
                   **_start_fields(started)}
            if started.ok:
                row.update(self.kv_size(engine.base_url))
        return self._save(name, row)

    def kv_size(self, base_url: str) -> dict:
        """The running engine's KV cache: block size, blocks and tokens (``vllm:cache_config_info``)."""
        with _urlopen(f"{base_url}/metrics") as r:
            cc = cache_config(parse_prometheus(r.read().decode()))
        return {"block_size": int(cc["block_size"]), "num_gpu_blocks": int(cc["num_gpu_blocks"]),
                "kv_tokens": int(cc["num_gpu_blocks"]) * int(cc["block_size"])}

    def warm_up(self, base_url: str, adapters: list[str]) -> None:
        """Untimed requests (a burst with one request per adapter, then the longest prompt) so no
        experiment pays the engine's first-request costs or an adapter's first load from disk."""
        items = [("base", 16, self.spec.decode_tokens // 3)] * 8 + [(a, 16, 2) for a in adapters]
        run_trace(base_url, items, [0.0] * len(items), self.shape.vocab_size)
        run_trace(base_url, [("base", max(self.spec.prompt_lengths), 2)], [0.0], self.shape.vocab_size)

    def step_ms(self, base_url: str, models: list[str]) -> float:
        """Decode step time (ms) of a batch of ``len(models)`` requests: the makespan difference of two
        simultaneous bursts that differ only in output length, per extra token. Robust to the API
        server merging streamed tokens and to fixed per-request costs (HTTP, prefill)."""
        s, n = self.spec, len(models)
        short, long_ = s.decode_tokens // 3, s.decode_tokens
        spans = []
        for out in (short, long_):
            rec = run_trace(base_url, [(m, 16, out) for m in models], [0.0] * n, self.shape.vocab_size)
            spans.append(float(np.max(rec.finish_s) - np.min(rec.sent_s)))
        return (spans[1] - spans[0]) / (long_ - short) * 1000.0

    def backbone(self, base_url: str) -> dict:
        s, rows = self.spec, []
        for _ in range(max(1, s.repeats // 2)):
            for b in s.batch_sizes:
                rows.append({"batch": b, "step_ms": self.step_ms(base_url, ["base"] * b)})
        return {"rows": rows, "prompt_tokens": 16, "output_tokens": [s.decode_tokens // 3, s.decode_tokens],
                "method": "makespan difference of equal bursts with short and long outputs"}

    def prefill(self, base_url: str) -> dict:
        s, rows = self.spec, []
        for _ in range(s.repeats):
            for p in s.prompt_lengths:
                rec = run_trace(base_url, [("base", p, 2)], [0.0], self.shape.vocab_size)
                rows.append({"prompt_tokens": p, "ttft_ms": float((rec.first_token_s[0] - rec.sent_s[0]) * 1000.0)})
        return {"rows": rows}

    def lora(self, base_url: str, names: list[str]) -> dict:
        s, rows = self.spec, []
        for _ in range(max(1, s.repeats // 2)):
            for b in s.lora_batch_sizes:
                for a in s.adapter_counts:
                    step = self.step_ms(base_url, [names[i % a] for i in range(b)])
                    rows.append({"batch": b, "adapters": a, "step_ms": step})
        return {"rows": rows, "method": "as backbone, requests spread round-robin over the adapters"}

    def load(self, base_url: str, by_rank: dict[int, list[str]]) -> dict:
        """TTFT of single requests cycling over one adapter more than the engine has GPU slots (each one
        evicts the least recently used and loads its own) against requests repeating one adapter, per
        adapter rank; ``by_rank`` gives A_max + 1 adapters of each rank."""
        rows = []
        for rank, names in by_rank.items():
            cycle = len(names)
            for pattern, seq in (("same", names[:1] * 20), ("alternate", (names * (1 + 20 // cycle))[:cycle + 18])):
                ttft = []
                for name in seq:
                    rec = run_trace(base_url, [(name, 16, 2)], [0.0], self.shape.vocab_size)
                    ttft.append(float((rec.first_token_s[0] - rec.sent_s[0]) * 1000.0))
                skip = 2 if pattern == "same" else cycle  # until every slot holds an adapter of the cycle
                rows.append({"adapter_rank": rank, "pattern": pattern, "ttft_ms": ttft[skip:]})
        return {"rows": rows}

    def sched(self, base_url: str, slots: list[str], y: str) -> dict:
        """ITL of running requests that hold every GPU slot (one adapter of ``slots`` each, at least 4
        requests) while W requests of ``y`` wait for a slot."""
        s, rows = self.spec, []
        running_items = [(slots[i % len(slots)], 16, 64) for i in range(max(4, len(slots)))]
        for _ in range(max(1, s.repeats // 2)):
            for w in s.waiting_counts:
                items = running_items + [(y, 16, 1)] * w
                arrivals = [0.0] * len(running_items) + [0.3] * w
                rec = run_trace(base_url, items, arrivals, self.shape.vocab_size)
                running = np.asarray(rec.adapter != y)
                rows.append({"waiting": w, "itl_ms": decode_itl_ms(rec, running)})
        return {"rows": rows}

    def run(self) -> dict[str, dict]:
        """Run every unfinished experiment; return name → raw result."""
        s = self.spec
        self.raw.mkdir(parents=True, exist_ok=True)
        self.check_resumable()
        self.kv_point("kv-nolora", self.engine_config(1, s.latency_rank, {}, enable_lora=False))
        if s.lean:
            self.run_lean()
            return {name: self._done(name) for name in self.experiment_names()}
        for r in s.lora_ranks:
            for a in s.a_max_points:
                self.kv_point(f"kv-a{a}-r{r}", self.engine_config(a, r, self.adapters(r, 1)))
        lat_adapters = self.adapters(s.latency_rank, max(s.adapter_counts))
        lat_names = list(lat_adapters)
        self._with_engine("latency", self.engine_config(s.latency_a_max, s.latency_rank, lat_adapters), {
            "backbone": self.backbone, "prefill": self.prefill, "lora": lambda url: self.lora(url, lat_names)})
        for r in s.lora_ranks:
            pairs = {ar: list(self.adapters(ar, 2)) for ar in s.lora_ranks if ar <= r}
            adapters = {n: p for ar in pairs for n, p in self.adapters(ar, 2).items()}
            experiments = {f"load-r{r}": lambda url, pairs=pairs: self.load(url, pairs)}
            if r == s.latency_rank:
                x, y = pairs[r]
                experiments[f"sched-r{r}"] = lambda url, x=x, y=y: self.sched(url, [x], y)
            self._with_engine(f"slot1-r{r}", self.engine_config(1, r, adapters), experiments)
        return {name: self._done(name) for name in self.experiment_names()}

    def run_lean(self) -> None:
        """Every LoRA experiment on one engine (``latency_a_max`` slots of the largest rank R): its KV size
        (``kv-lean``; the rest of the grid follows from the slots' bytes, see :func:`lean_kv_tokens`), the
        latency experiments, loads by cycling A_max + 1 adapters of each rank (taken for every
        max_lora_rank: the study's table has a larger slot rank costing 0–1.5 ms more per load, so this
        errs slow) and the scheduler's cost of requests waiting for a slot."""
        s = self.spec
        a, top = s.latency_a_max, s.latency_rank
        lat_names = list(self.adapters(top, max(s.adapter_counts)))
        cycles = {r: self.adapters(r, a + 1) for r in s.lora_ranks}
        adapters = {n: p for c in cycles.values() for n, p in c.items()}
        names = {r: list(c) for r, c in cycles.items()}
        self._with_engine("lean", self.engine_config(a, top, adapters), {
            "backbone": self.backbone, "kv-lean": self.kv_size, "prefill": self.prefill,
            "lora": lambda url: self.lora(url, lat_names), "load-lean": lambda url: self.load(url, names),
            f"sched-r{top}": lambda url: self.sched(url, names[top][:a], names[top][a])})


def _measured(status: str | None, config: EngineConfig) -> bool:
    return status == "ok" or (status == "memory_error" and config.enable_lora)


def _not_started(name: str, started: StartResult) -> EngineStartError:
    return EngineStartError(f"engine {name} did not start ({started.status}): {started.message} (log: "
                            f"{started.log_path}); what was measured is kept: fix that, then rerun the same command")


def _start_fields(started: StartResult) -> dict:
    return {"status": started.status, "message": started.message, "startup_s": round(started.startup_s, 2)}


def _urlopen(url: str):
    import urllib.request

    return urllib.request.urlopen(url, timeout=10)


# ----------------------------------------------------------------------------------------------
# Fitting


def _ols(columns: list[np.ndarray], y: np.ndarray) -> np.ndarray:
    x = np.column_stack(columns)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return coef


def _nonnegative_ols(columns: list[np.ndarray], y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (each is a cost), exactly: the best least-squares fit over
    the subsets of columns whose own fit is non-negative (a handful of columns: every subset is tried)."""
    best, best_sse = np.zeros(len(columns)), float(y @ y)
    for mask in range(1, 2 ** len(columns)):
        keep = [j for j in range(len(columns)) if mask >> j & 1]
        coef = _ols([columns[j] for j in keep], y)
        if (coef >= 0).all():
            full = np.zeros(len(columns))
            full[keep] = coef
            sse = float(((np.column_stack(columns) @ full - y) ** 2).sum())
            if sse < best_sse:
                best, best_sse = full, sse
    return best


def _kv_grid(spec: ProfileSpec, raw: dict[str, dict]) -> tuple[dict, dict, int]:
    """(tokens by rank over the A_max points, start-up failures by rank, block size) from the KV experiments:
    measured at every point, or, lean, derived from the one LoRA engine's (:func:`lean_kv_tokens`)."""
    if spec.lean:
        lean = raw["kv-lean"]
        tokens = lean_kv_tokens(model_shape(spec.model_dir), spec, lean["kv_tokens"], lean["block_size"])
        failures = {r: "KV below one max_model_len sequence (derived from slot bytes) at A_max "
                       + ", ".join(str(a) for a, t in zip(spec.a_max_points, cells) if t is None)
                    for r, cells in tokens.items() if None in cells}
        return tokens, failures, lean["block_size"]
    kv_rows = {name: raw[name] for name in raw if name.startswith("kv-a")}
    tokens, failures = {}, {}
    for r in spec.lora_ranks:
        cells = [kv_rows[f"kv-a{a}-r{r}"] for a in spec.a_max_points]
        tokens[str(r)] = [c.get("kv_tokens") if c["status"] == "ok" else None for c in cells]
        failed = [f"A_max {c['a_max']}: {c['status']}: {c['message']}" for c in cells if c["status"] != "ok"]
        if failed:
            failures[str(r)] = "; ".join(failed)
    return tokens, failures, next(c["block_size"] for c in kv_rows.values() if c["status"] == "ok")


def fit_profile(spec: ProfileSpec, raw: dict[str, dict], provenance: dict, description: str = "") -> dict:
    """The profile JSON (twin/profile.py schema) fitted from the raw experiment results."""
    bb = raw["backbone"]["rows"]
    b = np.array([r["batch"] for r in bb], float)
    k4, k5 = _ols([b, np.ones_like(b)], np.array([r["step_ms"] for r in bb]))
    pf = raw["prefill"]["rows"]
    kp = float(np.polyfit([r["prompt_tokens"] for r in pf], [r["ttft_ms"] for r in pf], 1)[0])
    sched_rows = raw[f"sched-r{spec.latency_rank}"]["rows"]
    k2_ms = float(np.polyfit([r["waiting"] for r in sched_rows], [r["itl_ms"] for r in sched_rows], 1)[0])
    # A cost cannot be negative: a negative fit is measurement noise, clipped at 0 and reported.
    fitted = {"k4_ms_per_request": float(k4), "k5_ms": float(k5), "kp_ms_per_prompt_token": kp,
              "k2_us_per_waiting": k2_ms * 1000.0}
    warnings = [f"{term} fitted as {value:.4g}, clipped to 0 (measurement noise: a quieter machine or more "
                "measurement points give a firmer fit)" for term, value in fitted.items() if value < 0]
    costs = {term: max(0.0, value) for term, value in fitted.items()}
    lr = raw["lora"]["rows"]
    lb = np.array([r["batch"] for r in lr], float)
    la = np.array([r["adapters"] for r in lr], float)
    # Above the backbone the profile keeps (clipped), so backbone + LoRA terms give the measured step.
    resid = np.array([r["step_ms"] for r in lr]) - (costs["k5_ms"] + costs["k4_ms_per_request"] * lb)
    lora_columns = [np.ones_like(lb), lb, la]
    l0, l1, l2 = _nonnegative_ols(lora_columns, resid)
    if (_ols(lora_columns, resid) < 0).any():
        warnings.append("l0..l2: the plain fit had a negative term (measurement noise); refitted with every "
                        "term >= 0, so no step costs less than the backbone's")

    tokens, failures, block_size = _kv_grid(spec, raw)
    load: dict[str, dict[str, float]] = {}
    for r in spec.lora_ranks:
        by_adapter: dict[str, float] = {}
        rows = raw["load-lean" if spec.lean else f"load-r{r}"]["rows"]
        for ar in sorted({row["adapter_rank"] for row in rows if row["adapter_rank"] <= r}):
            med = {row["pattern"]: float(np.median(row["ttft_ms"])) for row in rows if row["adapter_rank"] == ar}
            # Clipped at 1 µs: a swap cheaper than the TTFT noise is still a (tiny) positive cost.
            by_adapter[str(ar)] = max(1e-3, med["alternate"] - med["same"])
        load[str(r)] = by_adapter

    profile = {
        "schema_version": SCHEMA_VERSION, "profile_id": spec.profile_id,
        "description": description,
        "hardware": provenance["machine"], "model": {"path": spec.model_dir, **asdict(model_shape(spec.model_dir))},
        "engine": {
            "version": provenance["vllm_version"], "block_size": block_size,
            "max_num_batched_tokens": spec.max_num_batched_tokens, "max_num_seqs": spec.max_num_seqs,
            "max_model_len": spec.max_model_len, "chunked_prefill": True, "prefix_caching": False,
            "kv_cache_bytes": spec.kv_cache_bytes, "device": spec.device,
            **({"gpu_memory_utilization": spec.gpu_memory_utilization} if spec.gpu_memory_utilization else {}),
        },
        "kv_capacity": {"no_lora_tokens": raw["kv-nolora"]["kv_tokens"], "a_max_points": list(spec.a_max_points),
                        "tokens": tokens, "failures": failures},
        "step_latency_ms": {
            "k4_ms_per_request": costs["k4_ms_per_request"], "k5_ms": costs["k5_ms"],
            "kp_ms_per_prompt_token": costs["kp_ms_per_prompt_token"], "k6_pct_per_adapter": 0.0, "k7_pct": 100.0,
            "l0_ms": float(l0), "l1_ms_per_request": float(l1), "l2_ms_per_adapter": float(l2),
            "source": "k4,k5: OLS of the decode step time on batch size (backbone); kp: TTFT slope in prompt "
                      "tokens (prefill); l0..l2: least squares, each >= 0, of the step time above the backbone "
                      "on (batch, distinct adapters) (lora)",
        },
        "scheduler_overhead_us": {
            "k1_us_per_running": 0.0, "k2_us_per_waiting": costs["k2_us_per_waiting"],
            "k3_us_per_waiting_x_amax_over_a": 0.0, "intercept_us": 0.0,
            "source": f"k2: ITL slope in LoRA-blocked waiting requests (sched-r{spec.latency_rank}); "
                      "k1 is inside k4 (the backbone ITL includes the scheduler's per-running-request cost)",
        },
        "adapter_load_ms": {"by_max_lora_rank": load,
                            "source": ("median TTFT of requests cycling over A_max+1 adapters minus repeated ones, on "
                                       f"the lean engine (max_lora_rank {spec.latency_rank}), for every max_lora_rank"
                                       if spec.lean else
                                       "median TTFT of alternating minus repeated adapters with --max-loras 1")},
        "defaults": {"input_tokens": spec.default_input_tokens, "output_tokens": spec.default_output_tokens},
        "provenance": {**provenance, **({"fit_warnings": warnings} if warnings else {})},
    }
    profile_from_dict(profile, where=f"fitted profile {spec.profile_id}")  # validates
    return profile


def vllm_version(python: str | None) -> str:
    import subprocess
    import sys

    out = subprocess.run([python or sys.executable, "-c", "import vllm; print(vllm.__version__)"],
                         capture_output=True, text=True, timeout=120, check=False)
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else "unknown"


#: Seed of the calibration workloads (``planner validate`` defaults to another one: held-apart sets).
CALIBRATION_SEED = 7


def calibrate_fitted(profile: dict, spec: ProfileSpec, work_dir: Path, cases: int, duration_s: float,
                     warmup_s: float, python: str | None, progress: Progress | None,
                     deadline: float | None = None) -> dict:
    """Run ``cases`` calibration workloads and fit the step latency to them (see calibration.py)."""
    from serving_harness.calibration import calibrated_profile, recorded_run
    from serving_harness.validation import Validator

    micro = profile_from_dict(profile, where=f"fitted profile {spec.profile_id}")
    report = (lambda done, total, label: progress.step(f"calibration {label}")) if progress else None
    validator = Validator(micro, spec.model_dir, work_dir / "calibration", duration_s, warmup_s, python,
                          **({"report_progress": report} if report else {}), probe=False, deadline=deadline)
    workloads = validator.workload_set(cases, CALIBRATION_SEED)
    runs = [recorded_run(validator.work_dir, row, duration_s, warmup_s) for row in validator.run(workloads)]
    return calibrated_profile(profile, runs, duration_s, warmup_s,
                              {"seed": CALIBRATION_SEED, "runs": str(work_dir / "calibration")})


KV_NOTES = {
    "explicit": "The KV cache has an explicit size (--kv-cache-memory-bytes): LoRA slots do not take from it, "
                "so T_max does not depend on A_max x max_lora_rank (measured per grid point).",
    "sized": "vLLM sizes the KV cache from the memory left after weights, activations, CUDA graphs and the "
             "LoRA slots (A_max x max_lora_rank), so T_max falls with both (measured per grid point).",
}


def profile_engine(spec: ProfileSpec, work_dir: str | os.PathLike, out: str | os.PathLike, command: str,
                   python: str | None = None, progress: Progress | None = None, calibration_cases: int = 10,
                   duration_s: float = 30.0, warmup_s: float = 5.0, deadline: float | None = None) -> dict:
    """Run (or resume) the experiments, fit, calibrate, and write the profile JSON to ``out``; stop
    (OutOfTimeError) before a step that would not finish by ``deadline`` (epoch seconds)."""
    profiler = Profiler(spec, work_dir, python, progress, deadline)
    raw = profiler.run()
    version = vllm_version(python)
    provenance = {
        "kind": "measured", "machine": machine_facts(spec.device, spec.gpu), "vllm_version": version,
        "date": time.strftime("%Y-%m-%d"), "command": command, "raw_measurements": str(Path(work_dir) / "raw"),
        "spec": asdict(spec),
        "notes": KV_NOTES["explicit" if spec.kv_cache_bytes else "sized"],
    }
    where = provenance["machine"]["cpu"] if spec.device == "cpu" else provenance["machine"]["accelerator"]
    description = f"{Path(spec.model_dir).name} on {spec.device} ({where}), vLLM {version}"
    profile = fit_profile(spec, raw, provenance, description)
    if calibration_cases:
        profile = calibrate_fitted(profile, spec, Path(work_dir), calibration_cases, duration_s, warmup_s, python,
                                   progress, deadline)
    write_profile(out, profile)
    return profile
