"""Twin vs real vLLM on workloads the profile was not fitted on.

:func:`validation_cases` draws a set of Poisson workloads (adapters, ranks, skewed rates, lengths,
A_max) whose offered load spans light to overloaded, sized with the twin's own saturation estimate
so that some starve and some do not; with a small KV cache some are memory-limited (preemptions): an
explicit one (``Validator.kv_cache_bytes``, ``planner validate --kv-cache-memory-bytes``) makes a GPU's
workloads memory-limited within a 30-second run, and the twin replays them with the same KV.
Each case runs on a real engine (one engine per (A_max, max_lora_rank), serving a pool of
synthetic adapters) and through the twin with the very same requests (trace replay), under the same
window convention: arrivals over [0, duration), measurement window [warmup, duration], requests
unfinished at ``duration`` not counted. Each case's result is saved as it completes (a rerun
resumes); :func:`report` writes the table (JSON + CSV) and a PNG of twin vs real.
:func:`stored_rows` reads the saved cases back, so ``planner rescore`` recomputes the table from
stored runs without vLLM; :func:`compare` recomputes the real figures too, from the stored requests and
metrics, so run sets of any date are scored under today's definitions.
"""

from __future__ import annotations

import csv
import io
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from serving_harness.calibration import (
    RecordedRun,
    calibration_run_dirs,
    recorded_run,
    saved_cases,
    stored_workloads,
    twin_result,
)
from serving_harness.engine import Engine, EngineConfig
from serving_harness.lease import Lease
from serving_harness.loadgen import measure, run_load, summarise
from serving_harness.metrics import wait_idle
from serving_harness.speed_probe import real_probe_itl_ms, speed_vs_profile
from serving_harness.synth import model_shape, write_adapters
from serving_harness.window import run_window
from twin.atomic import json_safe, recorded_path, write_bytes_atomic, write_json_atomic, write_text_atomic
from twin.errors import BadInputError, EngineStartError
from twin.metrics import smape, smape_within_groups
from twin.profile import Profile, artifacts_dir, profiles_dir, write_profile
from twin.simulate import SimConfig, simulate
from twin.workload import Adapter, LengthModel, Workload, draw_requests

POOL_PER_RANK = 12
#: Seconds a validation workload takes beyond its duration (speed probes, waiting for the engine to idle).
CASE_OVERHEAD_S = 30.0


def _kv_words(kv: dict | None) -> str:
    return f" with a {kv['bytes']}-byte KV cache" if kv else ""


def engine_groups(ranks: tuple[int, ...], memory_limited: bool = False) -> list[tuple[int, int]]:
    """(A_max, max_lora_rank) engine groups the cases are spread over: 1–8 slots, the largest and
    smallest profiled ranks; for ``memory_limited`` sets the most slots first (KV binds where many adapters
    run at once)."""
    top, low = max(ranks), min(ranks)
    groups = [(1, top), (2, low), (4, top), (8, top), (4, low)]
    return sorted(groups, key=lambda g: -g[0]) if memory_limited else groups


@dataclass(frozen=True)
class ValidationCase:
    case_id: str
    a_max: int
    max_lora_rank: int
    adapters: tuple[Adapter, ...]
    lengths: str  # constant | lognormal
    load_factor: float  # offered / twin-estimated saturation throughput
    seed: int

    @property
    def workload(self) -> Workload:
        return Workload(self.adapters)

    def length_model(self) -> LengthModel:
        return LengthModel.lognormal(0.5) if self.lengths == "lognormal" else LengthModel()


