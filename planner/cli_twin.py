"""``planner profiles`` and ``planner simulate``: the shipped profiles and one server in the twin."""

from __future__ import annotations

import click

from planner.cli_common import FiniteFloat, policy_from_cli, policy_options, print_json, user_errors

EPILOG_SIMULATE = """\b
Example:
  planner simulate datasets/workloads/high-rate-64-adapters.csv --a-max 16 \\
      --profile h100-64gb-qwen2.5-7b --duration 3600 --json
  planner simulate datasets/workloads/small-8-adapters.csv --a-max 8 \\
      --policy chameleon --policy-param queues=2 --json
  planner simulate datasets/workloads/small-8-adapters.csv --a-max 8 \\
      --turns 4 --think-time 30 --policy elora   # multi-turn chat: ELORA reuses history KV
"""



@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@user_errors
def profiles(as_json: bool) -> None:
    """List the shipped profiles with their provenance and safety margins.

    \b
    Example:
      planner profiles --json
    """
    from planner.verdict import few_adapters
    from twin.profile import DEFAULT_PROFILE_ID, PLAN_GRADE_RUNS, list_profiles

    items = []
    shipped, problems = list_profiles()
    for problem in problems:
        click.echo(f"warning: skipped {problem}", err=True)
    for p in shipped:
        few = few_adapters(p, "slo")
        items.append({
            "profile_id": p.profile_id, "default": p.profile_id == DEFAULT_PROFILE_ID,
            "description": p.description, "engine_version": p.engine.version,
            "lora_ranks": list(p.kv.lora_ranks),
            "max_a_max": {str(r): p.kv.max_a_max(r) for r in p.kv.lora_ranks},
            "latency_models": ["default", *p.step_latency_variants],
            "safety_margin": {"throughput": p.planning_slowdown("throughput"), "slo": p.planning_slowdown("slo"),
                              "few_adapters": None if few is None else few.to_dict()},
            "provenance": p.provenance, "real_runs": p.planning.get("real_runs"),
            "plan_grade": p.plan_grade_note() is None,
        })
    if as_json:
        print_json(items)
        return
    for it in items:
        mark = " (default)" if it["default"] else ""
        click.echo(f"{it['profile_id']}{mark}\n  {it['description']}")
        click.echo(f"  ranks {it['lora_ranks']}, largest --max-loras that starts per rank: {it['max_a_max']}")
        click.echo(f"  latency models: {', '.join(it['latency_models'])}")
        margin = it["safety_margin"]
        click.echo(f"  safety margin: GPUs judged in a twin {margin['slo']:g}x slower than the profile for the SLO"
                   + (f" ({few['slowdown']:g}x where a GPU serves at most {few['adapters']} adapters)"
                      if (few := margin["few_adapters"]) else "")
                   + f", {margin['throughput']:g}x for the served share alone (--objective throughput)")
        click.echo(f"  from: {it['provenance'].get('study') or it['provenance'].get('kind')}")
        runs = "" if it["real_runs"] is None else f" (its safety margin rests on {it['real_runs']} real runs)"
        click.echo(f"  plan-grade: yes{runs}" if it["plan_grade"] else
                   f"  plan-grade: no{runs or ' (no real runs)'}: plan-grade from {PLAN_GRADE_RUNS}; treat its plans "
                   "as estimates")
        how = "measured with" if it["provenance"].get("kind") == "measured" else "rebuild"  # on the machine measured
        click.echo(f"  {how}: {it['provenance'].get('command', '-')}\n")


@click.command(epilog=EPILOG_SIMULATE)
@click.argument("workload", type=click.Path(dir_okay=False))
@click.option("--a-max", type=click.IntRange(min=1), required=True, help="vLLM --max-loras (GPU adapter slots).")
@click.option("--profile", "profile_id", default=None, help="Profile id or JSON path [default: the default profile].")
@click.option("--duration", type=FiniteFloat(min=0, min_open=True), default=3600.0, show_default=True,
              help="Simulated seconds of arrivals.")
@click.option("--warmup", type=FiniteFloat(min=0), default=0.0, show_default=True,
              help="Seconds excluded from the measurement window.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--arrivals", type=click.Choice(["poisson", "unpredictable"]), default="poisson", show_default=True)
@click.option("--input-tokens", type=FiniteFloat(min=1), default=None,
              help="Mean prompt tokens for adapters without input_tokens [profile default].")
@click.option("--output-tokens", type=FiniteFloat(min=1), default=None,
              help="Mean output tokens for adapters without output_tokens [profile default].")
@click.option("--lengths", type=click.Choice(["constant", "lognormal"]), default=None,
              help="Request lengths: every request at the mean, or log-normal around it (--length-cv) "
                   "[default: the profile's, log-normal where it sets a length_cv].")
@click.option("--length-cv", type=FiniteFloat(min=0, min_open=True), default=None,
              help="Coefficient of variation of log-normal lengths [default: the profile's, else 1.0].")
@click.option("--max-in-flight", type=click.IntRange(min=0), default=0, show_default=True,
              help="Client cap on requests in flight (arrivals beyond it fail); 0 = none.")
