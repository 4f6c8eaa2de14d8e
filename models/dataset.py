"""Training sets: the twin run over a grid of single-GPU scenarios, one parquet row per scenario.

A grid (:class:`GridSpec`) crosses served-adapter counts, A_max values (≤ served), combinations of
per-adapter rates and combinations (with replacement) of ranks — the study's grid is
``GridSpec.paper()`` (reference-study-notes §4.1). Each scenario spreads its rate and rank
combinations over its adapters round-robin, shuffles them (seeded), draws its mean prompt/output
lengths log-uniformly around the profile's defaults (``length_scale``; so the surrogate learns
the length dependence the study's models ignore), and runs the twin (Poisson arrivals, the
profile's length dispersion, the window convention of ``twin.simulate``). An (A_max,
max_lora_rank) pair the engine cannot start with is recorded as a ``memory_error`` row and not
simulated.

Every random draw of scenario ``i`` comes from ``SeedSequence([grid.seed, i])``, so any row can be
rebuilt alone from its spec and the grid's duration and client cap (``max_in_flight``, in the
metadata). Builds are resumable: rows are flushed in part files under ``<out>.work/`` and a rerun
skips the scenarios already there; scenarios run in a seeded random order, so an interrupted build
is a uniform sample of the grid. The merged parquet carries the grid, the profile id and hash and
the build state in its schema metadata (``lora_planner``).

A build for a serving policy other than stock vLLM (``twin.policies``) runs the twin under it and
records it (``policy``: name and non-preset parameters) in the build state and the metadata; the
key is absent for stock vLLM, so builds made before policies existed read and resume as stock.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import math
import shutil
import signal
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from models.features import N_FEATURES, engine_terms, fill_features
from models.fleet_grid import FleetGrid
from models.surrogate import client_cap, simulation_hash
from twin.atomic import write_bytes_atomic, write_json_atomic
from twin.errors import BadInputError
from twin.policies.memory import kv_capacity
from twin.policies.spec import PolicySpec, policy_label, policy_record
from twin.profile import Profile
from twin.progress import Progress
from twin.simulate import SimConfig, simulate
from twin.workload import Adapter, Workload

#: 2: the SLO targets (``ttft_ms_p99_all``, ``tpot_ms_p99``) and per-adapter lengths; version-1 files read
#: with those targets missing.
DATASET_SCHEMA_VERSION = 2
METADATA_KEY = b"lora_planner"
PAPER_SERVED = (8, 16, 32, 64, 96, 128, 160, 192, 256, 320, 384)
PAPER_RATES = (3.2, 1.6, 0.8, 0.4, 0.1, 0.05, 0.025, 0.0125, 0.00625, 0.003125)
PAPER_RANKS = (8, 16, 32)
TARGETS = ("throughput_tok_s", "arriving_tok_s", "itl_ms", "ttft_ms", "ttft_ms_p99_all", "tpot_ms_p99", "starved")


@dataclass(frozen=True)
class GridSpec:
    """A scenario grid. ``a_max`` values above a scenario's served count are skipped."""

    name: str
    served: tuple[int, ...]
    a_max: tuple[int, ...]
    rates: tuple[float, ...]
    ranks: tuple[int, ...]
    rates_per_scenario: int = 3
    ranks_per_scenario: int = 3
    duration_s: float = 3600.0
    length_scale: tuple[float, float] = (0.5, 2.0)
    seed: int = 0
    max_scenarios: int = 0  # 0: every grid point; else a seeded uniform sample of this many
    #: Client-side cap on requests in flight (twin ``max_in_flight``); 0: none. A capped grid models a
    #: measurement client (the study's held at most 28,232), not production traffic.
    max_in_flight: int = 0

    @classmethod
    def paper(cls, duration_s: float = 3600.0) -> GridSpec:
        return cls("paper", PAPER_SERVED, PAPER_SERVED, PAPER_RATES, PAPER_RANKS, duration_s=duration_s)

    @classmethod
    def small(cls, duration_s: float = 600.0) -> GridSpec:
        """A CI-sized sample of the paper grid (a few minutes on one core)."""
        return cls("small", (8, 16, 32, 64, 128), (8, 16, 32, 64, 128), PAPER_RATES, PAPER_RANKS,
                   duration_s=duration_s, max_scenarios=300)

    @classmethod
    def from_dict(cls, raw: Any, where: str = "grid") -> GridSpec:
        if not isinstance(raw, dict):
            raise BadInputError(f"{where}: a grid must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise BadInputError(f"{where}: unknown grid keys {unknown} (known: {sorted(known)})")
        try:
            d = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
            grid = cls(**d)
        except TypeError as exc:
            raise BadInputError(f"{where}: {exc}") from None
        grid.validate(where)
        return grid

    @classmethod
    def load(cls, name_or_path: str, duration_s: float | None = None, length_scale: tuple[float, float] | None = None,
             max_in_flight: int | None = None) -> GridSpec | FleetGrid:
        """``paper``, ``small``, ``fleet`` or a JSON file with the fields of this class (or, with
        ``"kind": "fleet"``, of :class:`models.fleet_grid.FleetGrid`); the other arguments, where given, replace
        the grid's fields of the same name (the command line's options)."""
        if name_or_path == "fleet":
            grid = FleetGrid()
        elif name_or_path in ("paper", "small"):
            grid = getattr(cls, name_or_path)()
        else:
            path = Path(name_or_path)
            try:
                raw = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise BadInputError(f"--grid {name_or_path}: not 'paper', 'small' or a readable JSON file ({exc})") from None
            kind = FleetGrid if isinstance(raw, dict) and raw.get("kind") == "fleet" else cls
            grid = kind.from_dict({"name": path.stem, **raw}, where=str(path))
        for option, key, value in (("--duration", "duration_s", None if duration_s is None else float(duration_s)),
                                   ("--length-scale", "length_scale", length_scale),
                                   ("--max-in-flight", "max_in_flight", max_in_flight)):
            if value is not None:
                grid = type(grid).from_dict({**grid.to_dict(), key: value}, where=option)
        return grid

    def validate(self, where: str = "grid") -> None:
        def ints(name):
            v = getattr(self, name)
            if not v or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in v):
                raise BadInputError(f"{where}: {name} must be a non-empty list of positive integers")

        for name in ("served", "a_max", "ranks"):
            ints(name)
        if not self.rates or any(not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0 for x in self.rates):
            raise BadInputError(f"{where}: rates must be a non-empty list of finite numbers >= 0")
        if not 1 <= self.rates_per_scenario <= len(self.rates):
            raise BadInputError(f"{where}: rates_per_scenario must be between 1 and len(rates)")
        if self.ranks_per_scenario < 1:
            raise BadInputError(f"{where}: ranks_per_scenario must be >= 1")
        lo, hi = self.length_scale
        if not (0 < lo <= hi and math.isfinite(hi)):
            raise BadInputError(f"{where}: length_scale must be [lo, hi] with 0 < lo <= hi")
        if not self.duration_s > 0:
            raise BadInputError(f"{where}: duration_s must be > 0")
        if isinstance(self.max_in_flight, bool) or not isinstance(self.max_in_flight, int) or self.max_in_flight < 0:
            raise BadInputError(f"{where}: max_in_flight must be an integer >= 0")

    def to_dict(self) -> dict[str, Any]:
        """JSON form; ``max_in_flight`` only when set, so uncapped builds made before it existed resume."""
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        if not d["max_in_flight"]:
            del d["max_in_flight"]
        return d

    def points(self) -> list[tuple[int, int, tuple[float, ...], tuple[int, ...]]]:
        """Every scenario as (served, a_max, rate combination, rank combination), in a fixed order."""
        rate_combos = list(itertools.combinations(self.rates, self.rates_per_scenario))
        rank_combos = list(itertools.combinations_with_replacement(self.ranks, self.ranks_per_scenario))
        pts = [(s, a, rc, kc) for s in self.served for a in self.a_max if a <= s
               for rc in rate_combos for kc in rank_combos]
        if self.max_scenarios and self.max_scenarios < len(pts):
            keep = np.sort(np.random.default_rng(self.seed).choice(len(pts), self.max_scenarios, replace=False))
            pts = [pts[i] for i in keep]
        return pts

    def spec(self, profile: Profile, scenario_id: int, point, policy: PolicySpec | None = None) -> dict[str, Any]:
        return scenario_spec(self, profile, scenario_id, point, policy)