def saturation_tok_s(profile: Profile, a_max: int, rank: int, n_adapters: int, in_tok: float, out_tok: float,
                     sweep: bool = False) -> float:
    """The twin's throughput for a heavily overloaded server (200 req/s; the scale for offered loads). With
    ``sweep``, the most it serves at 200 req/s halved down to about 3: a server whose KV cache binds serves
    less under a flood than at its knee (requests preempted and admitted again)."""
    rates = 200.0 / 2.0 ** np.arange(7 if sweep else 1)
    out = 0.0
    for rate in rates:
        wl = Workload(tuple(Adapter(f"r{rank}-{i}", rank, rate / n_adapters, in_tok, out_tok)
                            for i in range(n_adapters)))
        res = simulate(wl, profile, SimConfig(a_max=a_max, duration_s=20.0, warmup_s=5.0, max_lora_rank=rank))
        out = max(out, res.total_throughput_tok_s)
    return out


def validation_cases(profile: Profile, n: int, seed: int = 2024, engines: int = 0,
                     memory_limited: bool = False) -> list[ValidationCase]:
    """``n`` cases over the engine groups (the first ``engines`` of them; 0: all), load factors spread over
    [0.3, 1.8]; ``memory_limited`` (a small explicit KV cache): requests up to four times as long, so that the
    running requests fill the KV cache, and loads scaled to the most the twin serves (``saturation_tok_s``'s
    sweep)."""
    rng = np.random.default_rng(seed)
    cases = []
    loads = rng.permutation(np.linspace(0.3, 1.8, n))
    ranks = sorted(profile.kv.lora_ranks)
    groups = [g for g in engine_groups(profile.kv.lora_ranks, memory_limited)
              if profile.kv.tokens_for(*g) is not None][:engines or None]  # those the profile says start
    # up to 4 x, as far as the longest request (256 + 64 tokens) still fits the engine's context
    longer = min(4, max(1, profile.engine.max_model_len // 320)) if memory_limited else 1
    for i in range(n):
        a_max, max_rank = groups[i % len(groups)]
        n_ad = int(rng.choice([2, 3, 4, 6, 8, 12]))
        in_tok = float(rng.choice([32, 64, 128, 256])) * longer
        out_tok = float(rng.choice([16, 32, 64])) * longer
        usable = [r for r in ranks if r <= max_rank]
        ad_ranks = rng.choice(usable, n_ad)
        ad_ranks[0] = max_rank  # the group's max_lora_rank is needed by the workload
        weights = rng.dirichlet(np.full(n_ad, 0.8))
        sat = saturation_tok_s(profile, a_max, max_rank, n_ad, in_tok, out_tok, sweep=memory_limited)
        total_rps = loads[i] * sat / (in_tok + out_tok)
        used = {r: 0 for r in ranks}
        adapters = []
        for rank, w in zip(ad_ranks, weights):
            adapters.append(Adapter(f"r{rank}-{used[rank]}", int(rank), float(total_rps * w), in_tok, out_tok))
            used[rank] += 1
        cases.append(ValidationCase(f"v{i:02d}", a_max, max_rank, tuple(adapters),
                                    str(rng.choice(["constant", "lognormal"])), float(loads[i]), seed * 1000 + i))
    return cases


@dataclass
class Validator:
    """Runs cases on real engines and on the twin; results under ``work_dir/cases``."""

    profile: Profile
    model_dir: str
    work_dir: Path
    duration_s: float = 30.0
    warmup_s: float = 5.0
    python: str | None = None
    report_progress: Callable[[int, int, str], None] = lambda done, total, label: None
    gpu: int | None = None  # CUDA device index; None: the one a CUDA profile was measured on
    probe: bool = True  # speed probes around each case (calibration runs go without)
    deadline: float | None = None  # epoch seconds: stop (OutOfTimeError) before an engine or case that would not finish
    engines: int = 0  # spread the cases over the first this many engine groups (0: all of engine_groups)
    # Start every engine with this KV cache (vLLM's --kv-cache-memory-bytes), small enough that the workloads
    # are limited by KV memory (preemptions); the twin runs with the same KV. None: the profile's engine.
    kv_cache_bytes: int | None = None

    @cached_property
    def kv_cache(self) -> dict | None:
        """The explicit KV cache of this work dir's engines: its bytes and the tokens they hold (whole blocks of
        the model's KV bytes per token); None without ``kv_cache_bytes``."""
        if self.kv_cache_bytes is None:
            return None
        block = self.profile.engine.block_size
        tokens = self.kv_cache_bytes // (model_shape(self.model_dir).kv_bytes_per_token * block) * block
        if tokens < self.profile.engine.max_model_len:
            raise BadInputError(f"--kv-cache-memory-bytes {self.kv_cache_bytes} holds {tokens} KV tokens of this "
                                f"model, fewer than one {self.profile.engine.max_model_len}-token sequence: vLLM "
                                "would not start")
        return {"bytes": self.kv_cache_bytes, "tokens": int(tokens)}

    def sized_profile(self) -> Profile:
        """The profile the workloads are sized with: with the explicit KV cache where one is set."""
        kv = self.kv_cache
        return self.profile if kv is None else self.profile.with_kv_tokens(kv["tokens"], kv["bytes"])

    def _adapter_pool(self, max_rank: int) -> dict[str, str]:
        shape = model_shape(self.model_dir)
        root = self.work_dir / "adapters"
        names = {f"r{r}-{i}": r for r in self.profile.kv.lora_ranks if r <= max_rank for i in range(POOL_PER_RANK)}
        missing = {k: v for k, v in names.items() if not (root / k / "adapter_config.json").is_file()}
        if missing:
            write_adapters(root, shape, missing, base_model=self.model_dir, seed=7)
        return {k: str(root / k) for k in names}

    def engine_config(self, a_max: int, max_rank: int) -> EngineConfig:
        """The profiled engine's settings; device, GPU (unless ``gpu`` is set), memory share and load format
        come from the measured profile's ``provenance.spec``."""
        e = self.profile.engine
        measured = self.profile.provenance.get("spec", {})
        pool = self._adapter_pool(max_rank)
        return EngineConfig(
            model=self.model_dir, adapters=tuple(pool.items()), max_loras=a_max, max_lora_rank=max_rank,
            max_cpu_loras=len(pool), max_num_batched_tokens=e.max_num_batched_tokens, max_num_seqs=e.max_num_seqs,
            max_model_len=e.max_model_len, kv_cache_bytes=self.kv_cache_bytes or e.kv_cache_bytes,
            device=measured.get("device", "cpu"),
            gpu=measured.get("gpu") if self.gpu is None else self.gpu,
            gpu_memory_utilization=measured.get("gpu_memory_utilization"),
            load_format=measured.get("load_format", "auto"),
        )

    def workload_set(self, n: int, seed: int) -> list[ValidationCase]:
        """This work dir's workloads: drawn once (sized with the profile of that time), reused on reruns."""
        path = self.work_dir / "workloads.json"
        kv = self.kv_cache
        if path.is_file():
            saved = stored_workloads(self.work_dir)
            if (saved["count"], saved["seed"], saved.get("engines", 0), saved.get("kv_cache")) != (
                    n, seed, self.engines, kv):
                raise BadInputError(f"{self.work_dir} holds runs of {saved['count']} workloads with seed "
                                    f"{saved['seed']} on {saved.get('engines') or 'all'} engine groups"
                                    f"{_kv_words(saved.get('kv_cache'))}; use another work dir for {n} with seed "
                                    f"{seed} on {self.engines or 'all'}{_kv_words(kv)}")
            return [ValidationCase(**{**c, "adapters": tuple(Adapter(**a) for a in c["adapters"])})
                    for c in saved["cases"]]
        cases = validation_cases(self.sized_profile(), n, seed, self.engines, memory_limited=kv is not None)
        write_json_atomic(path, {"count": n, "seed": seed, **({"engines": self.engines} if self.engines else {}),
                                 **({"kv_cache": kv} if kv else {}), "cases": [asdict(c) for c in cases]})
        return cases

    def adopt_workloads(self, saved: dict, source_dir: str | os.PathLike) -> None:
        """Run the workloads ``saved`` (:func:`stored_workloads` of ``source_dir``) here, the very same requests
        again: how far two real runs differ, or calibration runs redone on today's machine."""
        path = self.work_dir / "workloads.json"
        if not path.is_file():
            write_json_atomic(path, saved)
        elif stored_workloads(self.work_dir) != saved:
            raise BadInputError(f"{self.work_dir} holds runs of other workloads than {source_dir}; use another work dir")

    def _case_path(self, case: ValidationCase) -> Path:
        return self.work_dir / "cases" / f"{case.case_id}.json"

    def run(self, cases: list[ValidationCase]) -> list[dict]:
        groups: dict[tuple[int, int], list[ValidationCase]] = {}
        for c in cases:
            groups.setdefault((c.a_max, c.max_lora_rank), []).append(c)
        done = sum(self._case_path(c).is_file() for c in cases)
        lease = Lease(self.work_dir, self.profile.provenance.get("spec", {}).get("device", "cpu"), self.deadline)
        case_s = self.duration_s + CASE_OVERHEAD_S
        for (a_max, rank), group in groups.items():
            todo = [c for c in group if not self._case_path(c).is_file()]
            if not todo:
                continue
            kwargs = {"python": self.python} if self.python else {}
            name = f"engine-a{a_max}-r{rank}"
            with Engine(self.engine_config(a_max, rank), self.work_dir / "logs" / f"{name}.log", **kwargs) as engine:
                lease.need(lease.start_estimate_s() + case_s, f"starting validation {name}")
                started = engine.start()
                lease.record_start(name, started.startup_s, started.status)
                if not started.ok:
                    raise EngineStartError(f"validation engine A_max {a_max} rank {rank} did not start "
                                           f"({started.status}): {started.message} (log: {started.log_path}); the "
                                           "workloads run are kept: fix that, then rerun the same command")
                self._warm_up(engine.base_url, todo[0])
                for case in todo:
                    lease.need(case_s, f"workload {case.case_id}")
                    write_json_atomic(self._case_path(case),
                                      {**self.run_case(engine.base_url, case), "engine_kv_tokens": started.kv_tokens})
                    done += 1
                    self.report_progress(done, len(cases), case.case_id)
        return [json.loads(self._case_path(c).read_text(encoding="utf-8")) for c in cases]

    def _warm_up(self, base_url: str, case: ValidationCase) -> None:
        """A few untimed requests so the first case does not pay the engine's first-step costs."""
        wl = Workload(tuple(Adapter(a.adapter_id, a.rank, 2.0, 32, 8) for a in case.adapters))
        requests = draw_requests(wl, 3.0, seed=0)
        run_load(base_url, requests, [a.adapter_id for a in wl.adapters], 3.0,
                 vocab_size=model_shape(self.model_dir).vocab_size, drain_s=30.0)

    def run_case(self, base_url: str, case: ValidationCase) -> dict:
        p = self.profile
        requests = draw_requests(case.workload, self.duration_s, case.seed, lengths=case.length_model(),
                                 default_input_tokens=p.default_input_tokens,
                                 default_output_tokens=p.default_output_tokens)
        vocab = model_shape(self.model_dir).vocab_size
        probe = case.adapters[0]
        # Each case keeps its own probes (before and after), so a resumed run scores every case alike.
        probes = [self._probe(base_url, probe, vocab)]
        wait_idle(base_url)
        load_before = os.getloadavg()[0]
        records, series = measure(base_url, requests, [a.adapter_id for a in case.adapters], self.duration_s,
                                  vocab_size=vocab)
        load_after = os.getloadavg()[0]
        probes.append(self._probe(base_url, probe, vocab))
        raw_dir = self.work_dir / "runs"
        records.to_parquet(raw_dir / f"{case.case_id}-requests.parquet")
        series.to_parquet(raw_dir / f"{case.case_id}-metrics.parquet")
        real = summarise(records, self.duration_s, self.warmup_s)
        preempt = series.column("preemptions")
        return {
            "case_id": case.case_id, "a_max": case.a_max, "max_lora_rank": case.max_lora_rank,
            "adapters": len(case.adapters), "adapter_ids": [a.adapter_id for a in case.adapters],
            "ranks": [a.rank for a in case.adapters],
            "rates_rps": [round(a.rate_rps, 4) for a in case.adapters], "input_tokens": case.adapters[0].input_tokens,
            "output_tokens": case.adapters[0].output_tokens, "lengths": case.lengths,
            "load_factor": case.load_factor, "seed": case.seed,
            "duration_s": self.duration_s, "warmup_s": self.warmup_s,  # the window it was measured in
            "real": asdict(real),
            "real_preemptions": float(np.nanmax(preempt) - np.nanmin(preempt)) if preempt.size else None,
            "real_max_waiting_deferred": float(np.nanmax(series.column("waiting_deferred"))) if preempt.size else None,
            # Other work on the machine slows a CPU engine: the 1-minute load average around the run.
            "loadavg_1m": [round(load_before, 2), round(load_after, 2)],
            # The engine's speed of the moment (serving_harness/speed_probe.py), right before and after.
            **({"probe": {"adapter": probe.adapter_id, "rank": probe.rank, "itl_ms": probes}} if self.probe else {}),
        }

    def _probe(self, base_url: str, adapter: Adapter, vocab_size: int) -> float | None:
        """The probe's ITL (None when probes are off or none finished)."""
        return real_probe_itl_ms(base_url, adapter.adapter_id, adapter.rank, vocab_size) if self.probe else None

    def compare(self, rows: list[dict]) -> list[dict]:
        return compare(self.profile, self.work_dir, rows, self.duration_s, self.warmup_s)


def compare(profile: Profile, work_dir: Path, rows: list[dict], duration_s: float, warmup_s: float) -> list[dict]:
    """``rows`` (saved cases of ``work_dir``) with the twin's figures for the very same requests
    (recomputed: cheap, and a new profile version can be scored against the same real runs)."""
    runs = [recorded_run(work_dir, row, duration_s, warmup_s) for row in rows]
    return [{**row, "real": run.real, "twin": twin_result(profile, run, duration_s, warmup_s),
             **(at_probe_speed(profile, row, run, duration_s, warmup_s) if probed(row) else {})}
            for row, run in zip(rows, runs)]


def probed(row: dict) -> bool:
    """Whether a saved case has both speed probes (older run sets have none; a probe may have failed)."""
    return "probe" in row and all(v is not None for v in row["probe"]["itl_ms"])


def at_probe_speed(profile: Profile, row: dict, run: RecordedRun, duration_s: float, warmup_s: float) -> dict:
    """The twin at the speed the probes around the case measured: ``speed`` (the probes, the twin's probe
    ITL and their ratio, from the geometric mean of the real probes) and ``twin_at_speed`` (its figures)."""
    probe = row["probe"]
    factor, twin_probe = speed_vs_profile(profile, probe["adapter"], probe["rank"], row["a_max"], row["max_lora_rank"],
                                          probe["itl_ms"])
    return {"speed": {"real_probe_itl_ms": probe["itl_ms"], "twin_probe_itl_ms": twin_probe, "factor": factor},
            "twin_at_speed": twin_result(profile.slowed(factor), run, duration_s, warmup_s)}


METRICS = (("throughput", "total_throughput_tok_s"), ("itl", "itl_ms_mean"), ("ttft", "ttft_ms_mean"))


def engine_label(case: dict) -> str:
    """The engine a case ran on: one per (A_max, max_lora_rank) in a work dir."""
    return f"a{case['a_max']}-r{case['max_lora_rank']}"


def summary_table(rows: list[dict]) -> dict:
    """SMAPEs overall and per real regime (starved / not), starved agreement, counts."""
    real_starved = np.array([r["real"]["starved"] for r in rows])
    twin_starved = np.array([r["twin"]["starved"] for r in rows])
    out = {"cases": len(rows), "real_starved": int(real_starved.sum()),
           "starved_agreement_pct": float(100.0 * np.mean(real_starved == twin_starved)) if rows else float("nan")}
    for regime, mask in (("all", np.ones(len(rows), bool)), ("starved", real_starved),
                         ("not_starved", ~real_starved)):
        for name, key in METRICS:
            pred = np.array([r["twin"][key] for r in rows], float)[mask]
            real = np.array([r["real"][key] for r in rows], float)[mask]
            out[f"{name}_smape_pct_{regime}"] = smape(pred, real)
    # Each engine runs at its own speed on a shared CPU VM: the ITL error left once every engine's mean
    # twin/real ratio is divided out (one scale per engine, fitted on these very cases: a diagnostic).
    twin_itl, real_itl = (np.array([r[side]["itl_ms_mean"] for r in rows], float) for side in ("twin", "real"))
    out["itl_smape_pct_within_engines"] = smape_within_groups(twin_itl, real_itl, [engine_label(r) for r in rows])
    # The ITL the engine core timed (runs whose metrics kept it): how far the client's timing is off it,
    # and the twin against it.
    engine = np.array([r["real"].get("itl_ms_engine", np.nan) for r in rows], float)
    out["itl_engine_cases"] = int(np.isfinite(engine).sum())
    out["itl_client_vs_engine_smape_pct"] = smape(real_itl, engine)
    out["itl_engine_smape_pct_all"] = smape(twin_itl, engine)
    # The twin at the speed probed around each case: how much of the error the machine's speed of the
    # moment explains (the probes are measured apart from the case, so this is no fit to the scored cases).
    scaled = [r for r in rows if "twin_at_speed" in r]
    out["probe_cases"] = len(scaled)
    if scaled:
        out["starved_agreement_pct_at_probe_speed"] = float(100.0 * np.mean(
            [r["real"]["starved"] == r["twin_at_speed"]["starved"] for r in scaled]))
        for name, key in METRICS:
            out[f"{name}_smape_pct_at_probe_speed"] = smape(
                np.array([r["twin_at_speed"][key] for r in scaled], float),
                np.array([r["real"][key] for r in scaled], float))
        factors = [r["speed"]["factor"] for r in scaled]
        out["probe_speed_factor_range"] = [min(factors), max(factors)]
    return out


def table_rows(rows: list[dict]) -> list[dict]:
    """Flat rows (one per case) for the CSV."""
    flat = []
    for r in rows:
        row = {k: r[k] for k in ("case_id", "a_max", "max_lora_rank", "adapters", "input_tokens", "output_tokens",
                                 "lengths", "load_factor", "real_preemptions")}
        for name, key in (*METRICS, ("arriving", "arriving_tok_s"), ("starved", "starved")):
            row[f"real_{name}"] = r["real"][key]
            row[f"twin_{name}"] = r["twin"][key]
        row["real_itl_engine"] = r["real"].get("itl_ms_engine", float("nan"))
        row["probe_speed_factor"] = r["speed"]["factor"] if "twin_at_speed" in r else float("nan")
        for name, key in METRICS:
            row[f"twin_{name}_at_probe_speed"] = r["twin_at_speed"][key] if "twin_at_speed" in r else float("nan")
        flat.append(row)
    return flat


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    starved = np.array([r["real"]["starved"] for r in rows])
    for ax, (name, key) in zip(axes, METRICS):
        real = np.array([r["real"][key] for r in rows], float)
        pred = np.array([r["twin"][key] for r in rows], float)
        for mask, label, color in ((~starved, "not starved (real)", "tab:blue"), (starved, "starved (real)", "tab:red")):
            ax.scatter(real[mask], pred[mask], s=22, c=color, label=label)
        finite = np.concatenate([real[np.isfinite(real)], pred[np.isfinite(pred)]])
        if finite.size:
            lo, hi = finite.min() * 0.9, finite.max() * 1.1
            ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.set_xlabel(f"real {key}")
        ax.set_ylabel(f"twin {key}")
        ax.set_title(f"{name}: SMAPE {smape(pred, real):.1f} %")
        if name in ("itl", "ttft"):
            ax.set_xscale("log")
            ax.set_yscale("log")
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_bytes_atomic(path, buf.getvalue())


def report(rows: list[dict], out_dir: str | os.PathLike, profile_id: str, meta: dict) -> dict:
    """Write ``table.json``, ``table.csv`` and ``twin_vs_real.png`` under ``out_dir``."""
    out = Path(out_dir)
    summary = summary_table(rows)
    write_json_atomic(out / "table.json", json_safe({"profile_id": profile_id, "summary": summary, **meta,
                                                     "cases": rows}))
    flat = table_rows(rows)
    buf = io.StringIO()
    if flat:
        writer = csv.DictWriter(buf, fieldnames=list(flat[0]))
        writer.writeheader()
        writer.writerows(flat)
    write_text_atomic(out / "table.csv", buf.getvalue())
    plot(rows, out / "twin_vs_real.png", f"{profile_id}: twin vs real vLLM, {len(rows)} held-apart workloads")
    return summary


def run_meta(command: str, duration: float, warmup: float, seed: int | None) -> dict[str, Any]:
    """How a validation table was made: the metadata stored beside its figures."""
    return {"command": command, "duration_s": duration, "warmup_s": warmup, "seed": seed,
            "window_convention": "arrivals over [0, duration); requests finished in [warmup, duration] count",
            "smape": "100*mean(2|twin-real|/(|twin|+|real|))"}


def record_summary(profile_id: str, profile: Profile, summary: dict, table: Path, command: str) -> None:
    """Store a validation ``summary`` (and where its ``table`` is) in the ``validation`` field of the
    profile JSON (``profile_id`` when it is a path, else the shipped profile)."""
    profile_path = Path(profile_id) if Path(profile_id).is_file() else profiles_dir() / f"{profile.profile_id}.json"
    data = json.loads(profile_path.read_text(encoding="utf-8"))
    where = recorded_path(table, artifacts_dir().parent)
    data["validation"] = json_safe({**summary, "table": where, "command": command,
                                    "date": time.strftime("%Y-%m-%d")})
    write_profile(profile_path, data)


def refuse_calibration_workloads(profile: Profile, seed: int | None, where: str,
                                 what: str = "a validation record") -> None:
    """A validation record (or ``what`` else rests on real runs) must come from held-apart workloads, not from the
    seed the profile was calibrated on (its calibration runs, or a rerun of them)."""
    if seed is not None and seed == profile.provenance.get("calibration", {}).get("seed"):
        raise BadInputError(f"{where}: seed {seed} draws the workloads profile {profile.profile_id} was calibrated "
                            f"on; {what} needs held-apart ones")


# ----------------------------------------------------------------------------------------------
# Offline: the validation table recomputed from stored runs (no vLLM)


def rescored(profile: Profile, work_dir: Path, duration_s: float | None = None,
             warmup_s: float | None = None) -> tuple[list[dict], float, float]:
    """The stored cases of ``work_dir`` compared with the twin (:func:`compare`), in the window the runs were measured
    in (:func:`serving_harness.window.run_window`), and that window."""
    stored = stored_rows(profile, work_dir)
    duration_s, warmup_s = run_window(stored, duration_s, warmup_s, str(work_dir))
    return compare(profile, work_dir, stored, duration_s, warmup_s), duration_s, warmup_s


def stored_rows(profile: Profile, work_dir: Path) -> list[dict]:
    """The cases saved under ``work_dir``; refuses the runs the profile was calibrated on."""
    calibration_runs = calibration_run_dirs(profile.provenance.get("calibration", {}))
    if any(d.resolve() == work_dir.resolve() for d in calibration_runs):
        raise BadInputError(f"{work_dir} holds the runs profile {profile.profile_id} was calibrated on; "
                            "validate on held-apart runs")
    rows = saved_cases(work_dir)
    if not rows:
        raise BadInputError(f"{work_dir}: no saved cases (cases/*.json of `planner validate`)")
    return rows