@click.option("--latency-model", default="default", show_default=True,
              help="Step-latency model of the profile (see `planner profiles`), e.g. 'study'.")
@click.option("--timeseries-every", type=FiniteFloat(min=0), default=0.0,
              help="Add running/waiting/KV-use samples every S seconds to --json output.")
@click.option("--turns", type=FiniteFloat(min=1), default=None,
              help="Multi-turn chat: mean turns per conversation (geometric). Each turn's prompt carries the "
                   "conversation so far; an adapter's rate stays its turns per second. [default: single-turn]")
@click.option("--think-time", type=FiniteFloat(min=0), default=30.0, show_default=True,
              help="With --turns: mean seconds between a conversation's turns (exponential).")
@policy_options()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@user_errors
def simulate(workload, a_max, profile_id, duration, warmup, seed, arrivals, input_tokens, output_tokens,
             lengths, length_cv, max_in_flight, latency_model, timeseries_every, turns, think_time, policy,
             policy_params, as_json) -> None:
    """Simulate one vLLM server serving WORKLOAD with --max-loras A_MAX in the digital twin.

    Reports throughput (input + output tokens of requests finished in the window, per second),
    the arriving token rate, whether the server starves (throughput < 0.9 x arriving), ITL and
    TTFT over finished requests, preemptions and adapter loads. Exit code 3 when the profile says
    vLLM would not start with this A_max (memory error). With --policy other than vllm, memory is
    one pool shared by KV and adapters, and A_max only caps the distinct adapters of one batch.
    With --turns, stock vLLM recomputes each turn's history (the profiles run without prefix
    caching); --policy elora keeps it, swapped to host memory when the pool needs room.
    """
    from planner.packing import mean_lengths
    from planner.workload_csv import read_workload
    from twin import (
        DEFAULT_PROFILE_ID,
        BadInputError,
        Conversations,
        PoissonArrivals,
        SimConfig,
        UnpredictableArrivals,
        load_profile,
    )
    from twin import simulate as run

    profile = load_profile(profile_id or DEFAULT_PROFILE_ID).with_latency_variant(latency_model)
    wl = read_workload(workload, profile)
    mean_lengths(wl, profile, input_tokens, output_tokens)  # a request that cannot fit is bad input
    from twin.simulate import MAX_SIM_REQUESTS, expected_requests

    if expected_requests(wl, duration) > MAX_SIM_REQUESTS:
        raise BadInputError(f"{expected_requests(wl, duration):,.0f} requests in {duration:g} s is more than one "
                            f"simulation draws ({MAX_SIM_REQUESTS:,}); shorten --duration or lower the rates")
    cfg = SimConfig(
        a_max=a_max, duration_s=duration, warmup_s=warmup, seed=seed,
        arrivals=UnpredictableArrivals() if arrivals == "unpredictable" else PoissonArrivals(),
        lengths=_length_model(profile, lengths, length_cv),
        input_tokens=input_tokens, output_tokens=output_tokens, max_in_flight=max_in_flight,
        timeseries_dt_s=timeseries_every, policy=policy_from_cli(policy, policy_params),
        conversations=None if turns is None else Conversations(turns, think_time),
    )
    res = run(wl, profile, cfg)
    if as_json:
        print_json(res.to_dict())
        return
    verdict = click.style("STARVED", fg="red") if res.starved else click.style("keeps up", fg="green")
    click.echo(f"{res.served_adapters} adapters on {res.profile_id} ({res.policy}), --max-loras {res.a_max} "
               f"--max-lora-rank {res.max_lora_rank} (KV {res.kv_tokens} tokens), {res.window_s:.0f} s window")
    click.echo(f"  throughput {res.total_throughput_tok_s:,.0f} tok/s of {res.arriving_tok_s:,.0f} arriving: {verdict}")
    click.echo(f"  ITL mean {res.itl_ms_mean:.1f} ms (p99 {res.itl_ms_p99:.1f}); TTFT mean {res.ttft_ms_mean:,.0f} ms "
               f"(p99 {res.ttft_ms_p99:,.0f})")
    click.echo(f"  requests: {res.arrived_requests} arrived, {res.finished_requests} finished, "
               f"{res.rejected_requests} rejected; {res.preemptions} preemptions, {res.adapter_loads} adapter loads")
    stats = res.policy_stats or {}
    if "history_reused" in stats:
        click.echo(f"  history KV ({res.conversations}): {stats['history_reused']:.0%} of history tokens reused, "
                   f"{stats['history_swap_ins']} swapped back in, {stats['prefill_tokens']:,} prompt tokens computed")
    click.echo(f"  simulated in {res.sim_wall_s:.2f} s")


def _length_model(profile, lengths: str | None, cv: float | None):
    """The --lengths/--length-cv choice; what is not given comes from the profile (None: all of it)."""
    from twin import LengthModel

    if lengths == "constant":
        if cv is not None:
            raise click.UsageError("--length-cv needs log-normal lengths, not --lengths constant")
        return LengthModel()
    if lengths is None and cv is None:
        return None
    cv = cv or profile.default_length_cv or 1.0
    return LengthModel.lognormal(cv)