def _spread(values: Sequence, n: int, rng: np.random.Generator) -> np.ndarray:
    """``values`` assigned round-robin to ``n`` adapters, then shuffled."""
    out = np.array([values[i % len(values)] for i in range(n)])
    rng.shuffle(out)
    return out


def scenario_spec(grid: GridSpec, profile: Profile, scenario_id: int, point,
                  policy: PolicySpec | None = None) -> dict[str, Any]:
    """The full spec of one scenario: everything the twin needs, drawn from its own seed."""
    served, a_max, rate_combo, rank_combo = point
    rng = np.random.default_rng(np.random.SeedSequence([grid.seed, scenario_id]))
    ranks = _spread(rank_combo, served, rng).astype(np.int64)
    rates = _spread(rate_combo, served, rng).astype(np.float64)
    lo, hi = np.log(grid.length_scale[0]), np.log(grid.length_scale[1])
    input_tokens = round(float(profile.default_input_tokens * np.exp(rng.uniform(lo, hi))), 1)
    output_tokens = round(float(profile.default_output_tokens * np.exp(rng.uniform(lo, hi))), 1)
    max_lora_rank = profile.kv.rank_for(int(ranks.max()))
    kv_tokens = None if max_lora_rank is None else kv_capacity(profile, policy).tokens_for(a_max, max_lora_rank)
    return {
        "scenario_id": scenario_id, "profile_id": profile.profile_id, "seed": int(rng.integers(2**31)),
        "served_adapters": served, "a_max": a_max, "max_lora_rank": max_lora_rank or 0,
        "ranks": ranks, "rates_rps": rates, "input_tokens": input_tokens, "output_tokens": output_tokens,
        "adapter_input_tokens": np.empty(0), "adapter_output_tokens": np.empty(0),
        "duration_s": grid.duration_s, "kv_tokens": kv_tokens or 0, "memory_error": kv_tokens is None,
    }


