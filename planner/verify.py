"""Launch a placement on real vLLM engines and judge each one by the SLO the plan promised.

Instances run one after another (on a CPU machine an engine needs every core, as a GPU would be its
own; on CUDA each gets ``CUDA_VISIBLE_DEVICES`` = its index). Each engine starts with the planned
``--max-loras``/``--max-lora-rank``/``--max-cpu-loras`` and the profile's engine settings, gets its
adapters' share of the traffic (Poisson arrivals, the planned mean lengths, exact output lengths)
for ``duration_s``, and is stopped. The same requests also go through the twin, so a difference is
the model's error, not the draw's. Measured under the twin's window convention (twin/simulate.py).
A speed probe (serving_harness/speed_probe.py) right before and after the traffic says how fast the
engine decoded against its profile: a shared or throttled machine shows up there, not as a twin error.

The real run is judged as the twin judges a GPU (planner.verdict): the share of its arriving tokens
served, p99 TTFT over every arrival of the window and p99 TPOT over the finished requests, against the
plan's SLO with its adapters' own limits (:class:`GpuSlo`). The twin judges on a GPU slowed by the
profile's safety margin, with more traffic and bounds for the arrival seed: margins that stand in for
the real engine, which is judged against the bare SLO. A p99 is as good as the requests it is taken
over: of fewer than 100 it is their slowest. Each result is kept in the work directory
(``<instance>.verify.json``), so a run can be judged again (:func:`rejudge_placement`).

A pool plan is verified one kind at a time, on a machine of that kind (:func:`kind_part`): its instances of the
kind, as a plan of the kind's profile.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from planner.evaluate import plan_bar
from planner.packing import listed
from planner.placement import InstancePlan, Placement
from planner.verdict import ServiceBar, TwinCheck, group_limits, judging_bounds
from serving_harness.engine import check_device
from serving_harness.window import check_window
from twin.atomic import json_safe, write_json_atomic
from twin.errors import BadInputError, printable
from twin.profile import Profile
from twin.simulate import SimConfig, simulate
from twin.workload import Adapter, LengthModel, PoissonArrivals, Workload, draw_requests

#: A run judged again (--rejudge) must have sent the traffic the plan gives its GPU, to this relative tolerance
#: (what a placement's JSON keeps of a rate).
SAME_TRAFFIC = 1e-3


@dataclass(frozen=True)
class VerifySettings:
    engine: str  # cpu | cuda
    model: str  # model directory or name vLLM loads
    adapter_paths: dict[str, str]  # adapter id → directory
    duration_s: float = 120.0
    warmup_s: float = 20.0
    seed: int = 0
    kv_cache_bytes: int | None = None
    kv_bytes_per_token: int | None = None  # with kv_cache_bytes None: give each engine its planned KV tokens
    work_dir: Path = Path("verify-work")
    max_in_flight: int = 0


def _nan(x: float | None) -> float:
    return math.nan if x is None else float(x)


@dataclass(frozen=True)
class Figures:
    """A GPU's figures as the verdict judges them (planner.verdict.TwinCheck); NaN where there is none."""

    served: float  # share of the arriving tokens served in the window
    ttft_ms_p99: float  # over every arrival of the window, one without a first token counted with its wait so far
    tpot_ms_p99: float  # over the requests finished in the window
    throughput_tok_s: float
    arriving_tok_s: float

    @classmethod
    def of(cls, run) -> Figures:
        """A twin run's (twin.simulate.SimResult) or a real one's (serving_harness.loadgen.RunSummary)."""
        done, arriving = run.total_throughput_tok_s, run.arriving_tok_s
        return cls(done / arriving if arriving > 0 else 1.0, run.ttft_ms_p99_all, run.tpot_ms_p99, done, arriving)

    @classmethod
    def planned(cls, inst: InstancePlan) -> Figures:
        """The plan's: its twin verdict's figures (with the judging run's margins), else its predictor's throughput."""
        t = inst.twin or {}
        done, arriving = _nan(inst.predicted_throughput_tok_s), inst.arriving_tok_s
        return cls(t.get("served", done / arriving if arriving > 0 else 1.0), _nan(t.get("ttft_ms_p99")),
                   _nan(t.get("tpot_ms_p99")), done, arriving)

    @classmethod
    def from_dict(cls, d: dict[str, float | None]) -> Figures:
        return cls(**{k: _nan(v) for k, v in d.items()})


