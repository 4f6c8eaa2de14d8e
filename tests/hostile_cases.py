"""Hostile and careless inputs to the planner's commands, as reproducible cases.

Each :class:`Case` writes its files into a directory and names the command line to run there; every one
must end with exit code 2, one line of error and no traceback, and write nothing. ``tests/test_hostile_inputs.py``
runs them in-process; ``python -m benchmarks.placement.hostile_inputs`` runs them as real processes.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

GOOD_CSV = "adapter_id,rank,rate_rps\n" + "".join(f"a{i},{8 if i % 2 else 16},{0.2 + 0.05 * (i % 4)}\n"
                                                  for i in range(12))
PROFILE = "h100-64gb-llama-3.1-8b"


@dataclass(frozen=True)
class Case:
    name: str
    files: Callable[[Path], None]  # writes the case's inputs into a directory
    argv: tuple[str, ...]  # the planner command, run in that directory
    out: str | None = None  # a file the command must not create or change


def _csv(text: str | bytes) -> Callable[[Path], None]:
    def write(d: Path) -> None:
        (d / "w.csv").write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
        (d / "good.csv").write_text(GOOD_CSV)

    return write


def _row(adapter_id="x", rank="8", rate="0.5", extra: dict[str, str] | None = None) -> str:
    cols = {"adapter_id": adapter_id, "rank": rank, "rate_rps": rate, **(extra or {})}
    header = ",".join(cols)
    return f"{header}\n{','.join(cols.values())}\n" + "".join(
        f"{','.join(['ok' + str(i), '8', '0.5', *(['' for _ in range(len(cols) - 3)])])}\n" for i in range(3))


#: Workload files that are bad input, by what is wrong with them.
BAD_WORKLOADS: dict[str, str | bytes] = {
    "id-newline": 'adapter_id,rank,rate_rps\n"a\nb",8,0.5\n',
    "id-carriage-return": 'adapter_id,rank,rate_rps\n"a\rb",8,0.5\n',
    "id-tab": _row("a\tb"),
    "id-escape": _row("a\x1b[31mred"),
    "id-leading-dash": _row("-rf"),
    "id-option": _row("--model=/etc/passwd"),
    "id-dotdot": _row("../../etc/passwd"),
    "id-inner-dotdot": _row("a/../../b"),
    "id-dot": _row("."),
    "id-double-slash": _row("a//b"),
    "id-trailing-slash": _row("a/"),
    "id-absolute": _row("/etc/passwd"),
    "id-space": _row("a b"),
    "id-quote": _row("a'b"),
    "id-dollar": _row("$(touch pwned)"),
    "id-backtick": _row("`touch pwned`"),
    "id-semicolon": _row("a;rm -rf /"),
    "id-non-ascii": _row("adaptér"),
    "id-emoji": _row("a\U0001f600"),
    "id-too-long": _row("x" * 300),
    "id-empty": _row(""),
    "id-nul": b"adapter_id,rank,rate_rps\na\x00b,8,0.5\n",
    "rate-underscore": _row(rate="0_1"),
    "rank-underscore": _row(rank="1_6"),
    "rank-arabic-indic": _row(rank="\u0668"),
    "rank-fraction": _row(rank="8.0"),
    "rank-zero": _row(rank="0"),
    "rank-huge": _row(rank="4096"),
    "rank-unservable": _row(rank="64"),
    "rate-nan": _row(rate="nan"),
    "rate-inf": _row(rate="inf"),
    "rate-negative": _row(rate="-0.5"),
    "rate-hex": _row(rate="0x10"),
    "rate-huge": _row(rate="1e6"),
    "rate-overflow": _row(rate="1e400"),
    "rate-word": _row(rate="fast"),
    "rate-fullwidth": _row(rate="\uff11"),
    "tokens-huge": _row(extra={"input_tokens": "1e308", "output_tokens": "100"}),
    "tokens-zero": _row(extra={"input_tokens": "0", "output_tokens": "100"}),
    "tokens-over-context": _row(extra={"input_tokens": "130000", "output_tokens": "5000"}),
    "ttft-zero": _row(extra={"max_ttft_s": "0"}),
    "ttft-negative": _row(extra={"max_ttft_s": "-1"}),
    "tpot-huge": _row(extra={"max_tpot_ms": "1e9"}),
    "path-newline": 'adapter_id,rank,rate_rps,path\nx,8,0.5,"/m/x\ntouch pwned"\n',
    "cr-only-lines": "adapter_id,rank,rate_rps\rx,8,0.5\ry,8,0.5\r",
    "stray-cr": "adapter_id,rank,rate_rps\nx\r,8,0.5\n",
    "field-too-long": "adapter_id,rank,rate_rps\n" + "y" * 200_000 + ",8,0.5\n",
    "unclosed-quote": 'adapter_id,rank,rate_rps\n"x,8,0.5\n',
    "utf16": "adapter_id,rank,rate_rps\nx,8,0.5\n".encode("utf-16"),
    "latin1": "adapter_id,rank,rate_rps\nx\xe9,8,0.5\n".encode("latin-1"),
    "empty": "",
    "header-only": "adapter_id,rank,rate_rps\n",
    "missing-column": "adapter_id,rate_rps\nx,0.5\n",
    "extra-column": "adapter_id,rank,rate_rps,colour\nx,8,0.5,red\n",
    "duplicate-column": "adapter_id,rank,rate_rps,rank\nx,8,0.5,8\n",
    "semicolons": "adapter_id;rank;rate_rps\nx;8;0.5\n",
    "ragged": "adapter_id,rank,rate_rps\nx,8\n",
    "decimal-comma": "adapter_id,rank,rate_rps\nx,8,0,5\n",
    "duplicate-id": "adapter_id,rank,rate_rps\nx,8,0.5\nx,8,0.5\n",
    "all-zero-rates": "adapter_id,rank,rate_rps\nx,8,0\ny,16,0\n",
}


def _placement(mutate: Callable[[dict], None] | str) -> Callable[[Path], None]:
    """A good plan of GOOD_CSV (``base.json``, made by the caller) changed by ``mutate``, as plan.json."""
    def write(d: Path) -> None:
        (d / "good.csv").write_text(GOOD_CSV)
        if isinstance(mutate, str):
            (d / "plan.json").write_text(mutate)
            return
        doc = json.loads((d / "base.json").read_text())
        mutate(doc)
        (d / "plan.json").write_text(json.dumps(doc))

    return write


def _set(path: str, value) -> Callable[[dict], None]:
    def mutate(doc: dict) -> None:
        node = doc
        keys = path.split(".")
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        last = keys[-1]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


def _drop(path: str) -> Callable[[dict], None]:
    def mutate(doc: dict) -> None:
        *keys, last = path.split(".")
        node = doc
        for k in keys:
            node = node[k]
        del node[last]

    return mutate


def _duplicate_instance(doc: dict) -> None:
    doc["instances"].append(dict(doc["instances"][0]))


def _two_gpus(doc: dict) -> None:
    """The plan's adapters split over two GPUs, ``gpu-0`` and ``gpu-1``."""
    first = doc["instances"][0]
    half = len(first["adapters"]) // 2
    doc["instances"] = [{**first, "adapters": first["adapters"][:half]},
                        {**first, "instance_id": "gpu-1", "adapters": first["adapters"][half:]}]