def run_scenario(grid: GridSpec | FleetGrid, profile: Profile, scenario_id: int, point, sim_seed_offset: int = 0,
                 policy: PolicySpec | None = None) -> dict[str, Any]:
    """One dataset row: spec and twin targets (NaN targets for a memory error), under serving ``policy``.

    ``sim_seed_offset`` changes only the twin's arrival draws (noise-floor measurements).
    """
    spec = grid.spec(profile, scenario_id, point, policy)
    spec["seed"] += sim_seed_offset
    row = dict(spec)
    nan = float("nan")
    if spec["memory_error"]:
        row.update(throughput_tok_s=nan, arriving_tok_s=nan, itl_ms=nan, ttft_ms=nan, ttft_ms_p99_all=nan,
                   tpot_ms_p99=nan, starved=None,
                   arrived_requests=0, finished_requests=0, preemptions=0, sim_wall_s=0.0)
    else:
        ins, outs = adapter_lengths(spec)
        wl = Workload(tuple(Adapter(f"a{i}", int(r), float(lam), float(ins[i]), float(outs[i]))
                            for i, (r, lam) in enumerate(zip(spec["ranks"], spec["rates_rps"]))))
        res = simulate(wl, profile, SimConfig(a_max=spec["a_max"], duration_s=grid.duration_s, seed=spec["seed"],
                                              max_lora_rank=spec["max_lora_rank"], policy=policy,
                                              max_in_flight=grid.max_in_flight))
        row.update(throughput_tok_s=res.total_throughput_tok_s, arriving_tok_s=res.arriving_tok_s,
                   itl_ms=res.itl_ms_mean, ttft_ms=res.ttft_ms_mean, ttft_ms_p99_all=res.ttft_ms_p99_all,
                   tpot_ms_p99=res.tpot_ms_p99, starved=res.starved,
                   arrived_requests=res.arrived_requests, finished_requests=res.finished_requests,
                   preemptions=res.preemptions, sim_wall_s=res.sim_wall_s)
    for key in ("ranks", "rates_rps", "adapter_input_tokens", "adapter_output_tokens"):
        row[key] = spec[key].tolist()
    return row


