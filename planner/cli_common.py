"""Shared pieces of the ``planner`` commands: JSON output and user-facing error handling.

Exit codes: 0 ok · 1 internal error · 2 bad input · 3 infeasible (e.g. a memory error).
"""

from __future__ import annotations

import functools
import json
import os
import sys

import click

from twin.atomic import json_safe
from twin.errors import LoraPlannerError
from twin.simulate import STARVATION_THRESHOLD


def print_json(obj) -> None:
    click.echo(json.dumps(json_safe(obj), indent=1, allow_nan=False))


def user_errors(fn):
    """Turn user-facing errors into one-line messages and exit codes; no tracebacks for bad input."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LoraPlannerError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper


def policy_options(default: str | None = "vllm", default_help: str = ""):
    """``--policy NAME`` and ``--policy-param KEY=VALUE`` (repeatable); :func:`policy_from_cli` reads them."""

    def decorate(fn):
        fn = click.option("--policy-param", "policy_params", multiple=True, metavar="KEY=VALUE",
                          help="Override one of the policy's parameters (repeatable), e.g. scheduler=fifo.")(fn)
        return click.option("--policy", default=default, show_default=default is not None,
                            help="Serving policy: vllm (stock), slora, chameleon, toppings, elora "
                                 f"(see twin/policies){default_help}.")(fn)

    return decorate


def policy_from_cli(name: str | None, params: tuple[str, ...], recorded: dict | None = None):
    """The :class:`twin.policies.PolicySpec` the options ask for (None: stock vLLM). Without ``--policy``,
    the policy a file ``recorded`` (a placement's), with the ``--policy-param`` overrides on top."""
    from twin.policies.spec import parse_overrides, policy_from_name, policy_from_record

    overrides = parse_overrides(params)
    return policy_from_name(name, **overrides) if name is not None else policy_from_record(recorded, **overrides)


def confirm_options(fn):
    """``--confirm/--no-confirm``, ``--min-served``, ``--max-ttft`` and ``--jobs`` of the twin confirmation
    (planner.confirm)."""
    fn = click.option("--jobs", type=click.IntRange(min=1), default=None,
                      help="Processes simulating GPUs for --confirm [CPU cores].")(fn)
    fn = click.option("--max-ttft", "max_ttft", type=click.FloatRange(min=0, min_open=True), default=None,
                      metavar="SECONDS",
                      help="greedy: also require each GPU's p99 time to first token in the twin to be at most this "
                           "(the 90 % rule alone allows a standing queue); GPUs that miss it are packed again.")(fn)
    fn = click.option("--min-served", "min_served", type=click.FloatRange(STARVATION_THRESHOLD, 1.0, max_open=True),
                      default=None, metavar="FRACTION",
                      help="greedy: the share of its arriving tokens each GPU must serve in the twin confirmation "
                           "[0.95; also turns the confirmation on for --predictor twin]. Down to 0.9 (the starvation "
                           "rule; the paper's greedy packs that densely) plans fewer GPUs with a standing queue; "
                           "a GPU under 0.95 must meet it with four more arrival seeds.")(fn)
    return click.option("--confirm/--no-confirm", default=True, show_default=True,
                        help="greedy with a surrogate: simulate every planned GPU in the twin (the run `planner "
                             "evaluate` makes) and pack again, with a load margin, where one falls short.")(fn)


def confirm_settings(confirm: bool, min_served: float | None, max_ttft: float | None, jobs: int | None) -> dict:
    """The :class:`planner.plan.PlanOptions` fields of :func:`confirm_options`."""
    return {"confirm": confirm, "min_served": min_served, "max_ttft_s": max_ttft, "jobs": jobs or os.cpu_count() or 1}
