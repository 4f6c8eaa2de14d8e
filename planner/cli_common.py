"""Shared pieces of the ``planner`` commands: JSON output and user-facing error handling.

Exit codes: 0 ok · 1 internal error · 2 bad input · 3 infeasible (e.g. a memory error).
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys

import click

from planner.formats import FORMATS, launch_model, render
from planner.manifests import FORMATS as MANIFEST_FORMATS
from planner.placement import engine_device
from planner.verdict import TAIL_FACTOR
from twin.atomic import json_safe
from twin.errors import LoraPlannerError
from twin.simulate import STARVATION_THRESHOLD


class FiniteFloat(click.FloatRange):
    """A float option's type: a finite number (exit 2 for nan or inf, which ``float`` and every
    ``click.FloatRange`` bound let through), within the range given as to ``click.FloatRange``."""

    def __init__(self, min: float | None = None, max: float | None = None, min_open: bool = False,
                 max_open: bool = False) -> None:
        super().__init__(min, max, min_open, max_open)
        if min is None and max is None:
            self.name = "float"  # shown as FLOAT, with no range

    def _describe_range(self) -> str:
        return "" if self.min is None and self.max is None else super()._describe_range()

    def convert(self, value, param, ctx):
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return super().convert(number, param, ctx)


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


def slo_options(fn, again: bool = False):
    """``--objective``, ``--max-ttft``, ``--max-tpot``, ``--min-served`` and ``--slowdown``: the bar every GPU is
    judged by in the twin (planner.verdict); :func:`slo_settings` reads them. ``again``: a command that judges a plan
    made before (replan, evaluate), whose objective is the plan's unless given."""
    fn = click.option("--slowdown", type=FiniteFloat(1.0, 10.0), default=None, metavar="FACTOR",
                      help="Judge every GPU on a twin this many times slower than the profile; 1 judges on the "
                           "profile as it is. [the profile's safety margins, sized from real runs (`planner "
                           "profiles`): under the SLO, a GPU of at most 64 adapters on its served-share margin, "
                           "with the twin's error measured there, the others on its SLO margin]")(fn)
    fn = click.option("--min-served", "min_served", type=FiniteFloat(STARVATION_THRESHOLD, 1.0, max_open=True),
                      default=None, metavar="FRACTION",
                      help="Share of its arriving tokens each GPU must serve in the twin [0.95]. Down to 0.9 (the "
                           "starvation rule; the paper's greedy packs that densely); a GPU near its limit must also "
                           "meet it with 5 % more traffic.")(fn)
    fn = click.option("--max-tpot", "max_tpot", type=FiniteFloat(min=0, min_open=True), default=None,
                      metavar="MS", help="The SLO's p99 time per output token in the twin [200 ms with --objective "
                                         "slo]; a workload's max_tpot_ms column tightens it per adapter.")(fn)
    fn = click.option("--max-ttft", "max_ttft", type=FiniteFloat(min=0, min_open=True), default=None,
                      metavar="SECONDS",
                      help="The SLO's p99 time to first token in the twin, over every arrival [2 s with --objective "
                           "slo]; a workload's max_ttft_s column tightens it per adapter.")(fn)
    return click.option("--objective", type=click.Choice(["slo", "throughput"]), default=None,
                        help="slo: every GPU meets a latency SLO (p99 TTFT <= 2 s, p99 TPOT <= 200 ms, as MLPerf's "
                             "interactive LLM server bound) and serves its traffic; throughput: the paper's rule "
                             "alone (serve >= 0.9 of the tokens, here 0.95 for the arrival seed), queues allowed. "
                             + ("[the plan's]" if again else "[slo]"))(fn)


def judged_again(fn):
    """:func:`slo_options` of a command that judges a plan made before."""
    return slo_options(fn, again=True)


def confirm_options(fn, again: bool = False):
    """:func:`slo_options` (``again``: of a plan made before) plus ``--confirm/--no-confirm`` and ``--jobs``
    (planner.confirm)."""
    fn = click.option("--jobs", type=click.IntRange(min=1), default=None,
                      help="Processes simulating GPUs in the twin [CPU cores].")(fn)
    fn = click.option("--tail-factor", "tail_factor", type=FiniteFloat(min=0), default=None, metavar="FACTOR",
                      help=f"In each judging run a GPU's p99.9 TTFT must stay within FACTOR x its TTFT limit "
                           f"[{TAIL_FACTOR:g}]: requests left waiting that long for a LoRA slot mark a GPU whose p99 "
                           f"jumps over the limit from one hour to the next. 0: no such bound.")(fn)
    fn = click.option("--size-margin/--no-size-margin", "size_margin", default=True, show_default=True,
                      help="Judge a GPU whose request sizes vary more than the profile's default lengths with a "
                           "larger margin than 5 % more traffic, in proportion (a queue's wait grows with that "
                           "variation; docs/planning.md).")(fn)
    fn = slo_options(fn, again)
    return click.option("--confirm/--no-confirm", default=True, show_default=True,
                        help="Judge every planned GPU in the twin (the run `planner evaluate` makes) and, for greedy, "
                             "pack again where one falls short; --no-confirm trusts the predictor alone.")(fn)


