"""A placement as the Kubernetes objects a fleet deploys (``planner render --format k8s|llm-d|aibrix``).

* ``k8s``: per planned GPU a ``Deployment`` (one replica, one GPU, vLLM's OpenAI server with the GPU's
  engine arguments and its adapters as ``--lora-modules``) and a ``Service`` in front of it. A router
  sends each adapter's requests to the services of the plan's ``router`` map.
* ``llm-d``: the same servers, all selected by one ``InferencePool`` (``inference.networking.k8s.io/v1``,
  the Gateway API Inference Extension that llm-d routes with). Its endpoint picker sends a request for an
  adapter to a server that has it loaded, so each adapter reaches only the GPUs the plan gave it; a hot
  adapter's replicas carry equal shares in a plan, which the picker's load balancing keeps.
* ``aibrix``: the servers started without adapters but allowed to load them at run time
  (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), labelled for AIBrix, and one ``ModelAdapter``
  (``model.aibrix.ai/v1alpha1``) per adapter whose pod selector matches exactly the GPUs the plan gave it
  (AIBrix's controller reads ``matchLabels`` only, so every GPU carries its instance label and each set of
  GPUs sharing a replicated adapter one label of its own). AIBrix names the served adapter after the
  object, so adapter ids must be Kubernetes names.

In a pool plan each server's pod runs on its kind's nodes (``nodeSelector``: the kind's ``node_selector``) and
asks one of the kind's ``resource``; a plan of one profile asks one ``nvidia.com/gpu`` wherever it lands. A vllm-cpu
server (a plan or kind of a CPU profile) asks no GPU, only the resource its kind names if any, and shares its node
with no other server of the plan (a pod anti-affinity on the host): vllm-cpu takes every core it sees.

Every path a server reads lies on a volume its pod mounts read-only: the adapters on the ``lora-adapters``
claim at ``adapter_dir``, one directory per adapter id (a workload ``path`` under ``adapter_dir`` is kept; any
other, a host path, is not in the pod and becomes ``adapter_dir/<adapter_id>``, named in a comment atop the
stream), and a ``--model`` given as a path on the ``lora-models`` claim at the model's parent directory.

The objects are plain dicts in the API's field names; :func:`render_manifests` writes them as one YAML stream.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from pathlib import PurePosixPath

from planner.placement import InstancePlan, Placement
from planner.pool import pod_resource
from planner.render import adapter_paths, vllm_argv
from planner.workload_csv import printable
from twin.errors import BadInputError

FORMATS = ("k8s", "llm-d", "aibrix")
PORT = 8000
INSTANCE_LABEL = "lora-planner.io/instance"
POOL_LABEL = "lora-planner.io/pool"
#: The node label that tells one host from another (a well-known Kubernetes label).
HOST_TOPOLOGY = "kubernetes.io/hostname"
ADAPTERS_CLAIM = "lora-adapters"
MODELS_CLAIM = "lora-models"
#: An adapter URL AIBrix downloads itself (a ModelAdapter's ``artifactURL``).
REMOTE = re.compile(r"(s3|gcs|tos|huggingface|hf)://")
#: A Kubernetes object name (RFC 1123 subdomain): a ModelAdapter's.
K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
#: A DNS-1035 label, which a Service's name must be (and so each server's, and the pool's): 63 characters at most.
DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
#: The longest --name: room for "-<instance id>" after it.
MAX_PREFIX = 40


def check_prefix(prefix: str) -> None:
    """``--name``: a DNS-1035 label short enough to prefix each server's name."""
    if not DNS_LABEL.fullmatch(prefix) or len(prefix) > MAX_PREFIX:
        raise BadInputError(f"--name {prefix!r} must be a DNS-1035 label of at most {MAX_PREFIX} characters: lowercase "
                            "letters, digits and '-', starting with a letter and ending with a letter or digit")


def _name(prefix: str, instance_id: str) -> str:
    """A server's Deployment and Service name, ``PREFIX-<instance id>``, as the API server takes it (never changed:
    a name changed to fit could collide with another instance's)."""
    name = f"{prefix}-{instance_id}"
    if not DNS_LABEL.fullmatch(name):
        raise BadInputError(f"instance {instance_id!r} gives the Service name {name!r}, which is not a DNS-1035 label "
                            "(lowercase letters, digits and '-', at most 63 characters): rename the instance in the plan "
                            "or choose a shorter --name")
    return name


def _under(path: str, directory: str) -> bool:
    return PurePosixPath(posixpath.normpath(path)).is_relative_to(posixpath.normpath(directory))