@dataclass(frozen=True)
class GpuSlo:
    """What a GPU must show on the real engine: the plan's SLO, its adapters' own limits included, without the
    twin's margins."""

    min_served: float
    max_ttft_ms: float | None  # None: no limit
    max_tpot_ms: float | None

    @classmethod
    def of(cls, bar: ServiceBar, inst: InstancePlan, p: Placement) -> GpuSlo:
        """``inst``'s limits as its twin verdict recorded them, else (a plan made with --no-confirm records none per
        GPU) the strictest of ``bar``'s and its adapters' own in ``p``'s adapter rows."""
        if inst.twin is not None:
            return cls(bar.min_served, inst.twin["max_ttft_ms"], inst.twin["max_tpot_ms"])
        rows = {a["adapter_id"]: a for a in p.adapters}
        own = [[rows[aid].get(k) or math.nan for aid in inst.adapters] for k in ("max_ttft_s", "max_tpot_ms")]
        ttft, tpot = group_limits(bar, np.array(own[0], float), np.array(own[1], float))
        return cls(bar.min_served, None if math.isinf(ttft) else ttft, None if math.isinf(tpot) else tpot)

    def misses(self, f: Figures) -> list[str]:
        """What ``f`` misses, in the verdict's words (TwinCheck.misses; NaN is no miss), with no judging run's
        bounds: those are the twin's room for its arrival seed."""
        def one(x: float | None) -> np.ndarray:
            return np.array([np.inf if x is None else x], float)

        ttft, tpot = one(self.max_ttft_ms), one(self.max_tpot_ms)
        check = TwinCheck(one(f.served), one(f.ttft_ms_p99), one(f.tpot_ms_p99), one(f.throughput_tok_s),
                          one(f.arriving_tok_s), one(math.nan), ttft, tpot, one(math.nan),
                          *judging_bounds(ttft, tpot, None, None))
        return check.misses(0, ServiceBar(self.min_served))


#: The rows of a verify table: name, Figures field, format, and the unit the field is divided by.
_ROWS = (("served", "served", "{:.1%}", 1.0), ("p99 TTFT", "ttft_ms_p99", "{:,.3f} s", 1000.0),
         ("p99 TPOT", "tpot_ms_p99", "{:,.1f} ms", 1.0), ("tok/s served", "throughput_tok_s", "{:,.0f}", 1.0),
         ("tok/s arriving", "arriving_tok_s", "{:,.0f}", 1.0))


def _cell(f: Figures, field: str, fmt: str, unit: float) -> str:
    x = getattr(f, field)
    return "-" if math.isnan(x) else fmt.format(x / unit)


def _limit(x: float | None, unit: float, name: str) -> str:
    return "none" if x is None else f"<= {x / unit:g} {name}"


def kind_part(p: Placement, kind: str | None) -> tuple[str | None, Placement]:
    """What verify launches of ``p``, and its kind: a pool plan's instances of ``kind`` as a plan of that kind's
    profile (:meth:`Placement.by_kind`; ``kind`` None: the one kind the plan uses), or a plan of one profile itself
    (kind None)."""
    if not p.kinds():
        if kind is not None:
            raise BadInputError(f"--kind {printable(kind)}: the plan is of one profile, not a pool plan; drop --kind")
        return None, p
    parts = {k["name"]: part for k, part in p.by_kind()}
    if kind is None:
        if len(parts) != 1:
            raise BadInputError(f"the pool plan uses kinds {', '.join(parts)}: give --kind with the kind of this "
                                "machine (one kind's instances are verified at a time)")
        kind = next(iter(parts))
    if kind not in parts:
        why = "the pool plan has no instance of that kind" if kind in p.kinds() else "not a kind of the pool plan"
        raise BadInputError(f"--kind {printable(kind)}: {why} (it uses {', '.join(parts)})")
    return kind, parts[kind]


def real_bar(p: Placement, profile: Profile) -> ServiceBar:
    """The SLO ``p`` was judged by (planner.evaluate.plan_bar), bare: on the real engine, not a slowed twin."""
    return plan_bar(p, profile).flat(1.0)


