"""Launch a placement on real vLLM engines and measure each one against its prediction.

Instances run one after another (on a CPU machine an engine needs every core, as a GPU would be its
own; on CUDA each gets ``CUDA_VISIBLE_DEVICES`` = its index). Each engine starts with the planned
``--max-loras``/``--max-lora-rank``/``--max-cpu-loras`` and the profile's engine settings, gets its
adapters' share of the traffic (Poisson arrivals, the planned mean lengths, exact output lengths)
for ``duration_s``, and is stopped. The same requests also go through the twin, so a difference is
the model's error, not the draw's. Measured under the twin's window convention (twin/simulate.py).
A speed probe (serving_harness/speed_probe.py) right before and after the traffic says how fast the
engine decoded against its profile: a shared or throttled machine shows up there, not as a twin error.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from planner.placement import InstancePlan, Placement
from twin.errors import BadInputError
from twin.profile import Profile
from twin.simulate import SimConfig, simulate
from twin.workload import Adapter, LengthModel, PoissonArrivals, Workload, draw_requests


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


@dataclass
class InstanceVerification:
    instance_id: str
    status: str  # ok | memory_error | bad_config | crashed | timeout
    message: str
    startup_s: float
    measured_tok_s: float | None = None
    arriving_tok_s: float | None = None
    starved: bool | None = None
    planned_tok_s: float | None = None  # the placement's prediction
    twin_tok_s: float | None = None  # the twin on the very requests sent
    itl_ms_mean: float | None = None
    ttft_ms_p99: float | None = None
    finished_requests: int | None = None
    failed_requests: int | None = None
    records: str | None = None  # parquet of the per-request rows
    probe_itl_ms: list[float | None] | None = None  # the speed probe right before and after the traffic
    speed_vs_profile: float | None = None  # real over twin probe ITL: > 1 where the engine ran slower than profiled

    @property
    def holds(self) -> bool:
        return self.status == "ok" and self.starved is False

    def error_vs(self, predicted: float | None) -> float | None:
        if predicted is None or self.measured_tok_s is None or not predicted:
            return None
        return (self.measured_tok_s - predicted) / predicted

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["holds"] = self.holds
        d["error_vs_planned"] = self.error_vs(self.planned_tok_s)
        d["error_vs_twin"] = self.error_vs(self.twin_tok_s)
        return d


def vocab_size(model_dir: str) -> int:
    config = Path(model_dir) / "config.json"
    try:
        return int(json.loads(config.read_text(encoding="utf-8"))["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadInputError(f"{config}: cannot read vocab_size of the model ({exc}); give --model a "
                            "Hugging Face model directory") from None


def instance_workload(p: Placement, inst: InstancePlan) -> Workload:
    rows = {a["adapter_id"]: a for a in p.adapters}
    return Workload(tuple(
        Adapter(aid, int(rows[aid]["rank"]), float(rows[aid]["rate_rps"]) * share,
                rows[aid]["input_tokens"], rows[aid]["output_tokens"])
        for aid, share in inst.adapters.items()
    ))


def verify_instance(p: Placement, k: int, profile: Profile, s: VerifySettings) -> InstanceVerification:
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
    )
    wl = instance_workload(p, inst)
    requests = draw_requests(wl, s.duration_s, s.seed, PoissonArrivals(), LengthModel(),
                             profile.default_input_tokens, profile.default_output_tokens)
    with Engine(config, s.work_dir / f"{inst.instance_id}.log") as engine:
        start = engine.start()
        out = InstanceVerification(inst.instance_id, start.status, start.message, start.startup_s,
                                   planned_tok_s=inst.predicted_throughput_tok_s)
        if not start.ok:
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
    out.measured_tok_s = real.total_throughput_tok_s
    out.arriving_tok_s = real.arriving_tok_s
    out.starved = real.starved
    out.twin_tok_s = twin.total_throughput_tok_s
    out.itl_ms_mean = real.itl_ms_mean
    out.ttft_ms_p99 = real.ttft_ms_p99
    out.finished_requests = real.finished_requests
    out.failed_requests = real.failed_requests
    out.records = str(path.resolve())
    out.probe_itl_ms = probes
    if None not in probes:
        out.speed_vs_profile, _ = speed_vs_profile(profile, probe.adapter_id, probe.rank, inst.a_max,
                                                   inst.max_lora_rank, probes)
    return out


def verify_placement(p: Placement, profile: Profile, s: VerifySettings,
                     progress: Callable[[str], None] | None = None) -> list[InstanceVerification]:
    missing = [aid for inst in p.instances for aid in inst.adapters if aid not in s.adapter_paths]
    if missing:
        raise BadInputError(f"no adapter directory for {', '.join(missing[:5])}: give the workload a 'path' column, "
                            "--adapter-dir, or --synthesize")
    s.work_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for k, inst in enumerate(p.instances):
        if progress:
            progress(f"{inst.instance_id} ({k + 1}/{len(p.instances)}): {len(inst.adapters)} adapters, "
                     f"--max-loras {inst.a_max}, {s.duration_s:.0f} s")
        results.append(verify_instance(p, k, profile, s))
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