#: A command a plan's text would run if a launch script carried it unescaped.
PWN = "\ntouch ./pwned_by_plan #"


#: Placement files that are bad input.
BAD_PLACEMENTS: dict[str, Callable[[dict], None] | str] = {
    "truncated": '{"schema_version": 1, "inputs": {',
    "not-json": "plan: yes\n",
    "deeply-nested": "[" * 100_000 + "]" * 100_000,
    "a-list": "[1, 2, 3]",
    "schema-99": '{"schema_version": 99}',
    "inputs-list": _set("inputs", [1, 2]),
    "instances-dict": _set("instances", {"gpu-0": 1}),
    "a-max-zero": _set("instances.0.a_max", 0),
    "a-max-negative": _set("instances.0.a_max", -5),
    "a-max-huge": _set("instances.0.a_max", 10**9),
    "a-max-fraction": _set("instances.0.a_max", 8.7),
    "rank-zero": _set("instances.0.max_lora_rank", 0),
    "rank-4096": _set("instances.0.max_lora_rank", 4096),
    "share-nan": lambda doc: doc["instances"][0]["adapters"][0].update(share=float("nan")),
    "share-negative": lambda doc: doc["instances"][0]["adapters"][0].update(share=-1),
    "share-five": lambda doc: doc["instances"][0]["adapters"][0].update(share=5),
    "kv-tokens-word": _set("instances.0.kv_tokens", "lots"),
    "instance-id-newline": _set("instances.0.instance_id", "gpu-0\ntouch pwned"),
    "instance-id-option": _set("instances.0.instance_id", "--rm"),
    "duplicate-instance": _duplicate_instance,
    "unknown-adapter": lambda doc: doc["instances"][0]["adapters"][0].update(adapter_id="ghost"),
    "adapter-id-dotdot": lambda doc: doc["adapters"][0].update(adapter_id="../../etc/passwd"),
    "adapter-path-newline": lambda doc: doc["adapters"][0].update(path="/m\ntouch pwned"),
    "confirmation-junk": _set("inputs.confirmation", "yes"),
    "min-served-low": _set("inputs.confirmation.min_served", 0.1),
    "max-ttft-negative": _set("inputs.confirmation.max_ttft_s", -1),
    "slowdown-huge": _set("inputs.confirmation.slowdown", 1e9),
    "few-adapters-junk": _set("inputs.confirmation.few_adapters", {"adapters": 64, "slowdown": 1.1, "rm": "-rf"}),
    "few-adapters-word": _set("inputs.confirmation.few_adapters", {"adapters": "many", "slowdown": 1.1}),
    "few-adapters-faster": _set("inputs.confirmation.few_adapters", {"adapters": 64, "slowdown": 0.5}),
    "profile-id-path": _set("inputs.profile_id", "../../../etc/passwd"),
    "rate-nan": lambda doc: doc["adapters"][0].update(rate_rps=float("nan")),
    "rank-string": lambda doc: doc["adapters"][0].update(rank="eight"),
    "policy-no-name": _set("inputs.policy", {"params": {}}),
    "policy-name-command": _set("inputs.policy", {"name": "chameleon" + PWN, "params": {}}),
    "policy-stock-with-params": _set("inputs.policy", {"name": "vllm", "params": {"queues": 2}}),
    "policy-param-command": _set("inputs.policy", {"name": "chameleon", "params": {"queues" + PWN: 2}}),
    "policy-param-word": _set("inputs.policy", {"name": "chameleon", "params": {"queues": "two"}}),
    "policy-param-zero": _set("inputs.policy", {"name": "chameleon", "params": {"queues": 0}}),
    "policy-param-value-command": _set("inputs.policy", {"name": "chameleon", "params": {"scheduler": "fifo" + PWN}}),
    "policy-list": _set("inputs.policy", ["chameleon"]),
    "predictor-missing": _drop("inputs.predictor"),
    "predictor-kind-missing": _drop("inputs.predictor.kind"),
    "lengths-own-missing": _drop("inputs.lengths.adapters_with_own_lengths"),
    "lengths-word": _set("inputs.lengths.mean_input_tokens", "long"),
    "margin-word": lambda doc: doc["inputs"]["confirmation"].update(repacked_gpus=2, margin="wide"),
    "engine-trust-remote-code": _set("engine.trust_remote_code", True),
    "engine-no-lora": _set("engine.enable_lora", False),
    "engine-max-loras": _set("engine.max_loras", 100_000),
    "engine-second-model": _set("engine.model", "evil/model"),
    "engine-empty": _set("engine", {}),
    "engine-string": _set("engine", "--trust-remote-code"),
    "engine-len-word": _set("engine.max_model_len", "big"),
    "engine-len-option": _set("engine.max_model_len", "8192 --trust-remote-code"),
    "engine-utilization-five": _set("engine.gpu_memory_utilization", 5),
    "engine-device-tpu": _set("engine.device", "tpu"),
    "engine-device-option": _set("engine.device", "cpu --trust-remote-code"),
    "engine-cpu-with-utilization": _set("engine.device", "cpu"),  # a CPU engine with a share of GPU memory
    "engine-cuda-kv-bytes": _set("engine.kv_cache_memory_bytes", 1 << 22),
    "engine-kv-bytes-option": lambda doc: doc["engine"].update(device="cpu", gpu_memory_utilization=None,
                                                               kv_cache_memory_bytes="4194304 --trust-remote-code"),
    "engine-prefix-caching-word": _set("engine.enable_prefix_caching", "sometimes"),
    "changes-instance-no-id": _set("changes", {"instances": [{"restart_because": ["x"]}]}),
    "changes-move-no-reason": _set("changes", {"moves": [{"adapter_id": "a0"}]}),
    "changes-reasons-word": _set("changes", {"instances": [{"instance_id": "gpu-0", "restart_because": "x"}]}),
}

