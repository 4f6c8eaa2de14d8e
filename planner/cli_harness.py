"""``planner synth``, ``planner profile``, ``planner validate``: measure real vLLM, fit and check a profile;
``planner calibrate`` and ``planner rescore`` redo the fit and the check from stored runs, and ``planner margin``
sizes its safety margin from them, without vLLM."""

from __future__ import annotations

import math
import shlex
import sys
import time
from pathlib import Path

import click

from planner.cli_common import FiniteFloat, print_json, user_errors
from twin.progress import counter


def parse_deadline(value: str | None) -> float | None:
    """``--deadline``: epoch seconds, or a time from now (``12m``, ``720s``, ``1h``); None: no deadline."""
    from twin.errors import BadInputError

    if value is None:
        return None
    text = value.strip().lower()
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        deadline = time.time() + float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except ValueError:
        deadline = math.nan
    if not math.isfinite(deadline):
        raise BadInputError(f"--deadline must be epoch seconds or a time from now like 12m (got {value!r})")
    return deadline


def _command_line() -> str:
    return "planner " + " ".join(shlex.quote(a) for a in sys.argv[1:])


@click.command()
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True, help="Directory to write.")
@click.option("--shape", default="tiny", show_default=True,
              help="Model shape: tiny, llama-3.1-8b, or a config.json / model directory to copy the shape of.")
@click.option("--config-only", is_flag=True,
              help="Write the model's config.json and tokenizer without weights (serve with --load-format "
                   "dummy); adapters are still written (--adapters-per-rank 0: none).")
@click.option("--adapter-ranks", default="8,16", show_default=True, help="Comma-separated ranks of the adapters.")
@click.option("--adapters-per-rank", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
@user_errors
def synth(out_dir, shape, config_only, adapter_ranks, adapters_per_rank, seed, as_json) -> None:
    """Write a random-weight Llama model, its tokenizer and LoRA adapters, with no hub access.

    Writes OUT/model (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) and
    OUT/adapters/r<RANK>-<i> (adapter_config.json, adapter_model.safetensors).

    \b
    Example:
      planner synth --out work/tiny --adapter-ranks 8,16,32 --adapters-per-rank 2
      planner synth --out work/llama8b --shape llama-3.1-8b --config-only --adapter-ranks 16
    """
    from serving_harness.synth import model_shape, write_adapters, write_model
    from twin.errors import BadInputError

    try:
        ranks = [int(r) for r in adapter_ranks.split(",") if r.strip()]
    except ValueError:
        raise BadInputError(f"--adapter-ranks must be comma-separated integers (got {adapter_ranks!r})") from None
    if any(r < 1 for r in ranks) or (adapters_per_rank and not ranks):
        raise BadInputError(f"--adapter-ranks must list positive ranks (got {adapter_ranks!r}; --adapters-per-rank 0 "
                            "writes none)")
    model_shape_ = model_shape(shape)
    model = write_model(Path(out_dir) / "model", model_shape_, seed, weights=not config_only)
    names = {f"r{r}-{i}": r for r in ranks for i in range(adapters_per_rank)}
    adapters = write_adapters(Path(out_dir) / "adapters", model_shape_, names, str(model), seed)
    result = {"model": str(model), "weights": not config_only, "adapters": {k: str(v) for k, v in adapters.items()}}
    if as_json:
        print_json(result)
    else:
        click.echo(f"model: {model}{'' if not config_only else ' (config only: --load-format dummy)'}")
        for name, path in adapters.items():
            click.echo(f"adapter {name}: {path}")


#: Engine settings and experiment sizes of `planner profile` per device: a tiny model on a few cores,
#: or an 8B model on a GPU that holds hundreds of requests.
DEVICE_DEFAULTS = {
    "cpu": {"batch_sizes": "1,2,4,8,16,32,48", "max_num_batched_tokens": 512, "max_num_seqs": 64,
            "max_model_len": 2048, "kv_cache_bytes": 4 << 20, "gpu_memory_utilization": None,
            "prompt_lengths": "16,128,256,512", "decode_tokens": 80},
    "cuda": {"batch_sizes": "1,8,32,64,128,256,512", "max_num_batched_tokens": 2048, "max_num_seqs": 512,
             "max_model_len": 8192, "kv_cache_bytes": None, "gpu_memory_utilization": 0.9,
             "prompt_lengths": "256,512,1024,2048", "decode_tokens": 240},
}


def _int_list(value: str, flag: str) -> tuple[int, ...]:
    from twin.errors import BadInputError

    try:
        items = tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise BadInputError(f"{flag} must be comma-separated integers (got {value!r})") from None
    if not items or any(x <= 0 for x in items):
        raise BadInputError(f"{flag} must list positive integers (got {value!r})")
    return items


@click.command()
@click.option("--engine", "device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False), required=True,
              help="Model directory (from `planner synth`, a real model, or a config-only dir with --load-format dummy).")
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="Profile JSON to write.")
@click.option("--id", "profile_id", default=None, help="Profile id [default: the --out file name].")
@click.option("--work-dir", type=click.Path(file_okay=False), default=None,
              help="Raw measurements, logs, adapters; rerunning resumes [default: profile-work/ID].")