@dataclass
class InstanceVerification:
    instance_id: str
    status: str  # ok | memory_error | bad_config | crashed | timeout
    message: str
    startup_s: float
    adapters: list[str]  # what was launched: a re-judged plan must launch the same
    a_max: int
    slo: GpuSlo
    planned: Figures  # the placement's prediction
    measured: Figures | None = None
    twin: Figures | None = None  # the twin on the very requests sent, at the profile's speed
    window_s: float | None = None
    itl_ms_mean: float | None = None
    arrived_requests: int | None = None  # in the window: what the p99 TTFT is taken over
    finished_requests: int | None = None
    failed_requests: int | None = None
    records: str | None = None  # parquet of the per-request rows
    probe_itl_ms: list[float | None] | None = None  # the speed probe right before and after the traffic
    speed_vs_profile: float | None = None  # real over twin probe ITL: > 1 where the engine ran slower than profiled

    @property
    def misses(self) -> list[str]:
        """What the real run misses of the GPU's SLO (empty when it did not run)."""
        return [] if self.measured is None else self.slo.misses(self.measured)

    @property
    def holds(self) -> bool:
        return self.status == "ok" and self.measured is not None and not self.misses

    def to_dict(self) -> dict[str, Any]:
        return json_safe({**asdict(self), "holds": self.holds, "misses": self.misses})

    def table(self) -> list[str]:
        """The real run's figures beside the plan's, the twin's on the same requests and the GPU's limits."""
        limits = (f">= {self.slo.min_served:.0%}", _limit(self.slo.max_ttft_ms, 1000.0, "s"),
                  _limit(self.slo.max_tpot_ms, 1.0, "ms"), "", "")
        figures = (("measured", self.measured), ("plan", self.planned), ("twin, same requests", self.twin))
        columns = [("", *(row[0] for row in _ROWS)),
                   *((head, *(_cell(f, *row[1:]) for row in _ROWS)) for head, f in figures if f is not None),
                   ("limit", *limits)]
        widths = [max(map(len, col)) for col in columns]
        lines = ["  ".join(col[i].ljust(w) for col, w in zip(columns, widths)).rstrip() for i in range(len(_ROWS) + 1)]
        if self.arrived_requests is not None:
            few = ": of fewer than 100, nearly the slowest one's" if self.arrived_requests < 100 else ""
            lines.append(f"p99 TTFT over the {self.arrived_requests} requests arriving in the {self.window_s:g} s "
                         f"window{few}")
        if self.speed_vs_profile is not None:
            lines.append(f"decode speed (probe before and after): ITL {self.speed_vs_profile:.2f}x the profile's")
        if self.records:
            lines.append(f"records {self.records}")
        return lines

    @classmethod
    def from_dict(cls, d: dict[str, Any], slo: GpuSlo, planned: Figures) -> InstanceVerification:
        """A saved result (:meth:`to_dict`), judged by ``slo`` beside ``planned``."""
        kept = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        for name in ("measured", "twin"):
            kept[name] = None if kept.get(name) is None else Figures.from_dict(kept[name])
        return cls(**{**kept, "slo": slo, "planned": planned})


def check_engine(engine: str, profile: Profile, duration_s: float, warmup_s: float) -> None:
    """Before any engine starts: ``engine`` is the kind ``profile`` measured and this machine has, and the run leaves
    a measurement window (BadInputError)."""
    check_window(duration_s, warmup_s)
    measured = profile.engine.device
    if engine != measured:
        raise BadInputError(f"the plan's profile {profile.profile_id} measures a {measured} engine "
                            f"({profile.hardware.get('accelerator', measured)}): --engine {engine} would check the "
                            f"plan on another machine than it was made for; verify it with --engine {measured}, or "
                            "plan with a profile of this machine")
    check_device(engine)


def check_model_files(model: str, adapter_paths: dict[str, str]) -> None:
    """Before any engine starts: the model directory and every adapter directory are there (BadInputError)."""
    if not (Path(model) / "config.json").is_file():
        raise BadInputError(f"--model {model}: no config.json there; give the directory of a Hugging Face model")
    absent = [f"{aid} ({path})" for aid, path in adapter_paths.items()
              if not (Path(path) / "adapter_config.json").is_file()]
    if absent:
        raise BadInputError(f"no adapter_config.json in the directory of {len(absent)} adapter(s): {listed(absent, 3)} "
                            "(the workload's 'path' column, else --adapter-dir/<adapter_id>)")