MODEL = ("--model", "org/model")


def cases() -> list[Case]:
    """Every case: each bad workload for plan, simulate, evaluate and replan; each bad placement for
    evaluate, replan, render (vllm and k8s) and verify; unwritable outputs; an empty plan for verify; object
    names the Kubernetes API refuses; ports past 65535."""
    out: list[Case] = []
    for name, text in BAD_WORKLOADS.items():
        write = _csv(text)
        out += [
            Case(f"plan/{name}", write, ("plan", "w.csv", "--out", "new.json"), "new.json"),
            Case(f"simulate/{name}", write, ("simulate", "w.csv", "--a-max", "4", "--duration", "60")),
            Case(f"evaluate/{name}", _with_base(write), ("evaluate", "base.json", "w.csv")),
            Case(f"replan/{name}", _with_base(write), ("replan", "w.csv", "--previous", "base.json", "--out",
                                                        "new.json"), "new.json"),
        ]
    for name, mutate in BAD_PLACEMENTS.items():
        write = _with_base(_placement(mutate))
        out += [
            Case(f"evaluate-plan/{name}", write, ("evaluate", "plan.json", "good.csv")),
            Case(f"replan-plan/{name}", write, ("replan", "good.csv", "--previous", "plan.json", "--out", "new.json"),
                 "new.json"),
            Case(f"render/{name}", write, ("render", "plan.json", "--format", "vllm", *MODEL)),
            Case(f"render-k8s/{name}", write, ("render", "plan.json", "--format", "k8s", *MODEL)),
            Case(f"verify/{name}", write, ("verify", "plan.json", "--engine", "cpu", "--synthesize",
                                           "--work-dir", "vw"), "vw"),
        ]
    for target in ("missing/plan.json", "good.csv/plan.json", "."):
        out.append(Case(f"plan-out/{target}", _csv(GOOD_CSV), ("plan", "good.csv", "--out", target)))
        out.append(Case(f"replan-out/{target}", _with_base(_csv(GOOD_CSV)),
                        ("replan", "good.csv", "--previous", "base.json", "--out", target)))
    out.append(Case("verify/empty-plan", _with_base(_placement(lambda doc: doc.update(instances=[]))),
                    ("verify", "plan.json", "--engine", "cpu", "--synthesize", "--work-dir", "vw"), "vw"))
    for name in ("9x", "a.b", "A", "a-", "x" * 41):  # Service names are DNS-1035 labels
        out.append(Case(f"render-name/{name[:8]}", _with_base(_csv(GOOD_CSV)),
                        ("render", "base.json", "--format", "llm-d", *MODEL, "--name", name)))
    out.append(Case("plan-name/9x", _csv(GOOD_CSV), ("plan", "good.csv", "--no-confirm", "--format", "k8s", *MODEL,
                                                     "--name", "9x", "--out", "new.json"), "new.json"))
    for iid in ("gpu.0", "GPU-0", "gpu_0", "g" * 60):
        out.append(Case(f"render-instance/{iid[:8]}", _with_base(_placement(_set("instances.0.instance_id", iid))),
                        ("render", "plan.json", "--format", "k8s", *MODEL)))
    out.append(Case("render-port/past-65535", _with_base(_placement(_two_gpus)),
                    ("render", "plan.json", "--format", "vllm", *MODEL, "--port-base", "65535")))
    return out + reader_cases()