def adapter_lengths(spec: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Per-adapter mean prompt and output tokens of a scenario spec or dataset row: its own lists where it
    has them (fleet grids), else the scenario's one pair for every adapter."""
    n = int(spec["served_adapters"])
    per = spec.get("adapter_input_tokens")
    if per is not None and len(per):
        return np.asarray(per, np.float64), np.asarray(spec["adapter_output_tokens"], np.float64)
    return np.full(n, float(spec["input_tokens"])), np.full(n, float(spec["output_tokens"]))


def _run_chunk(grid: GridSpec | FleetGrid, profile: Profile, items: list[tuple[int, Any]],
               policy: PolicySpec | None) -> list[dict[str, Any]]:
    return [run_scenario(grid, profile, sid, point, policy=policy) for sid, point in items]


def _schema():
    import pyarrow as pa

    cols = [
        ("scenario_id", pa.int64()), ("profile_id", pa.string()), ("seed", pa.int64()),
        ("served_adapters", pa.int32()), ("a_max", pa.int32()), ("max_lora_rank", pa.int32()),
        ("ranks", pa.list_(pa.int16())), ("rates_rps", pa.list_(pa.float64())),
        ("input_tokens", pa.float64()), ("output_tokens", pa.float64()),
        ("adapter_input_tokens", pa.list_(pa.float64())), ("adapter_output_tokens", pa.list_(pa.float64())),
        ("duration_s", pa.float64()), ("kv_tokens", pa.int64()), ("memory_error", pa.bool_()),
        ("throughput_tok_s", pa.float64()), ("arriving_tok_s", pa.float64()), ("itl_ms", pa.float64()),
        ("ttft_ms", pa.float64()), ("ttft_ms_p99_all", pa.float64()), ("tpot_ms_p99", pa.float64()),
        ("starved", pa.bool_()), ("arrived_requests", pa.int64()),
        ("finished_requests", pa.int64()), ("preemptions", pa.int64()), ("sim_wall_s", pa.float64()),
    ]
    return pa.schema(cols)


def _table_bytes(table) -> bytes:
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", compression_level=9)
    return buf.getvalue()


def _require_pyarrow():
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise BadInputError("datasets need pyarrow: pip install 'lora-planner[train]'") from None


def _map_local(tasks: list, jobs: int) -> Iterator[list[dict]]:
    if jobs == 1:
        for t in tasks:
            yield _run_chunk(*t)
        return
    from joblib import Parallel, delayed

    yield from Parallel(n_jobs=jobs, return_as="generator_unordered")(delayed(_run_chunk)(*t) for t in tasks)


def _map_ray(tasks: list, address: str | None) -> Iterator[list[dict]]:
    try:
        import ray
    except ImportError:
        raise BadInputError("--backend ray needs Ray on this machine and the cluster: pip install 'ray[default]' "
                            "(it is not a dependency of lora-planner)") from None
    ray.init(address=address, ignore_reinit_error=True)
    remote = ray.remote(_run_chunk)
    pending = [remote.remote(*t) for t in tasks]
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        yield ray.get(done[0])


@dataclass
class BuildResult:
    out: Path
    total: int
    done: int
    new_rows: int
    memory_errors: int
    wall_s: float
    sim_s: float
    complete: bool
    interrupted: bool = False

    @property
    def rows_per_hour(self) -> float:
        return self.new_rows / self.wall_s * 3600.0 if self.wall_s > 0 else float("nan")


class _StopRequest:
    """Ctrl-C / SIGTERM during a build set a flag, checked between chunks (a signal raised inside
    the numba twin would surface as a SystemError instead of a clean stop)."""

    def __init__(self):
        self.stop = False
        self._previous: dict[int, object] = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, _signum, _frame):
        self.stop = True

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


def work_dir_for(out: Path) -> Path:
    return out.with_name(out.name + ".work")


def _open_work_dir(work: Path, state: dict[str, Any]) -> set[int]:
    """Create or reuse the work dir; return the scenario ids already done. Refuses a different build.

    Only the keys of ``state`` are compared (older work dirs hold more), plus ``policy``, whose
    absence on either side means stock vLLM.
    """
    import pyarrow.parquet as pq

    spec_path = work / "build.json"
    if spec_path.is_file():
        old = json.loads(spec_path.read_text(encoding="utf-8"))
        keys = {*state, "policy"}
        differ = sorted(k for k in keys if old.get(k) != state.get(k))
        if "grid" in differ:  # name the grid fields (a different --max-in-flight, say)
            grids = old.get("grid") or {}, state["grid"]
            differ.remove("grid")
            differ += [f"grid.{k}" for k in sorted({*grids[0], *grids[1]}) if grids[0].get(k) != grids[1].get(k)]
        if differ:
            raise BadInputError(f"{work} holds an unfinished build of another grid or profile (it differs in "
                                f"{', '.join(differ)}); delete it or use another --out")
    else:
        work.mkdir(parents=True, exist_ok=True)
        write_json_atomic(spec_path, state)
    done: set[int] = set()
    for part in sorted(work.glob("part-*.parquet")):
        done.update(pq.read_table(part, columns=["scenario_id"]).column(0).to_pylist())
    return done