@click.option("--kv-cache-bytes", type=click.IntRange(min=1), default=None,
              help="Explicit KV cache size (--kv-cache-memory-bytes) [default: 4 MiB on cpu; none on cuda].")
@click.option("--gpu-memory-utilization", type=FiniteFloat(0, 1, min_open=True), default=None,
              help="Let vLLM size the KV cache from this fraction of GPU memory [default on cuda without "
                   "--kv-cache-bytes: 0.9].")
@click.option("--ranks", default="8,16,32", show_default=True, help="max_lora_rank values to profile.")
@click.option("--a-max-points", default="1,8,32", show_default=True, help="--max-loras values of the KV grid.")
@click.option("--batch-sizes", default=None,
              help="Decode batch sizes of the step-latency experiments; the LoRA experiment uses the smallest "
                   "of at least 8, the largest and the middle one, so its fit spans the batches a loaded server "
                   "runs [default: 1,2,4,8,16,32,48 on cpu; 1,8,32,64,128,256,512 on cuda].")
@click.option("--prompt-lengths", default=None,
              help="Prompt tokens of the prefill experiment, each within --max-num-batched-tokens (one step) "
                   "[default: 16,128,256,512 on cpu; 256,512,1024,2048 on cuda, where shorter prompts leave the "
                   "step memory-bound and understate a prompt token's cost under load].")
@click.option("--decode-tokens", type=click.IntRange(min=6), default=None,
              help="Output tokens of the long decode bursts (the short ones have a third); the step time is the "
                   "makespan difference per extra token, so it must dwarf the HTTP noise [default: 80 on cpu, "
                   "240 on cuda].")
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=None,
              help="[default: 512 on cpu, 2048 on cuda]")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=None, help="[default: 64 on cpu, 512 on cuda]")
@click.option("--max-model-len", type=click.IntRange(min=1), default=None, help="[default: 2048 on cpu, 8192 on cuda]")
@click.option("--load-format", default="auto", show_default=True, help="vLLM --load-format (dummy: no weights).")
@click.option("--gpu", type=click.IntRange(min=0), default=None, help="CUDA device index (CUDA_VISIBLE_DEVICES).")
@click.option("--calibration-cases", type=click.IntRange(min=0), default=10, show_default=True,
              help="Poisson workloads the step latency is calibrated on (0: micro-benchmarks only).")
@click.option("--duration", type=FiniteFloat(min=1), default=30.0, show_default=True,
              help="Seconds of arrivals per calibration workload.")
@click.option("--warmup", type=FiniteFloat(min=0), default=5.0, show_default=True)
@click.option("--python", "python", default=None, help="Python that has vLLM [default: this one].")
@click.option("--lean", is_flag=True,
              help="Two engine starts instead of about twenty, for a short GPU lease: one without LoRA (its KV "
                   "size), one with --max-loras 8 at the largest --ranks that runs every LoRA experiment; the KV "
                   "grid follows from the slots' bytes (within 0.2 % of the grid measured on an H100).")