def pod_adapter_paths(p: Placement, adapter_dir: str, keep_urls: bool = False) -> dict[str, str]:
    """Where a pod finds each adapter: its workload path if that lies under ``adapter_dir`` (or, with
    ``keep_urls``, is a URL AIBrix downloads), else ``adapter_dir/<adapter_id>``."""
    return {aid: path if _under(path, adapter_dir) or (keep_urls and REMOTE.match(path))
            else str(PurePosixPath(adapter_dir) / aid) for aid, path in adapter_paths(p, adapter_dir).items()}


def _volumes(model: str, adapter_dir: str) -> tuple[list[dict], list[dict]]:
    """The pod's volumes and the container's mounts: the adapters' claim at ``adapter_dir`` and, for a model
    given as a path outside it, the models' claim at the model's parent directory."""
    volumes = [{"name": "adapters", "persistentVolumeClaim": {"claimName": ADAPTERS_CLAIM, "readOnly": True}}]
    mounts = [{"name": "adapters", "mountPath": adapter_dir, "readOnly": True}]
    if model.startswith(("/", ".", "~")) or model.count("/") > 1:  # a path; else a Hugging Face id
        parent = PurePosixPath(posixpath.normpath(model)).parent
        if not model.startswith("/") or parent == PurePosixPath("/"):
            raise BadInputError(f"--model {model!r}: in a pod give a Hugging Face id (org/name) or an absolute path "
                                f"below a directory, e.g. /models/NAME, which is mounted from the '{MODELS_CLAIM}' "
                                "volume claim")
        if not _under(model, adapter_dir):
            volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": MODELS_CLAIM, "readOnly": True}})
            mounts.append({"name": "model", "mountPath": str(parent), "readOnly": True})
    return volumes, mounts


def _server(p: Placement, inst: InstancePlan, name: str, image: str, model: str, paths: dict[str, str],
            volumes: tuple[list[dict], list[dict]], labels: dict[str, str], runtime_loading: bool,
            kind: dict | None) -> list[dict]:
    """The Deployment and Service of one planned GPU, its pod's ``volumes`` as :func:`_volumes` gives them, on
    the nodes of its pool ``kind`` (None: a plan of one profile)."""
    pod_volumes, mounts = volumes
    device = p.device(inst)
    resource = pod_resource(None, device) if kind is None else kind.get("resource")
    argv = vllm_argv(p, inst, model, PORT, paths)
    if runtime_loading:  # AIBrix loads the adapters through vLLM's API
        argv = argv[:argv.index("--lora-modules")]
    container = {
        "name": "vllm", "image": image, "command": ["python3", *argv[1:3]], "args": argv[3:],
        "ports": [{"name": "http", "containerPort": PORT}],
        **({} if resource is None else {"resources": {"limits": {resource: "1"}, "requests": {resource: "1"}}}),
        "readinessProbe": {"httpGet": {"path": "/health", "port": PORT}, "periodSeconds": 10},
        "startupProbe": {"httpGet": {"path": "/health", "port": PORT}, "periodSeconds": 10, "failureThreshold": 60},
        "volumeMounts": mounts,
    }
    if runtime_loading:
        container["env"] = [{"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"}]
    selector = {INSTANCE_LABEL: inst.instance_id, POOL_LABEL: labels[POOL_LABEL]}
    pod = {"containers": [container], "volumes": pod_volumes}
    if kind is not None:
        pod["nodeSelector"] = dict(kind["node_selector"])
    if device == "cpu":  # vllm-cpu takes every core of its node, as its profile was measured: one a node
        pod["affinity"] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {POOL_LABEL: labels[POOL_LABEL]}}, "topologyKey": HOST_TOPOLOGY}]}}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": 1, "selector": {"matchLabels": selector},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
        "spec": {"selector": selector, "ports": [{"name": "http", "port": PORT, "targetPort": PORT}]},
    }
    return [deployment, service]


