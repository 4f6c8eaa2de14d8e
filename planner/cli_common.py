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