@click.option("--deadline", default=None, metavar="WHEN",
              help="Stop, exit 5, before a step that would not finish by WHEN: epoch seconds, or a time from now "
                   "(12m, 720s); what finished is saved and the same command resumes it.")
@click.option("--json", "as_json", is_flag=True, help="Print the profile JSON.")
@user_errors
def profile(device, model_dir, out, profile_id, work_dir, kv_cache_bytes, gpu_memory_utilization, ranks,
            a_max_points, batch_sizes, prompt_lengths, decode_tokens, max_num_batched_tokens, max_num_seqs,
            max_model_len, load_format, gpu, calibration_cases, duration, warmup, python, lean, deadline,
            as_json) -> None:
    """Measure vLLM serving MODEL and fit a twin profile (KV capacity, step latency, LoRA, loads).

    Starts one engine per experiment group (about 20 start-ups with the defaults; 2 with --lean), saves
    each experiment's raw result under --work-dir as it completes (rerun to resume), fits every term,
    calibrates the step latency on --calibration-cases Poisson workloads and writes the profile to
    --out. Takes about 30 minutes on 2 CPU cores with the tiny model; on an H100 with an 8B model
    each engine start-up takes about 2 minutes (vLLM 0.22: torch.compile, CUDA graphs). Engine starts
    are recorded in WORK_DIR/starts.json.

    \b
    Examples:
      planner synth --out work/tiny --adapters-per-rank 0
      planner profile --engine cpu --model work/tiny/model --out artifacts/profiles/my-cpu.json
      planner synth --out work/l8 --shape llama-3.1-8b --config-only --adapters-per-rank 0
      planner profile --engine cuda --gpu 0 --model work/l8/model --load-format dummy --out h100.json
      planner profile --engine cuda --model work/l8/model --load-format dummy --lean --calibration-cases 0 \\
          --deadline 12m --out h100.json
      # one short lease: datasets/measured/h100-80gb-llama-3.1-8b/lease.sh runs the whole flow
    """
    from serving_harness.engine import check_device
    from serving_harness.profiling import Profiler, ProfileSpec, Progress, profile_engine
    from serving_harness.synth import model_context
    from serving_harness.window import check_window
    from twin.atomic import check_writable
    from twin.errors import BadInputError

    # What would fail only after the engines ran, refused before the first starts (a new --out directory is made).
    out_dir = Path(out).absolute().parent
    if out_dir.is_dir():
        check_writable(out, "--out")
    elif any(p.is_file() for p in (out_dir, *out_dir.parents)):
        raise BadInputError(f"--out {out}: a file stands where its directory would be; choose another path")
    check_device(device)
    if calibration_cases:
        check_window(duration, warmup)
    profile_id = profile_id or Path(out).stem
    work = Path(work_dir) if work_dir else Path("profile-work") / profile_id
    rank_list = _int_list(ranks, "--ranks")
    d = DEVICE_DEFAULTS[device]
    max_num_seqs = max_num_seqs or d["max_num_seqs"]
    batches = tuple(sorted(set(_int_list(batch_sizes or d["batch_sizes"], "--batch-sizes"))))
    if max(batches) > max_num_seqs:
        raise BadInputError(f"--batch-sizes go up to {max(batches)}, above --max-num-seqs {max_num_seqs}")
    adapters = max(ProfileSpec.adapter_counts)
    wide = [b for b in batches if b >= adapters]
    if len(wide) < 2:
        raise BadInputError(f"--batch-sizes needs two batches of at least {adapters}: the LoRA experiment spreads "
                            f"a batch over up to {adapters} adapters and fits its per-request slope between them")
    lora_batches = tuple(sorted({wide[0], wide[len(wide) // 2], wide[-1]}))
    budget = max_num_batched_tokens or d["max_num_batched_tokens"]
    prompts = tuple(sorted(set(_int_list(prompt_lengths or d["prompt_lengths"], "--prompt-lengths"))))
    if max(prompts) > budget:
        raise BadInputError(f"--prompt-lengths go up to {max(prompts)}, above --max-num-batched-tokens {budget}: "
                            "each prompt must be prefilled in one step")
    if len(prompts) < 2:
        raise BadInputError("--prompt-lengths needs two lengths or more (kp is the TTFT slope between them)")
    max_model_len = max_model_len or d["max_model_len"]
    context = model_context(model_dir)
    if context is not None and max_model_len > context:
        raise BadInputError(f"--max-model-len {max_model_len} is above the {context} tokens the model allows "
                            f"(max_position_embeddings in {Path(model_dir) / 'config.json'}): vLLM would refuse to "
                            f"start; give --max-model-len {context} or less")
    points = _int_list(a_max_points, "--a-max-points")
    if list(points) != sorted(set(points)):
        raise BadInputError(f"--a-max-points must increase (got {a_max_points})")
    decode_tokens = decode_tokens or d["decode_tokens"]
    for what, tokens in (("the longest --prompt-lengths", max(prompts) + 2), ("--decode-tokens", 16 + decode_tokens)):
        if tokens > max_model_len:
            raise BadInputError(f"{what} makes requests of {tokens} tokens, above --max-model-len {max_model_len}")
    if kv_cache_bytes is None and gpu_memory_utilization is None:
        kv_cache_bytes, gpu_memory_utilization = d["kv_cache_bytes"], d["gpu_memory_utilization"]
    spec = ProfileSpec(
        profile_id=profile_id, model_dir=str(Path(model_dir)), device=device, gpu=gpu,
        load_format=load_format, kv_cache_bytes=kv_cache_bytes, gpu_memory_utilization=gpu_memory_utilization,
        max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, prompt_lengths=prompts,
        decode_tokens=decode_tokens, max_model_len=max_model_len, lora_ranks=rank_list,
        a_max_points=points,
        latency_rank=max(rank_list) if lean else 16 if 16 in rank_list else rank_list[0], batch_sizes=batches,
        lora_batch_sizes=lora_batches, lean=lean,
    )
    progress = Progress(len(Profiler(spec, work).experiment_names()) + calibration_cases, counter("profiling", unit="experiment"))
    result = profile_engine(spec, work, out, _command_line(), python, progress, calibration_cases, duration, warmup,
                            parse_deadline(deadline))
    for warning in result["provenance"].get("fit_warnings", []):
        click.echo(f"warning: {warning}", err=True)
    if as_json:
        print_json(result)
        return
    lat = result["step_latency_ms"]
    click.echo(f"wrote {out}: KV {result['kv_capacity']['no_lora_tokens']} tokens (no LoRA); step ms = "
               f"{lat['k5_ms']:.3f} + {lat['k4_ms_per_request']:.4f}*B + {lat['kp_ms_per_prompt_token']:.5f}*P "
               f"+ [A_B>0]({lat['l0_ms']:.3f} + {lat['l1_ms_per_request']:.4f}*B + {lat['l2_ms_per_adapter']:.4f}*A_B)")


@click.command()
@click.option("--profile", "profile_id", required=True, help="Profile id or JSON path to check.")
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="Model directory [default: the one the profile was measured with].")
@click.option("--cases", type=click.IntRange(min=1), default=None, help="Number of workloads [default: 32].")
@click.option("--duration", type=FiniteFloat(min=1), default=30.0, show_default=True,
              help="Seconds of arrivals per workload.")
@click.option("--warmup", type=FiniteFloat(min=0), default=5.0, show_default=True,
              help="Seconds excluded from the measurement window.")
@click.option("--seed", type=int, default=None, help="Seed of the workload set [default: 2024].")
@click.option("--work-dir", type=click.Path(file_okay=False), default=None,
              help="Per-case results, request/metric parquet, logs; rerun resumes [default: validation-work/ID].")
@click.option("--workloads-of", "workloads_of", type=click.Path(exists=True, file_okay=False), default=None,
              help="Run the very workloads another work dir ran (its workloads.json; sets --cases, --seed, --engines "
                   "and --kv-cache-memory-bytes): "
                   "how far two real runs differ, or calibration runs redone on today's machine.")
@click.option("--out-dir", type=click.Path(file_okay=False), default=None,
              help="table.json, table.csv, twin_vs_real.png [default: with --record artifacts/validation/ID, the "
                   "table the profile's record points to; else WORK_DIR/table].")
@click.option("--python", "python", default=None, help="Python that has vLLM [default: this one].")
@click.option("--gpu", type=click.IntRange(min=0), default=None,
              help="CUDA device index for a CUDA profile [default: the one it was profiled on].")
@click.option("--engines", type=click.IntRange(min=1), default=None,
              help="Spread the workloads over this many engines (A_max 1 at the largest rank, 2 at the smallest, "
                   "then 4 and 8) [default: 5]; 2 for a short GPU lease.")
@click.option("--deadline", default=None, metavar="WHEN",
              help="Stop, exit 5, before an engine or workload that would not finish by WHEN (epoch seconds, or "
                   "a time from now: 12m); the workloads done are saved and the same command resumes.")
@click.option("--kv-cache-memory-bytes", "kv_cache_bytes", type=click.IntRange(min=1), default=None,
              help="Start every engine with this KV cache (vLLM's flag of that name) and run the twin with it: "
                   "small enough, the workloads are limited by KV memory (preemptions) [default: the profile's].")
@click.option("--record", is_flag=True, help="Also store the summary in the profile JSON's `validation` field.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@user_errors
def validate(profile_id, model_dir, cases, duration, warmup, seed, work_dir, workloads_of, out_dir, python, gpu,
             engines, deadline, kv_cache_bytes, record, as_json) -> None:
    """Run workloads the profile was not fitted on, on real vLLM and in the twin, and compare.

    Each workload (Poisson arrivals, skewed per-adapter rates, 1-8 GPU slots, light to overloaded)
    runs on a real engine and through the twin with the very same requests; the table gives
    throughput / ITL / TTFT SMAPE (100·mean(2|p−r|/(|p|+|r|))) per regime and starved agreement.
    A short fixed probe right before and after each workload measures how fast the machine decodes at
    that moment; the summary also scores the twin run at that speed (a shared machine's speed drifts).

    \b
    Examples:
      planner validate --profile cpu-2core-tiny-llama --model work/tiny/model --cases 32
      planner validate --profile cpu-2core-tiny-llama --model work/tiny/model \\
          --workloads-of validation-work/cpu-2core-tiny-llama --work-dir validation-work/rerun
      planner validate --profile h100.json --cases 4 --engines 1 \\
          --kv-cache-memory-bytes 2147483648 --work-dir validation-work/kv-limited
    """
    from serving_harness.calibration import stored_workloads
    from serving_harness.validation import Validator, refuse_calibration_workloads
    from serving_harness.window import check_window
    from twin.errors import BadInputError
    from twin.profile import load_profile

    check_window(duration, warmup)
    prof = load_profile(profile_id)
    saved = stored_workloads(workloads_of) if workloads_of else None
    if saved:
        kv = saved.get("kv_cache") or {}
        for flag, given, stored in (("--cases", cases, saved["count"]), ("--seed", seed, saved["seed"]),
                                    ("--engines", engines, saved.get("engines")),
                                    ("--kv-cache-memory-bytes", kv_cache_bytes, kv.get("bytes"))):
            if given is not None and given != stored:
                raise BadInputError(f"{flag} {given}: {workloads_of} ran {stored or 'none'}; leave {flag} out with "
                                    "--workloads-of")
        cases, seed, engines, kv_cache_bytes = saved["count"], saved["seed"], saved.get("engines"), kv.get("bytes")
    cases, seed = cases or 32, 2024 if seed is None else seed
    if record:
        refuse_calibration_workloads(prof, seed, "--record")
    model = model_dir or prof.model.get("path")
    if not model or not Path(model).is_dir():
        raise BadInputError(f"model directory {model!r} not found; pass --model (e.g. from `planner synth`)")
    work = Path(work_dir) if work_dir else Path("validation-work") / prof.profile_id
    out = _table_dir(prof, out_dir, record, work)
    validator = Validator(prof, str(Path(model)), work, duration, warmup, python, counter("validating", unit="case"), gpu,
                          deadline=parse_deadline(deadline), engines=engines or 0, kv_cache_bytes=kv_cache_bytes)
    if saved:
        validator.adopt_workloads(saved, workloads_of)
    rows = validator.compare(validator.run(validator.workload_set(cases, seed)))
    _write_table(profile_id, prof, rows, out, duration, warmup, seed, record, as_json)


def _pct(value: float) -> str:
    """A SMAPE for the summary lines; n/a where a regime had no workload."""
    return f"{value:6.2f} %" if math.isfinite(value) else "   n/a  "


def _table_dir(prof, out_dir, record: bool, work: Path) -> Path:
    """Where the table goes, checked before any run: ``--out-dir``, else with ``--record`` the profile's under
    artifacts/validation (the table its record points to), else the work dir's ``table/`` (a table written there
    without the record would no longer be the one the profile records)."""
    from twin.errors import BadInputError
    from twin.profile import artifacts_dir

    default = artifacts_dir() / "validation" / prof.profile_id if record else work / "table"
    out = Path(out_dir) if out_dir else default
    if any(p.exists() and not p.is_dir() for p in (out, *out.parents)):
        raise BadInputError(f"--out-dir {out}: not a directory (or under a file); give a directory")
    return out


def _write_table(profile_id, prof, rows, out, duration, warmup, seed, record, as_json) -> None:
    """Report the compared ``rows`` under ``out`` (table, CSV, plot; the summary in the profile with ``record``) and
    print."""
    from serving_harness.validation import record_summary, report, run_meta

    summary = report(rows, out, prof.profile_id, run_meta(_command_line(), duration, warmup, seed))
    if record:
        record_summary(profile_id, prof, summary, out / "table.json", _command_line())
    if as_json:
        print_json(summary)
        return
    click.echo(f"{summary['cases']} workloads ({summary['real_starved']} starved in reality); "
               f"starved agreement {summary['starved_agreement_pct']:.1f} %")
    for name in ("throughput", "itl", "ttft"):
        click.echo(f"  {name:10s} SMAPE all {_pct(summary[f'{name}_smape_pct_all'])}  starved "
                   f"{_pct(summary[f'{name}_smape_pct_starved'])}  not starved "
                   f"{_pct(summary[f'{name}_smape_pct_not_starved'])}")
    within = summary["itl_smape_pct_within_engines"]
    click.echo("  ITL SMAPE with each engine's own twin/real ratio divided out: "
               + (_pct(within) if math.isfinite(within) else "n/a (no engine ran two workloads)"))
    if summary["itl_engine_cases"]:
        click.echo(f"  ITL timed by the engine core ({summary['itl_engine_cases']} workloads): twin SMAPE "
                   f"{summary['itl_engine_smape_pct_all']:.2f} %, client-timed ITL off it by "
                   f"{summary['itl_client_vs_engine_smape_pct']:.2f} %")
    if summary["probe_cases"]:
        low, high = summary["probe_speed_factor_range"]
        click.echo(f"  twin at the speed probed around each workload ({summary['probe_cases']} workloads, real/twin "
                   f"probe ITL {low:.2f}-{high:.2f}): throughput {_pct(summary['throughput_smape_pct_at_probe_speed'])}"
                   f"  ITL {_pct(summary['itl_smape_pct_at_probe_speed'])}  TTFT "
                   f"{_pct(summary['ttft_smape_pct_at_probe_speed'])}  starved agreement "
                   f"{summary['starved_agreement_pct_at_probe_speed']:.1f} %")
    click.echo(f"wrote {out}/table.json, table.csv, twin_vs_real.png")


@click.command()
@click.option("--profile", "profile_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Profile JSON; rewritten with the fit (its validation figures are dropped).")
@click.option("--runs", "runs_dirs", type=click.Path(exists=True, file_okay=False), multiple=True,
              help="Calibration runs; repeat to pool several work dirs of one workload set, e.g. run on "
                   "different days [default: the profile's provenance.calibration.runs].")
@click.option("--duration", type=FiniteFloat(min=1), default=None,
              help="Seconds of arrivals per run, for runs that do not record theirs [as the runs record; else the "
                   "previous calibration's, else 30].")
@click.option("--warmup", type=FiniteFloat(min=0), default=None,
              help="Seconds excluded from the window, likewise [as the runs record; else the previous "
                   "calibration's, else 5].")
@click.option("--json", "as_json", is_flag=True, help="Print provenance.calibration as JSON.")
@user_errors
def calibrate(profile_path, runs_dirs, duration, warmup, as_json) -> None:
    """Fit a profile's step-latency calibration (scales, arrival delay) to stored real runs, without vLLM.

    The runs are those `planner profile` made after fitting (calibration cases), or any `planner validate`
    work dir (`--runs`), e.g. the calibration workloads rerun with `--workloads-of`; the fit, the runs'
    seed and the command are recorded in the profile's provenance. A profile measured with
    `--calibration-cases 0` (a short GPU lease, say) is calibrated here for the first time from `--runs`
    made later; validate it on other workloads (another `--seed`). Rerun `planner rescore --record` afterwards.
    On a machine whose speed drifts from day to day, run the calibration workloads on several days and
    pass every work dir: one fit to all of them describes the usual speed, not one day's.

    \b
    Examples:
      planner calibrate --profile artifacts/profiles/cpu-2core-tiny-llama.json
      planner validate --profile h100.json --seed 7 --cases 10 --work-dir calib-runs
      planner calibrate --profile h100.json --runs calib-runs
      planner calibrate --profile cpu.json --runs calib-monday --runs calib-tuesday
    """
    from serving_harness.calibration import recalibrate
    from twin.profile import write_profile

    data = recalibrate(profile_path, _command_line(), runs_dirs, duration, warmup)
    write_profile(profile_path, data)
    fit = data["provenance"]["calibration"]
    if as_json:
        print_json(fit)
        return
    click.echo(f"wrote {profile_path}: scales " + ", ".join(f"{k} {v:.3f}" for k, v in fit["scales"].items())
               + f"; arrival delay {fit['arrival_delay_ms']:.1f} ms; loss {fit['loss_before']:.4f} "
               f"-> {fit['loss_scales_only']:.4f} (scales) -> {fit['loss_after']:.4f}")


@click.command()
@click.option("--profile", "profile_id", required=True, help="Profile id or JSON path.")
@click.option("--work-dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="A `planner validate` work dir (cases/*.json, runs/*-requests.parquet).")
@click.option("--out-dir", type=click.Path(file_okay=False), default=None,
              help="table.json, table.csv, twin_vs_real.png [default: with --record artifacts/validation/ID, the "
                   "table the profile's record points to; else WORK_DIR/table].")
@click.option("--duration", type=FiniteFloat(min=1), default=None,
              help="Seconds of arrivals per workload, for runs that do not record theirs [as the runs record; else 30].")
@click.option("--warmup", type=FiniteFloat(min=0), default=None,
              help="Seconds excluded from the measurement window, likewise [as the runs record; else 5].")
@click.option("--record", is_flag=True, help="Also store the summary in the profile JSON's `validation` field.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@user_errors
def rescore(profile_id, work_dir, out_dir, duration, warmup, record, as_json) -> None:
    """Score a profile's twin against real runs stored by `planner validate`, without vLLM.

    Replays each stored workload's very requests through the twin, recomputes the real figures from
    the stored requests and metrics, and writes the same table, CSV and plot as `planner validate`
    (e.g. after `planner calibrate` or a change to the twin).

    \b
    Example:
      planner rescore --profile cpu-2core-tiny-llama \\
          --work-dir datasets/measured/cpu-2core-tiny-llama/validation-day4a --record
    """
    from serving_harness.calibration import stored_seed
    from serving_harness.validation import refuse_calibration_workloads, rescored
    from twin.profile import load_profile

    prof, work = load_profile(profile_id), Path(work_dir)
    out = _table_dir(prof, out_dir, record, work)
    seed = stored_seed(work)
    if record:
        refuse_calibration_workloads(prof, seed, str(work))
    rows, duration, warmup = rescored(prof, work, duration, warmup)
    _write_table(profile_id, prof, rows, out, duration, warmup, seed, record, as_json)


@click.command()
@click.option("--profile", "profile_id", required=True, help="Profile id or JSON path the runs are scored against.")
@click.option("--runs", "runs_dirs", required=True, multiple=True, type=click.Path(exists=True, file_okay=False),
              help="A `planner validate` work dir of the profile's engine; repeat to pool several (other days, "
                   "other seeds).")
@click.option("--risk", type=FiniteFloat(min=0, max=0.5, min_open=True, max_open=True), default=0.01,
              show_default=True, help="The chance a planned GPU may starve in reality (one-sided bound).")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Write the profile with this margin as its `planning` section (the profile's own file too) "
                   "[default: print the margin only].")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@user_errors
def margin(profile_id, runs_dirs, risk, out, as_json) -> None:
    """Size a profile's safety margin from its real runs, without vLLM.

    A plan judges every GPU on a twin slower than the profile by this margin. The real runs the engine could not
    keep up with show how fast it really is against its twin; the margin is the slowdown that at most --risk of
    real engines exceed (a one-sided prediction bound over those runs: few runs give a wide margin). Runs of the
    workloads the profile was calibrated on are refused. With 10 runs or more the profile is plan-grade
    (`planner profiles`); a latency SLO takes the same margin, as these runs say nothing about latency.

    \b
    Examples:
      planner margin --profile cpu-2core-tiny-llama \\
          --runs datasets/measured/cpu-2core-tiny-llama/validation-day4a
      planner validate --profile h100.json --seed 11 --cases 20 --work-dir held-apart
      planner margin --profile h100.json --runs held-apart --out h100.json
    """
    import json

    from serving_harness.margin import measured_margin, planning_section
    from twin.profile import PLAN_GRADE_RUNS, load_profile, profiles_dir, write_profile

    prof = load_profile(profile_id)
    figures = measured_margin(prof, [Path(d) for d in runs_dirs], risk)
    if out:
        source = Path(prof.path) if prof.path else profiles_dir() / f"{prof.profile_id}.json"
        data = json.loads(source.read_text(encoding="utf-8"))
        data["planning"] = planning_section(figures, ", ".join(runs_dirs), _command_line())
        write_profile(out, data)
    if as_json:
        print_json(figures)
        return
    r = figures["real_over_twin"]
    click.echo(f"{prof.profile_id}: real engines ran {r['min']:.3f}-{r['median']:.3f}x (least, median) the twin's "
               f"throughput in the {figures['starved_runs']} of {figures['runs']} runs they could not keep up with")
    click.echo(f"margin: GPUs judged in a twin {figures['slowdown']:g}x slower than the profile (at most "
               f"{risk:.0%} of real engines slower; {figures['runs_slower_than_the_slowed_twin']} of these runs were)")
    grade = ("plan-grade" if figures["runs"] >= PLAN_GRADE_RUNS
             else f"not plan-grade: it rests on {figures['runs']} runs, plan-grade from {PLAN_GRADE_RUNS}")
    click.echo(f"wrote {out} ({grade})" if out else f"({grade}; --out FILE writes it into a profile)")