def _with_base(write: Callable[[Path], None]) -> Callable[[Path], None]:
    """``write`` after a good plan of GOOD_CSV is put in the directory as base.json (made once, copied)."""
    def both(d: Path) -> None:
        (d / "base.json").write_text(base_plan())
        write(d)

    return both


_BASE: list[str] = []


def base_plan() -> str:
    """A good placement of GOOD_CSV (planned once per process)."""
    if not _BASE:
        import tempfile

        from click.testing import CliRunner

        from planner.cli import main

        with tempfile.TemporaryDirectory() as tmp:
            csv = Path(tmp) / "good.csv"
            csv.write_text(GOOD_CSV)
            res = CliRunner().invoke(main, ["plan", str(csv), "--json", "--profile", PROFILE, "--jobs", "1"])
            assert res.exit_code == 0, res.output
            _BASE.append(res.stdout)
    return _BASE[0]


RANKS = "adapter_id,rank\na,8\n"
LOG_LINE = '{"timestamp": %s, "model": "%s", "prompt_tokens": 100, "completion_tokens": 20}\n'


def _files(**contents: str | bytes | int | None) -> Callable[[Path], None]:
    """A base plan, good.csv, ranks.csv and a good log.jsonl, then each named file: its text or bytes, an int:
    a sparse file of that many bytes, None: a FIFO."""
    def write(d: Path) -> None:
        (d / "base.json").write_text(base_plan())
        (d / "good.csv").write_text(GOOD_CSV)
        (d / "ranks.csv").write_text(RANKS)
        (d / "log.jsonl").write_text("".join(LOG_LINE % (1733000000 + 60 * k, "a") for k in range(100)))
        for name, content in contents.items():
            path = d / name.replace("__", ".")
            if content is None:
                os.mkfifo(path)
            elif isinstance(content, int):
                with path.open("wb") as f:
                    f.truncate(content)
            else:
                path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))

    return write