def manifests(p: Placement, fmt: str, image: str | dict[str, str], model: str, adapter_dir: str,
              prefix: str = "lora") -> list[dict]:
    """Every object of ``p`` in format ``fmt`` (module docstring); ``image``: every server's, or a pool plan's
    per kind name."""
    if fmt not in FORMATS:
        raise BadInputError(f"unknown manifest format '{fmt}'; choose one of {', '.join(FORMATS)}")
    check_prefix(prefix)
    if not PurePosixPath(adapter_dir).is_absolute() or len(PurePosixPath(posixpath.normpath(adapter_dir)).parts) < 2:
        raise BadInputError(f"--adapter-dir {adapter_dir!r} must be an absolute path below / inside the container (a "
                            "volume mounted at / would hide the image's own files)")
    volumes = _volumes(model, adapter_dir)
    paths = pod_adapter_paths(p, adapter_dir, keep_urls=fmt == "aibrix")
    base = re.sub(r"[^A-Za-z0-9_.-]", "-", model.rsplit("/", 1)[-1])[:63].strip("-_.") or "model"
    groups = _replica_groups(p) if fmt == "aibrix" else {}
    kinds = p.kinds()
    objects: list[dict] = []
    for inst in p.instances:
        labels = {"app.kubernetes.io/name": "vllm", "app.kubernetes.io/managed-by": "lora-planner",
                  POOL_LABEL: prefix, INSTANCE_LABEL: inst.instance_id}
        if fmt == "aibrix":
            labels.update({"model.aibrix.ai/name": base, "adapter.model.aibrix.ai/enabled": "true",
                           **{label: "true" for label, members in groups.items() if inst.instance_id in members}})
        objects += _server(p, inst, _name(prefix, inst.instance_id),
                           image if isinstance(image, str) else image[inst.kind], model, paths, volumes, labels,
                           runtime_loading=fmt == "aibrix", kind=kinds.get(inst.kind))
    if fmt == "llm-d":
        objects.append(_pool(p, prefix))
    elif fmt == "aibrix":
        objects += _model_adapters(p, base, paths, groups)
    return objects


def _pool(p: Placement, prefix: str) -> dict:
    """The InferencePool over the plan's servers (its endpoint picker, ``PREFIX-epp``, deployed as llm-d does)."""
    unequal = [a for a, routes in p.routes().items() if len({round(r["weight"], 6) for r in routes}) > 1]
    if unequal:
        raise BadInputError(f"adapter {unequal[0]} has replicas with unequal routing weights, which an "
                            "InferencePool's endpoint picker does not take; render --format k8s and route by weight")
    return {
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": prefix, "labels": {"app.kubernetes.io/managed-by": "lora-planner"}},
        "spec": {"selector": {"matchLabels": {POOL_LABEL: prefix}}, "targetPorts": [{"number": PORT}],
                 "endpointPickerRef": {"name": f"{prefix}-epp", "port": {"number": 9002}}},
    }


def _replica_groups(p: Placement) -> dict[str, frozenset[str]]:
    """A label per set of GPUs that share a replicated adapter (AIBrix selects pods by matchLabels only)."""
    sets = {frozenset(r["instance_id"] for r in routes) for routes in p.routes().values() if len(routes) > 1}
    return {f"lora-planner.io/replicas-{hashlib.sha256(','.join(sorted(s)).encode()).hexdigest()[:10]}": s
            for s in sets}


def _model_adapters(p: Placement, base: str, paths: dict[str, str], groups: dict[str, frozenset[str]]) -> list[dict]:
    by_set = {members: label for label, members in groups.items()}
    out = []
    for aid, routes in p.routes().items():
        if not routes:
            continue
        if not K8S_NAME.fullmatch(aid):
            raise BadInputError(f"adapter id {aid!r} is not a Kubernetes name, and AIBrix serves an adapter under "
                                "its ModelAdapter's name: use lowercase letters, digits, '-' and '.' for --format aibrix")
        members = frozenset(r["instance_id"] for r in routes)
        match = {INSTANCE_LABEL: next(iter(members))} if len(members) == 1 else {by_set[members]: "true"}
        out.append({"apiVersion": "model.aibrix.ai/v1alpha1", "kind": "ModelAdapter",
                    "metadata": {"name": aid, "labels": {"model.aibrix.ai/name": base,
                                                         "app.kubernetes.io/managed-by": "lora-planner"}},
                    "spec": {"baseModel": base, "podSelector": {"matchLabels": match}, "artifactURL": paths[aid]}})
    return out


def render_manifests(p: Placement, fmt: str, image: str | dict[str, str], model: str, adapter_dir: str,
                     prefix: str = "lora") -> str:
    """:func:`manifests` as one YAML stream, every object written out in full (no anchors where objects share a
    labels dict), after a comment saying how many adapters have a workload path the pods do not mount."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data) -> bool:
            return True

    objects = manifests(p, fmt, image, model, adapter_dir, prefix)
    paths = pod_adapter_paths(p, adapter_dir, keep_urls=fmt == "aibrix")
    moved = [(a["adapter_id"], a["path"]) for a in p.adapters if a.get("path") and paths[a["adapter_id"]] != a["path"]]
    note = "" if not moved else printable(
        f"# {len(moved)} adapter(s) have a workload path outside {adapter_dir} (e.g. {moved[0][0]}: {moved[0][1]}), "
        f"which the pods do not mount: each is read from {adapter_dir}/<adapter_id> on the '{ADAPTERS_CLAIM}' "
        "volume claim, so copy it there") + "\n"
    return note + yaml.dump_all(objects, Dumper=Dumper, sort_keys=False, default_flow_style=False)