def build_dataset(profile: Profile, grid: GridSpec | FleetGrid, out: str | Path, jobs: int = 1, backend: str = "local",
                  address: str | None = None, limit: int = 0, chunk: int = 8, flush_rows: int = 400,
                  progress: bool = True, policy: PolicySpec | None = None) -> BuildResult:
    """Run (or resume) the build of ``grid`` for ``profile`` under serving ``policy`` (None: stock) into ``out``.

    ``limit`` > 0 stops once that many scenarios are done in total; the parquet then holds the
    rows done so far and ``<out>.work/`` stays for a later run to continue. Ctrl-C and SIGTERM
    do the same (rows still in memory are flushed first).
    """
    _require_pyarrow()
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    work = work_dir_for(out)
    state = {"dataset_schema_version": DATASET_SCHEMA_VERSION, "profile_id": profile.profile_id,
             "profile_hash": simulation_hash(profile, policy), "grid": grid.to_dict()}
    if policy is not None:
        state["policy"] = policy_record(policy)
    points = grid.points()
    total = len(points)
    done = _open_work_dir(work, state)
    order = np.random.default_rng(np.random.SeedSequence([grid.seed, 2**32 - 1, 0])).permutation(total)
    todo = [int(i) for i in order if int(i) not in done]
    if limit:
        todo = todo[:max(0, limit - len(done))]
    tasks = [(grid, profile, [(sid, points[sid]) for sid in todo[i:i + chunk]], policy)
             for i in range(0, len(todo), chunk)]
    results = _map_ray(tasks, address) if backend == "ray" else _map_local(tasks, jobs)
    bar = Progress(total, f"{profile.profile_id}/{grid.name}", done=len(done), unit="scenario", enabled=progress)
    schema = _schema()
    buffer: list[dict] = []
    t0 = time.monotonic()
    sim_s = 0.0
    new_rows = 0
    next_part = len(list(work.glob("part-*.parquet")))

    def flush():
        nonlocal next_part
        if buffer:
            table = pa.Table.from_pylist(buffer, schema=schema)
            write_bytes_atomic(work / f"part-{next_part:06d}.parquet", _table_bytes(table))
            next_part += 1
            buffer.clear()

    with _StopRequest() as request:
        try:
            for rows in results:
                buffer.extend(rows)
                new_rows += len(rows)
                sim_s += sum(r["sim_wall_s"] for r in rows)
                bar.advance(len(rows))
                if len(buffer) >= flush_rows:
                    flush()
                if request.stop:
                    break
        except Exception:
            if not request.stop:  # a worker killed by the same Ctrl-C is a stop, anything else is not
                raise
        finally:
            flush()
        interrupted = request.stop
    bar.close()
    parts = sorted(work.glob("part-*.parquet"))
    table = (pa.concat_tables([pq.read_table(p, columns=schema.names).cast(schema) for p in parts]) if parts
             else schema.empty_table())
    table = table.sort_by("scenario_id")
    n_done = table.num_rows
    complete = n_done == total
    meta = {**state, "rows": n_done, "grid_scenarios": total, "complete": complete,
            "memory_error_rows": int(np.sum(table.column("memory_error").to_numpy(zero_copy_only=False)))}
    table = table.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()})
    write_bytes_atomic(out, _table_bytes(table))
    if complete:
        shutil.rmtree(work)
    return BuildResult(out, total, n_done, new_rows, meta["memory_error_rows"], time.monotonic() - t0, sim_s, complete,
                       interrupted)


@dataclass
class Dataset:
    """A loaded training set: the feature matrix, the targets and the build metadata."""

    X: np.ndarray  # float64 (rows, FEATURES), memory-error rows removed
    throughput: np.ndarray
    arriving: np.ndarray
    starved: np.ndarray  # bool
    scenario_id: np.ndarray
    metadata: dict[str, Any]
    sha256: str
    #: p99 TTFT over every arrival (SimResult.ttft_ms_p99_all) and p99 TPOT; NaN in rows of schema-1 files
    ttft_ms_p99_all: np.ndarray | None = None
    tpot_ms_p99: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.X.shape[0])


