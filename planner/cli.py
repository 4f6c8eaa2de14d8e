"""The ``planner`` command line: the group and the registration of every command module.

Exit codes: 0 ok · 1 internal error · 2 bad input · 3 infeasible (e.g. a memory error).
"""

from __future__ import annotations

import sys

import click

from planner import cli_harness, cli_models, cli_plan, cli_twin, cli_workload
from twin.heap import keep_freed_memory


class OneLineErrors(click.Group):
    """Usage errors (a bad option value, a missing argument) as one line, like every other error."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except click.exceptions.NoArgsIsHelpError as exc:  # a bare `planner` (or group): its help
            click.echo(exc.ctx.get_help() if exc.ctx else exc.format_message())
            sys.exit(0)
        except click.ClickException as exc:
            where = exc.ctx.command_path if getattr(exc, "ctx", None) else "planner"
            click.echo(f"error: {exc.format_message()} (see `{where} --help`)", err=True)
            sys.exit(exc.exit_code)


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="lora-planner")
def main() -> None:
    """Plan how many GPUs serve a set of LoRA adapters on vLLM, and check it.

    \b
    Start with:
      planner profiles                      # what hardware/model/engine triples are profiled
      planner simulate WORKLOAD.csv --a-max 16   # one server in the digital twin
    """
    keep_freed_memory()


for _command in (cli_plan.plan, cli_plan.evaluate, cli_plan.replan, cli_plan.render, cli_plan.verify, cli_twin.profiles, cli_twin.simulate,
                 cli_workload.workload, cli_models.dataset, cli_models.train, cli_models.train_edge, cli_harness.synth, cli_harness.profile,
                 cli_harness.validate, cli_harness.calibrate, cli_harness.rescore, cli_harness.margin):
    main.add_command(_command)


if __name__ == "__main__":
    main()