def replan_options(fn):
    """:func:`confirm_options` of ``planner replan``, which judges the plan it is given again."""
    return confirm_options(fn, again=True)


def slo_settings(objective: str | None, max_ttft: float | None, max_tpot: float | None, min_served: float | None,
                 slowdown: float | None) -> dict:
    """The :class:`planner.plan.PlanOptions` fields of :func:`slo_options`."""
    return {"objective": objective or "slo", "max_ttft_s": max_ttft, "max_tpot_ms": max_tpot, "min_served": min_served,
            "slowdown": slowdown}


def tail_setting(tail_factor: float | None) -> float | None:
    """``--tail-factor``: the default when not given, 0 for no bound."""
    return TAIL_FACTOR if tail_factor is None else tail_factor or None


def jobs_or_cores(jobs: int | None) -> int:
    return jobs or os.cpu_count() or 1


def render_options(fn):
    """``--format``, ``--json`` and what the launch formats need: how a placement is shown
    (planner.formats.render)."""
    fn = click.option("--name", "manifest_name", default="lora", show_default=True,
                      help="k8s/llm-d/aibrix: prefix of the objects' names (and the InferencePool's name).")(fn)
    fn = click.option("--image", default=None,
                      help="k8s/llm-d/aibrix: the vLLM container image [vllm/vllm-openai:v<the profile's vLLM>; "
                           "for vllm-cpu, public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v<it>].")(fn)
    fn = click.option("--port-base", type=click.IntRange(1, 65535), default=8000, show_default=True,
                      help="--format vllm: port of the first server; one more per GPU.")(fn)
    fn = click.option("--adapter-dir", default=None,
                      help="Where adapters without a 'path' column live (DIR/<adapter_id>) [vllm: adapters; "
                           "k8s/llm-d/aibrix: /adapters, in the container, from the 'lora-adapters' volume claim].")(fn)
    fn = click.option("--model", default=None, help="What vLLM loads: a Hugging Face id (org/name) or a path [the "
                      "profile's Hugging Face id; launch formats need one].")(fn)
    fn = click.option("--json", "as_json", is_flag=True, help="Same as --format json.")(fn)
    return click.option("--format", "fmt", type=click.Choice(FORMATS),
                        default="table", show_default=True,
                        help="What to print: a table, the placement JSON, one vLLM server command per GPU, or "
                             "Kubernetes manifests: plain (k8s), with an InferencePool (llm-d), with AIBrix "
                             "ModelAdapters (aibrix).")(fn)


#: vLLM's pre-built server images by the device a plan's engine runs on (the CPU one is for x86).
VLLM_IMAGES = {"cuda": "vllm/vllm-openai", "cpu": "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo"}


def _vllm_image(profile, engine: dict) -> str:
    """The image of ``profile``'s vLLM release for the device of a plan's ``engine`` settings."""
    return f"{VLLM_IMAGES[engine_device(engine)]}:v{profile.engine.version}"


def placement_view(placement, profile, fmt: str, as_json: bool, model: str | None, port_base: int,
                   adapter_dir: str | None, image: str | None = None, manifest_name: str = "lora") -> str:
    """``placement`` as the :func:`render_options` ask; `plan` and `replan` render it before writing the plan, so
    options it refuses (a --name, ports past 65535) leave no file behind. The manifests' image defaults to the
    vLLM release of ``profile``, or in a pool plan of each kind's profile, built for the device the plan's (the
    kind's) engine runs on."""
    from twin import recorded_profile

    fmt = "json" if as_json else fmt
    kinds = placement.kinds()
    if image is None and kinds and fmt in MANIFEST_FORMATS:
        image = {name: _vllm_image(recorded_profile(kinds[name]), kinds[name]["engine"])
                 for name in {inst.kind for inst in placement.instances}}
    image = image or _vllm_image(profile, placement.engine)
    return render(placement, fmt, launch_model(fmt, model, profile.model), port_base, adapter_dir, image, manifest_name)