def read_dataset(paths: Iterable[str | Path], profile: Profile, policy: PolicySpec | None = None) -> Dataset:
    """Load dataset parquet files built with ``profile`` under ``policy``; features are computed here from
    each row's spec.

    Rows store scenarios, not features, so a new feature needs no rebuild, only a retrain.
    """
    _require_pyarrow()
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    parts, metas, paths_seen = [], [], []
    digest = hashlib.sha256()
    for path in paths:
        path = Path(path)
        try:
            names = set(pq.read_schema(path).names)
            table = pq.read_table(path, columns=[c for c in (*_SPEC_COLUMNS, *_TARGET_COLUMNS) if c in names])
        except (OSError, ValueError, KeyError) as exc:
            raise BadInputError(f"{path}: not a readable dataset parquet ({exc})") from None
        missing = [c for c in (*_SPEC_COLUMNS, *_TARGET_COLUMNS) if c not in names and c not in _SINCE_SCHEMA_2]
        if missing:
            raise BadInputError(f"{path}: not a dataset parquet (no column {missing[0]})")
        raw = (table.schema.metadata or {}).get(METADATA_KEY)
        if raw is None:
            raise BadInputError(f"{path}: no lora_planner metadata; build it with `planner dataset build`")
        meta = json.loads(raw)
        if meta["profile_id"] != profile.profile_id:
            raise BadInputError(f"{path}: built for profile {meta['profile_id']}, not {profile.profile_id}")
        if meta.get("policy") != policy_record(policy):
            raise BadInputError(f"{path}: built for serving policy {policy_label(meta.get('policy'))}, "
                                f"not {policy_label(policy_record(policy))}")
        if metas and client_cap([meta]) != client_cap(metas[:1]):
            raise BadInputError(f"{path}: built with a client cap of {client_cap([meta])} requests in flight, "
                                f"{paths_seen[0]} with {client_cap(metas[:1])} (0: none); train on datasets of one client")
        if meta["profile_hash"] != simulation_hash(profile, policy):
            raise BadInputError(f"{path}: built with another version of profile {profile.profile_id} (simulation "
                                f"hash {meta['profile_hash']}, now {simulation_hash(profile, policy)}); rebuild it")
        digest.update(path.read_bytes())
        paths_seen.append(path)
        table = table.filter(pc.invert(table.column("memory_error")))
        for name in _SINCE_SCHEMA_2:  # schema-1 files: no per-adapter lengths, no SLO targets
            if name not in names:
                empty = [[]] * table.num_rows if name.startswith("adapter_") else [float("nan")] * table.num_rows
                table = table.append_column(name, pa.array(empty, _schema().field(name).type))
        parts.append(table)
        metas.append(meta)
    if not parts:
        raise BadInputError("no dataset given")
    cols = {name: [v for t in parts for v in t.column(name).to_pylist()] for name in _SPEC_COLUMNS + _LENGTH_COLUMNS}
    terms = engine_terms(profile)
    X = np.empty((len(cols["scenario_id"]), N_FEATURES))
    for i in range(X.shape[0]):
        ins, outs = adapter_lengths({name: values[i] for name, values in cols.items()})
        fill_features(terms, np.asarray(cols["ranks"][i], np.int64), np.asarray(cols["rates_rps"][i], np.float64),
                      ins, outs, cols["a_max"][i], cols["max_lora_rank"][i], float(cols["kv_tokens"][i]), X[i])

    def target(name, dtype):
        return np.concatenate([t.column(name).to_numpy(zero_copy_only=False) for t in parts]).astype(dtype)

    return Dataset(X, target("throughput_tok_s", np.float64), target("arriving_tok_s", np.float64),
                   target("starved", bool), np.asarray(cols["scenario_id"], np.int64),
                   {"profile_id": profile.profile_id, "profile_hash": metas[0]["profile_hash"], "files": metas},
                   digest.hexdigest(), target("ttft_ms_p99_all", np.float64), target("tpot_ms_p99", np.float64))


_SPEC_COLUMNS = ("scenario_id", "served_adapters", "a_max", "max_lora_rank", "ranks", "rates_rps", "input_tokens",
                 "output_tokens", "kv_tokens")
_LENGTH_COLUMNS = ("adapter_input_tokens", "adapter_output_tokens")
_TARGET_COLUMNS = ("memory_error", "throughput_tok_s", "arriving_tok_s", "starved", "ttft_ms_p99_all", "tpot_ms_p99",
                   *_LENGTH_COLUMNS)
_SINCE_SCHEMA_2 = ("ttft_ms_p99_all", "tpot_ms_p99", *_LENGTH_COLUMNS)