FROM_LOG = ("workload", "from-log", "--ranks", "ranks.csv", "--out", "new.csv")
REPLAN = ("replan", "good.csv", "--previous", "base.json", "--out", "new.json")


def reader_cases() -> list[Case]:
    """Inputs that never end or are too large (devices, FIFOs, huge files, far times, long names), outputs that
    are not regular files, a re-plan lock that is not one, and nan/inf in float options."""
    from planner.placement import MAX_PLACEMENT_BYTES
    from planner.workload_csv import MAX_WORKLOAD_BYTES

    def log(*lines: str) -> str:
        return "".join(LOG_LINE % (1733000000 + 60 * k, "a") for k in range(10)) + "".join(lines)

    cases = [
        Case("plan/dev-zero", _files(), ("plan", "/dev/zero", "--out", "new.json"), "new.json"),
        Case("plan/dev-urandom", _files(), ("plan", "/dev/urandom", "--out", "new.json"), "new.json"),
        Case("plan/fifo", _files(w__csv=None), ("plan", "w.csv", "--out", "new.json"), "new.json"),
        Case("plan/workload-too-large", _files(w__csv=MAX_WORKLOAD_BYTES + 1), ("plan", "w.csv")),
        Case("evaluate-plan/dev-zero", _files(), ("evaluate", "/dev/zero", "good.csv")),
        Case("evaluate-plan/too-large", _files(plan__json=MAX_PLACEMENT_BYTES + 1), ("evaluate", "plan.json",
                                                                                    "good.csv")),
        Case("replan-plan/fifo", _files(plan__json=None), ("replan", "good.csv", "--previous", "plan.json", "--out",
                                                           "new.json"), "new.json"),
        Case("render/dev-urandom", _files(), ("render", "/dev/urandom")),
        Case("from-log/dev-zero", _files(), (*FROM_LOG, "/dev/zero"), "new.csv"),
        Case("from-log/fifo", _files(fifo__jsonl=None), (*FROM_LOG, "fifo.jsonl"), "new.csv"),
        Case("from-log/ranks-dev-zero", _files(), ("workload", "from-log", "log.jsonl", "--ranks", "/dev/zero",
                                                   "--out", "new.csv"), "new.csv"),
        Case("from-log/ranks-fifo", _files(r__csv=None), ("workload", "from-log", "log.jsonl", "--ranks", "r.csv",
                                                          "--out", "new.csv"), "new.csv"),
        Case("from-log/ranks-too-large", _files(r__csv=MAX_WORKLOAD_BYTES + 1),
             ("workload", "from-log", "log.jsonl", "--ranks", "r.csv", "--out", "new.csv"), "new.csv"),
    ]
    bad_logs = {
        "time-1e300": log(LOG_LINE % ("1e300", "a")),
        "time-year-5138": log(LOG_LINE % ("99999999999", "a")),
        "time-iso-9999": log(LOG_LINE % ('"9999-12-31T00:00:00"', "a")),
        "time-nan": log(LOG_LINE % ("NaN", "a")),
        "time-infinity": log(LOG_LINE % ("Infinity", "a")),
        "time-negative": log(LOG_LINE % ("-5", "a")),
        "model-1M-chars": log(LOG_LINE % (1733000000, "m" * 1_000_000)),
        "line-over-16MiB": log() + "x" * (17 << 20) + "\n",
    }
    cases += [Case(f"from-log/{name}", _files(bad__jsonl=text), (*FROM_LOG, "bad.jsonl"), "new.csv")
              for name, text in bad_logs.items()]
    cases.append(Case("from-log/csv-line-over-16MiB",
                      _files(bad__csv="timestamp,model\n1733000000,a\n" + "x" * (17 << 20) + "\n"),
                      (*FROM_LOG, "bad.csv"), "new.csv"))
    for name, argv in {"plan": ("plan", "good.csv", "--out"), "replan": REPLAN[:-1],
                       "from-log": ("workload", "from-log", "log.jsonl", "--ranks", "ranks.csv", "--out")}.items():
        cases += [Case(f"{name}-out/fifo", _files(out__json=None), (*argv, "out.json")),
                  Case(f"{name}-out/dev-null", _files(), (*argv, "/dev/null"))]
    cases.append(Case("plan-plot/fifo", _files(plot__png=None), ("plan", "good.csv", "--plot", "plot.png")))
    victim = _files(victim__txt="keep me\n")
    cases += [
        Case("replan-lock/symlink", lambda d: (victim(d), (d / "new.json.lock").symlink_to("victim.txt")), REPLAN,
             "new.json"),
        Case("replan-lock/directory", lambda d: (victim(d), (d / "new.json.lock").mkdir()), REPLAN, "new.json"),
        Case("replan-lock/fifo", _files(new__json__lock=None), REPLAN, "new.json"),
    ]
    floats = {
        "plan/headroom-nan": ("plan", "good.csv", "--headroom", "nan"),
        "plan/input-tokens-nan": ("plan", "good.csv", "--input-tokens", "nan"),
        "plan/max-ttft-inf": ("plan", "good.csv", "--max-ttft", "inf"),
        "plan/slowdown-nan": ("plan", "good.csv", "--slowdown", "nan"),
        "plan/policy-param-nan": ("plan", "good.csv", "--policy", "elora", "--policy-param", "swap_period_s=nan"),
        "evaluate/duration-inf": ("evaluate", "base.json", "good.csv", "--duration", "inf"),
        "simulate/duration-nan": ("simulate", "good.csv", "--a-max", "4", "--duration", "nan"),
        "replan/headroom-inf": (*REPLAN, "--headroom", "inf"),
        "replan/max-moves-inf-percent": (*REPLAN, "--max-moves", "inf%"),
        "from-log/start-nan": (*FROM_LOG, "log.jsonl", "--start", "nan"),
        "from-log/quantile-nan": (*FROM_LOG, "log.jsonl", "--quantile", "nan"),
        "from-log/window-inf": (*FROM_LOG, "log.jsonl", "--window", "infd"),
    }
    cases += [Case(f"float/{name}", _files(), argv, "new.csv" if "from-log" in name else None)
              for name, argv in floats.items()]
    return cases


#: A stand-in for ``python`` that starts nothing: it keeps its arguments (NUL-separated) in $STUB_ARGV/<pid>.
STUB = """#!/bin/sh
printf '%s\\0' "$@" > "$STUB_ARGV/$$"
"""


def run_with_stub(script: str, d: Path) -> list[list[str]]:
    """Run a rendered launch ``script`` with bash in ``d`` (a test's own directory), ``python`` on its PATH the
    stub: the arguments of each server it starts, by --port. A command the script should not run, such as a
    ``touch`` of a plan's or a flag's text, runs for real, so its file shows it."""
    (d / "launch.sh").write_text(script + "\nwait\n")
    bin_dir, runs = d / "stub-bin", d / "stub-argv"
    bin_dir.mkdir()
    runs.mkdir()
    stub = bin_dir / "python"
    stub.write_text(STUB)
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_ARGV": str(runs)}
    subprocess.run(["bash", "launch.sh"], cwd=d, env=env, check=True, timeout=60)
    argvs = [f.read_text().split("\0")[:-1] for f in runs.iterdir()]
    return sorted(argvs, key=lambda argv: int(argv[argv.index("--port") + 1]))
