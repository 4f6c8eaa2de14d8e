"""``planner dataset build`` and ``planner train``: training sets from the twin, surrogates from them."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from models import DEFAULT_KERNEL_ROWS
from planner.cli_common import FiniteFloat, policy_from_cli, policy_options, print_json, user_errors

EPILOG_BUILD = """\b
Examples:
  planner dataset build --profile h100-64gb-llama-3.1-8b --grid paper --jobs 2 \\
      --out datasets/h100-64gb-llama-3.1-8b/paper.parquet
  planner dataset build --profile h100-64gb-qwen2.5-7b --grid small --out /tmp/small.parquet
  planner dataset build --profile ID --grid paper --backend ray --address auto --out ...
  planner dataset build --profile h100-64gb-llama-3.1-8b --grid small --policy chameleon \\
      --out datasets/h100-64gb-llama-3.1-8b/chameleon-small.parquet
Rerunning the same command resumes an interrupted build (rows are kept under OUT.work/).
"""

EPILOG_TRAIN = """\b
Examples:
  planner train --dataset datasets/h100-64gb-llama-3.1-8b/paper.parquet \\
      --profile h100-64gb-llama-3.1-8b --out artifacts/surrogates/h100-64gb-llama-3.1-8b/ --jobs 2
  planner train --dataset datasets/h100-64gb-llama-3.1-8b/chameleon-small.parquet \\
      --profile h100-64gb-llama-3.1-8b --policy chameleon   # -> artifacts/surrogates/<profile>/chameleon/