def vocab_size(model_dir: str) -> int:
    config = Path(model_dir) / "config.json"
    try:
        return int(json.loads(config.read_text(encoding="utf-8"))["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadInputError(f"{config}: cannot read vocab_size of the model ({exc}); give --model a "
                            "Hugging Face model directory") from None


def planned_flags(engine: dict[str, Any]) -> tuple[str, ...]:
    """The plan's engine settings :class:`serving_harness.engine.EngineConfig` does not set itself (it always turns
    prefix caching off, as the twin models it), as vLLM flags."""
    flags = () if engine.get("block_size") is None else ("--block-size", str(engine["block_size"]))
    if engine.get("enable_chunked_prefill") is not None:
        flags += ("--enable-chunked-prefill" if engine["enable_chunked_prefill"] else "--no-enable-chunked-prefill",)
    return flags


def instance_workload(p: Placement, inst: InstancePlan) -> Workload:
    rows = {a["adapter_id"]: a for a in p.adapters}
    return Workload(tuple(
        Adapter(aid, int(rows[aid]["rank"]), float(rows[aid]["rate_rps"]) * share,
                rows[aid]["input_tokens"], rows[aid]["output_tokens"])
        for aid, share in inst.adapters.items()
    ))


def verify_instance(p: Placement, k: int, profile: Profile, bar: ServiceBar,
                    s: VerifySettings) -> InstanceVerification:
    """Launch instance ``k``, measure it and keep the result in ``s.work_dir`` (``<instance>.verify.json``)."""
    from serving_harness.engine import Engine, EngineConfig
    from serving_harness.loadgen import run_load, summarise
    from serving_harness.speed_probe import real_probe_itl_ms, speed_vs_profile

    inst = p.instances[k]
    eng = p.engine
    kv_bytes = s.kv_cache_bytes
    if kv_bytes is None and s.kv_bytes_per_token and inst.kv_tokens:
        kv_bytes = inst.kv_tokens * s.kv_bytes_per_token
    config = EngineConfig(
        model=s.model, adapters=tuple((aid, s.adapter_paths[aid]) for aid in inst.adapters),
        max_loras=inst.a_max, max_lora_rank=inst.max_lora_rank, max_cpu_loras=inst.max_cpu_loras,
        max_num_batched_tokens=eng["max_num_batched_tokens"], max_num_seqs=eng["max_num_seqs"],
        max_model_len=eng["max_model_len"], kv_cache_bytes=kv_bytes, device=s.engine,
        gpu=k if s.engine == "cuda" else None,
        # a CUDA engine sizes its KV cache by the planned share of memory, a CPU one by its bytes
        gpu_memory_utilization=eng.get("gpu_memory_utilization") if s.engine == "cuda" and kv_bytes is None else None,
        extra_args=planned_flags(eng),
    )
    wl = instance_workload(p, inst)
    requests = draw_requests(wl, s.duration_s, s.seed, PoissonArrivals(), LengthModel(),
                             profile.default_input_tokens, profile.default_output_tokens)
    saved = s.work_dir / f"{inst.instance_id}.verify.json"
    with Engine(config, s.work_dir / f"{inst.instance_id}.log") as engine:
        start = engine.start()
        out = InstanceVerification(inst.instance_id, start.status, start.message, start.startup_s,
                                   list(inst.adapters), inst.a_max, GpuSlo.of(bar, inst, p), Figures.planned(inst))
        if not start.ok:
            write_json_atomic(saved, out.to_dict())
            return out
        probe = wl.adapters[0]
        vocab = vocab_size(s.model)
        probe_itl = partial(real_probe_itl_ms, engine.base_url, probe.adapter_id, probe.rank, vocab)
        probe_itl()  # a fresh engine's one-off costs
        probes = [probe_itl()]
        records = run_load(engine.base_url, requests, list(inst.adapters), s.duration_s,
                           vocab_size=vocab, max_in_flight=s.max_in_flight, seed=s.seed)
        probes.append(probe_itl())
    path = s.work_dir / f"{inst.instance_id}.requests.parquet"
    records.to_parquet(path)
    real = summarise(records, s.duration_s, s.warmup_s)
    twin = simulate(wl, profile, SimConfig(a_max=inst.a_max, duration_s=s.duration_s, warmup_s=s.warmup_s,
                                           max_lora_rank=inst.max_lora_rank, max_in_flight=s.max_in_flight),
                    requests=requests)
    out.measured, out.twin, out.window_s = Figures.of(real), Figures.of(twin), real.window_s
    out.itl_ms_mean = real.itl_ms_mean
    out.arrived_requests, out.finished_requests = real.arrived_requests, real.finished_requests
    out.failed_requests = real.failed_requests
    out.records = str(path.resolve())
    out.probe_itl_ms = probes
    if None not in probes:
        out.speed_vs_profile, _ = speed_vs_profile(profile, probe.adapter_id, probe.rank, inst.a_max,
                                                   inst.max_lora_rank, probes)
    write_json_atomic(saved, out.to_dict())
    return out


def verify_placement(p: Placement, profile: Profile, s: VerifySettings,
                     progress: Callable[[str], None] | None = None) -> list[InstanceVerification]:
    """Launch and judge every instance of ``p`` in turn (module docstring)."""
    missing = [aid for inst in p.instances for aid in inst.adapters if aid not in s.adapter_paths]
    if missing:
        raise BadInputError(f"no adapter directory for {', '.join(missing[:5])}: give the workload a 'path' column, "
                            "--adapter-dir, or --synthesize")
    s.work_dir.mkdir(parents=True, exist_ok=True)
    bar = real_bar(p, profile)
    results = []
    for k, inst in enumerate(p.instances):
        if progress:
            progress(f"{inst.instance_id} ({k + 1}/{len(p.instances)}): {len(inst.adapters)} adapters, "
                     f"--max-loras {inst.a_max}, {s.duration_s:.0f} s")
        results.append(verify_instance(p, k, profile, bar, s))
    return results


def rejudge_placement(p: Placement, profile: Profile, work_dir: Path) -> list[InstanceVerification]:
    """The results an earlier run of ``p`` left in ``work_dir``, judged again by ``p``'s SLO (no engine starts)."""
    bar = real_bar(p, profile)
    results = []
    for inst in p.instances:
        saved = work_dir / f"{inst.instance_id}.verify.json"
        try:
            d = json.loads(saved.read_text(encoding="utf-8"))
            same = d["adapters"] == list(inst.adapters) and d["a_max"] == inst.a_max
            ran_at = float(d["planned"]["arriving_tok_s"])
            result = InstanceVerification.from_dict(d, GpuSlo.of(bar, inst, p), Figures.planned(inst))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BadInputError(f"{saved}: no result of an earlier verify run to judge ({exc})") from None
        if not same:
            raise BadInputError(f"{saved}: {inst.instance_id} ran other adapters or another --max-loras than the "
                                "plan gives it: verify the plan again")
        if not math.isclose(ran_at, inst.arriving_tok_s, rel_tol=SAME_TRAFFIC):
            raise BadInputError(f"{saved}: {inst.instance_id} ran {ran_at:,.0f} tok/s of traffic, the plan gives it "
                                f"{inst.arriving_tok_s:,.0f}: verify the plan again")
        results.append(result)
    return results


def synthesize_for(p: Placement, out_dir: Path, max_model_len: int) -> tuple[str, dict[str, str], int]:
    """A tiny random-weight model and one adapter per planned adapter, of its rank (CPU checks).

    Returns the model dir, adapter id → dir, and the model's KV bytes per token (bf16), so each engine
    can be given the KV capacity in tokens its plan assumes.
    """
    from serving_harness.synth import ModelShape, write_adapters, write_model

    bad = [a["adapter_id"] for a in p.adapters if "/" in a["adapter_id"] or a["adapter_id"] in (".", "..")]
    if bad:
        raise BadInputError(f"adapter id {bad[0]!r} cannot name a directory; rename it or give adapter paths")
    shape = ModelShape(max_position_embeddings=max(4096, max_model_len))
    model = write_model(out_dir / "model", shape)
    ranks = {a["adapter_id"]: int(a["rank"]) for a in p.adapters}
    paths = write_adapters(out_dir / "adapters", shape, ranks, base_model=str(model))
    return str(model), {k: str(v) for k, v in paths.items()}, shape.kv_bytes_per_token
