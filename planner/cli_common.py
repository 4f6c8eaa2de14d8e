"""Shared pieces of the ``planner`` commands: JSON output and user-facing error handling.

Exit codes: 0 ok · 1 internal error · 2 bad input · 3 infeasible (e.g. a memory error).
"""

from __future__ import annotations

import functools
import json
import sys

import click

from twin.atomic import json_safe
from twin.errors import LoraPlannerError


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