"""


@click.group()
def dataset() -> None:
    """Training sets for the surrogates: the digital twin run over a scenario grid."""


@dataset.command("build", epilog=EPILOG_BUILD)
@click.option("--profile", "profile_id", required=True, help="Profile id or JSON path.")
@click.option("--grid", default="paper", show_default=True,
              help="'paper' (the study's 79,200 scenarios), 'small' (300, for CI), 'fleet' (12,000 scenarios, "
                   "GPUs of random fleets: docs/surrogates.md) or a grid JSON file.")
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="Output parquet file.")
@click.option("--duration", type=FiniteFloat(min=0, min_open=True), default=None,
              help="Simulated seconds per scenario [grid's: paper 3600, small 600].")
@click.option("--length-scale", type=(FiniteFloat(min=0, min_open=True), FiniteFloat(min=0, min_open=True)),
              default=None, metavar="LO HI",
              help="Draw each scenario's mean prompt and output lengths log-uniformly in [LO, HI] x the profile's "
                   "defaults [grid's: 0.5 2]. Widen it where the profile's defaults are far from the lengths "
                   "fleets send (a surrogate cannot answer for lengths its dataset never saw).")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True, help="Local worker processes.")
@click.option("--backend", type=click.Choice(["local", "ray"]), default="local", show_default=True)
@click.option("--address", default=None, help="Ray cluster address (with --backend ray), e.g. 'auto'.")
@click.option("--limit", type=click.IntRange(min=0), default=0,
              help="Stop after this many scenarios in total (0 = all); rerun to continue.")
@click.option("--max-in-flight", type=click.IntRange(min=0), default=None,
              help="Cap the client's requests in flight in every scenario [grid's: none]. The study's load "
                   "generator could hold 28232 (one port each); a dataset built with that cap predicts its real "
                   "runs, not production traffic, so do not plan with surrogates trained on it.")
@policy_options()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
@user_errors
def build(profile_id, grid, out, duration, length_scale, jobs, backend, address, limit, max_in_flight, policy,
          policy_params, as_json) -> None:
    """Run the twin over a scenario grid and write one parquet row per scenario.

    Each row holds the scenario spec (per-adapter ranks and rates, A_max, mean lengths, duration,
    seed, profile id) and the targets (throughput, arriving tok/s, ITL, TTFT,
    starved). (A_max, max rank) pairs vLLM cannot start with are rows with memory_error=true.
    Scenarios run in a seeded random order, so a partial build is a uniform sample of the grid.
    With --policy other than vllm the twin runs that serving policy (every A_max starts) and the
    dataset records it; surrogates trained on it answer for that policy only. With --max-in-flight
    the twin's client holds at most that many requests (the dataset records it too).
    """
    from models.dataset import GridSpec, build_dataset
    from twin import load_profile

    profile = load_profile(profile_id)
    spec = GridSpec.load(grid, duration, length_scale, max_in_flight)
    res = build_dataset(profile, spec, out, jobs=jobs, backend=backend, address=address, limit=limit,
                        progress=not as_json, policy=policy_from_cli(policy, policy_params))
    summary = {"out": str(res.out), "grid_scenarios": res.total, "rows": res.done, "new_rows": res.new_rows,
               "memory_error_rows": res.memory_errors, "complete": res.complete, "interrupted": res.interrupted,
               "wall_s": res.wall_s, "rows_per_hour": res.rows_per_hour, "twin_s": res.sim_s}
    if as_json:
        print_json(summary)
        return
    state = "complete" if res.complete else f"partial ({res.done}/{res.total}; rerun to continue)"
    click.echo(f"wrote {res.out}: {res.done} rows, {res.memory_errors} memory errors, {state}; "
               f"{res.new_rows} new rows in {res.wall_s:.0f} s ({res.rows_per_hour:,.0f} rows/h)")
    if res.interrupted:
        sys.exit(130)


@click.command(epilog=EPILOG_TRAIN)
@click.option("--dataset", "datasets", multiple=True, required=True, type=click.Path(exists=True, dir_okay=False),
              help="Dataset parquet (repeatable).")
@click.option("--profile", "profile_id", required=True, help="Profile id or JSON path the dataset was built with.")
@policy_options(default_help="; the dataset's must match")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Artifact directory [artifacts/surrogates/<profile-id>/, or <profile-id>/<policy>/ "
                   "for another policy than vllm].")
@click.option("--search", type=click.Choice(["reduced", "paper"]), default="reduced", show_default=True,
              help="Hyper-parameter grids: the paper's Appendix B spaces (hours) or a reduced set.")
@click.option("--models", default="rf,svm,knn", show_default=True, help="Models to tune and report (rf ships).")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--trials", type=click.IntRange(min=1), default=60, show_default=True,
              help="Optuna trials per small tree.")
@click.option("--penalty", type=FiniteFloat(min=0), default=1.0, show_default=True,
              help="Complexity penalty: error points charged for a small tree using all 32 rules.")
@click.option("--max-leaf-nodes", type=click.IntRange(min=0), default=0, show_default=True,
              help="Leaf bound of each shipped forest tree (artifact size, latency); 0: unbounded, as shipped.")
@click.option("--kernel-rows", type=click.IntRange(min=0), default=DEFAULT_KERNEL_ROWS, show_default=True,
              help="Tune SVM and KNN on a seeded sample of at most this many training rows (0: all); an SVM's "
                   "fit grows with the square of the rows. The forests always see every row.")
@click.option("--test-fraction", type=FiniteFloat(0.05, 0.5), default=0.2, show_default=True)
@click.option("--real-runs", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Real-run CSV of the same profile to score against (real_runs_qwen.csv format).")
@click.option("--json", "as_json", is_flag=True, help="Print the artifact metadata as JSON.")
@user_errors
def train(datasets, profile_id, policy, policy_params, out, search, models, jobs, trials, penalty, max_leaf_nodes,
          kernel_rows, test_fraction, real_runs, as_json) -> None:
    """Train, evaluate, distil and compile the surrogates of one profile.

    Tunes RF, SVM and KNN (HalvingGridSearchCV, 5-fold) for throughput and starvation, scores them
    on held-out scenarios (and real runs), distils one tree of <= 32 rules per target with Optuna,
    compiles the shipped forests and trees to numba arrays (checked bit-identical to scikit-learn)
    and writes surrogate.npz + surrogate.json. Needs the 'train' extra.
    """
    from models.realruns import load_real_runs
    from models.surrogate import surrogate_dir
    from models.train import train_surrogates
    from twin import load_profile

    if max_leaf_nodes == 1:
        raise click.BadParameter("a tree needs at least 2 leaves (0: unbounded)", param_hint="--max-leaf-nodes")
    profile = load_profile(profile_id)
    policy_spec = policy_from_cli(policy, policy_params)
    names = tuple(m.strip() for m in models.split(",") if m.strip())
    unknown = sorted(set(names) - {"rf", "svm", "knn"})
    if unknown:
        raise click.BadParameter(f"unknown models {unknown}; choose from rf, svm, knn", param_hint="--models")
    runs = load_real_runs(real_runs) if real_runs else None
    out_dir = out or surrogate_dir(profile.profile_id, policy_spec)
    log = (lambda _msg: None) if as_json else (lambda msg: click.echo(msg, err=True))
    meta = train_surrogates(list(datasets), profile, out_dir, search=search, models=names, jobs=jobs, trials=trials,
                            penalty=penalty, test_fraction=test_fraction, max_leaf_nodes=max_leaf_nodes or None,
                            kernel_rows=kernel_rows,
                            real_runs=runs, command="planner " + shlex.join(sys.argv[1:]), log=log,
                            policy=policy_spec)
    if as_json:
        print_json(meta)
        return
    click.echo(f"wrote {out_dir} ({meta['arrays_bytes'] / 1e6:.2f} MB of arrays)")


EPILOG_EDGE = """\b
Examples:
  planner train-edge --profile h100-64gb-llama-3.1-8b --jobs 2
      # -> datasets/<profile>/judged-gpus.{npz,json}, artifacts/surrogates/<profile>/edge.{npz,json}
  planner train-edge --profile h100-64gb-llama-3.1-8b --sizes 2000 --seeds 10 --out /tmp/edge --data /tmp/edge
