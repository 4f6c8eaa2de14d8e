"""Human and launch-script views of a placement: a table, and one vLLM command line per GPU."""

from __future__ import annotations

import shlex
from pathlib import PurePosixPath

from planner.confirm import CONFIRM_RATIO
from planner.placement import InstancePlan, Placement
from twin.policies.spec import policy_label


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _status(inst: InstancePlan) -> str:
    if not inst.memory_ok:
        return "MEMORY ERROR"
    return "STARVES" if inst.predicted_starved else "ok"


def render_table(p: Placement) -> str:
    s = p.summary()
    head = (f"{s['adapters']} adapters on {s['gpus']} GPU(s) · profile {p.inputs['profile_id']} · "
            f"algorithm {p.inputs['algorithm']} · predictor {p.inputs['predictor']['kind']}")
    if "policy" in p.inputs:
        head += f" · policy {policy_label(p.inputs['policy'])}"
    rows = [("instance", "adapters", "--max-loras", "--max-lora-rank", "arriving tok/s", "predicted tok/s", "status")]
    for inst in p.instances:
        rows.append((inst.instance_id, str(len(inst.adapters)), str(inst.a_max), str(inst.max_lora_rank),
                     _fmt(inst.arriving_tok_s), _fmt(inst.predicted_throughput_tok_s), _status(inst)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [head, ""]
    for k, r in enumerate(rows):
        lines.append("  ".join(v.ljust(w) if c in (0, 6) else v.rjust(w) for c, (v, w) in enumerate(zip(r, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    split = [a for a, r in p.routes().items() if len(r) > 1]
    if split:
        lines.append(f"\n{len(split)} adapter(s) split over replicas (see 'router' in the JSON): {', '.join(split[:5])}")
    verdict = "every GPU keeps up and starts" if s["all_ok"] else (
        f"{s['predicted_starving']} GPU(s) predicted to starve, {s['memory_errors']} with a memory error")
    lines.append(f"\ntotal: {_fmt(s['predicted_throughput_tok_s'])} of {_fmt(s['arriving_tok_s'])} tok/s; {verdict}")
    if "confirmation" in p.inputs:
        lines.append(_confirmation_line(p.inputs["confirmation"]))
    return "\n".join(lines)


def _confirmation_line(c: dict) -> str:
    line = (f"confirmed in the twin ({c['duration_s']:.0f} simulated s per GPU): the worst GPU serves "
            f"{c['worst_ratio']:.1%} of its arriving tokens, the worst p99 TTFT is {c['worst_ttft_ms_p99'] / 1000:,.1f} s")
    if c["max_ttft_s"] is not None:
        line += f" (limit {c['max_ttft_s']:g} s)"
    if c["seeds_below_default_ratio"]:
        line += (f"; --min-served {c['min_ratio']:g}: a GPU below {CONFIRM_RATIO:.0%} had to meet it with "
                 f"{1 + len(c['seeds_below_default_ratio'])} arrival seeds")
    if c.get("retuned_gpus"):
        line += f"; {c['retuned_gpus']} GPU(s) fell short and were kept with another --max-loras the twin confirmed"
    if c["repacked_gpus"]:
        line += (f"; {c['repacked_gpus']} GPU(s) of the surrogate's plan fell short and their adapters were packed "
                 f"again with up to a {c['margin']:.1%} load margin")
    return line


def adapter_path(p: Placement, adapter_id: str, adapter_dir: str) -> str:
    for a in p.adapters:
        if a["adapter_id"] == adapter_id and a.get("path"):
            return str(a["path"])
    return str(PurePosixPath(adapter_dir) / adapter_id)


def vllm_argv(p: Placement, inst: InstancePlan, model: str, port: int, adapter_dir: str) -> list[str]:
    """argv of one instance's OpenAI server (``python -m vllm.entrypoints.openai.api_server``)."""
    argv = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port)]
    for key, value in p.engine_args(inst).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            argv += [flag, str(value)]
    argv.append("--lora-modules")
    argv += [f"{aid}={adapter_path(p, aid, adapter_dir)}" for aid in inst.adapters]
    return argv


def render_vllm(p: Placement, model: str, port_base: int = 8000, adapter_dir: str = "adapters") -> str:
    """One shell line per GPU (CUDA_VISIBLE_DEVICES=k), quoted safely."""
    header = (f"# {len(p.instances)} vLLM server(s) for {p.inputs['workload']['path']} "
              f"(profile {p.inputs['profile_id']}); adapters without a path are looked up in {adapter_dir}/")
    lines = [header]
    if "policy" in p.inputs:
        lines.append(f"# NOTE: planned for servers running {policy_label(p.inputs['policy'])}; stock vLLM does not "
                     "implement it, so these servers run vLLM's own scheduler and the plan's predictions do not apply")
    for k, inst in enumerate(p.instances):
        argv = vllm_argv(p, inst, model, port_base + k, adapter_dir)
        lines.append(f"# {inst.instance_id}: {len(inst.adapters)} adapters, {_status(inst)}")
        lines.append(f"CUDA_VISIBLE_DEVICES={k} " + " ".join(shlex.quote(a) for a in argv) + " &")
    return "\n".join(lines)