A judged set made from the same inputs (profile, surrogate, bar, families, sizes, seeds) is reused.
"""


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"a comma-separated list of integers, got {text!r}", param_hint=what) from None
    if not values:
        raise click.BadParameter("give at least one", param_hint=what)
    return values


@click.command("train-edge", epilog=EPILOG_EDGE)
@click.option("--profile", "profile_id", required=True, help="Profile id or JSON path (its surrogate must ship).")
@click.option("--families", default=None, help="Comma-separated workload families [every one of twin.families].")
@click.option("--sizes", default=None, help="Adapters per workload, comma-separated [2000,10000].")
@click.option("--seeds", default=None, help="Workload seeds, comma-separated [10,11,12,13,14: none a benchmark uses].")
@click.option("--rate-scale", type=FiniteFloat(min=0, min_open=True), default=1.0, show_default=True,
              help="Multiply the families' H100-scale rates (for a profile of another speed).")
@click.option("--data", type=click.Path(file_okay=False), default=None,
              help="Directory of the judged-GPU set [datasets/<profile-id>/].")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Directory of edge.npz + edge.json [the surrogate's, artifacts/surrogates/<profile-id>/].")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True, help="Twin worker processes.")
@click.option("--json", "as_json", is_flag=True, help="Print the edge classifier's metadata as JSON.")
@user_errors
def train_edge(profile_id, families, sizes, seeds, rate_scale, data, out, jobs, as_json) -> None:
    """Teach the packer where a GPU passes its twin judging run.

    Plans random fleet workloads as `planner plan` does by default, keeps every GPU the twin judged (its
    features at the load the packer asks about, and the verdict), and fits a forest of the verdict: the
    edge classifier, which `planner plan` and `planner replan` then pack by wherever their SLO is the
    one it learnt or a stricter one. Collecting takes minutes (2 sizes x 5 seeds x 6 families by default). Needs the
    'train' extra.
    """
    from models.edge import save_edge
    from models.surrogate import SurrogatePredictor, surrogate_dir
    from models.train import train_edge
    from planner.judged_gpus import ARRAYS_FILE, DEFAULT_SEEDS, DEFAULT_SIZES, collect_judged, inputs_of, matching_set
    from planner.placement import file_sha256
    from planner.plan import PlanOptions
    from twin import load_profile
    from twin.atomic import recorded_path
    from twin.families import FAMILIES
    from twin.profile import artifacts_dir

    profile = load_profile(profile_id)
    names = tuple(FAMILIES) if families is None else tuple(f.strip() for f in families.split(",") if f.strip())
    unknown = sorted(set(names) - set(FAMILIES))
    if unknown or not names:
        raise click.BadParameter(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}", param_hint="--families")
    sizes = DEFAULT_SIZES if sizes is None else _ints(sizes, "--sizes")
    seeds = DEFAULT_SEEDS if seeds is None else _ints(seeds, "--seeds")
    predictor = SurrogatePredictor(profile, "surrogate", edge=False)
    data_dir = Path(data) if data else artifacts_dir().parent / "datasets" / profile.profile_id
    out_dir = Path(out) if out else surrogate_dir(profile.profile_id)
    log = (lambda _msg: None) if as_json else (lambda msg: click.echo(msg, err=True))
    command = "planner " + shlex.join(sys.argv[1:])
    inputs = inputs_of(profile, predictor, PlanOptions(jobs=jobs), names, sizes, seeds, rate_scale)
    judged = matching_set(data_dir, inputs)
    if judged is None:
        log(f"planning {len(names) * len(sizes) * len(seeds)} random fleets and judging their GPUs in the twin")
        judged = collect_judged(profile, predictor, names, sizes, seeds, jobs, rate_scale, progress=log)
        judged.metadata["command"] = command
        judged.save(data_dir)
        log(f"wrote {data_dir}: {judged.metadata['gpus']} judged GPUs, {judged.metadata['passed']} passed")
    else:
        log(f"using {data_dir}: {judged.metadata['gpus']} judged GPUs made from the same inputs")
    forest, trained = train_edge(judged.X, judged.passed, judged.seed, judged.round == 1, jobs)
    meta = save_edge(out_dir, forest, {
        **{k: inputs[k] for k in ("profile_id", "profile_simulation_hash", "surrogate_arrays_sha256", "bar", "run")},
        "judged_set": {"path": recorded_path(data_dir, artifacts_dir().parent),
                       "sha256": file_sha256(data_dir / ARRAYS_FILE),
                       **{k: judged.metadata[k] for k in ("gpus", "passed")},
                       "inputs": {k: inputs[k] for k in ("families", "sizes", "seeds", "rate_scale")}},
        **trained, "command": command,
    })
    if as_json:
        print_json(meta)
        return
    first = trained["evaluation"]["first_packing"]
    click.echo(f"wrote {out_dir}/edge.npz: held out by seed, AUC {trained['evaluation']['auc']:.3f}; of the first packing's GPUs "
               f"it keeps {first['passed_kept']:.0%} of those that passed and catches {first['failed_caught']:.0%} "
               "of those that failed")

