"""Surrogate artifacts (``artifacts/surrogates/<profile-id>/``) and the predictors that use them.

A surrogate answers for one serving policy: stock vLLM's live in the profile's directory, another
policy's in ``<profile-id>/<policy>/`` and record the policy (name and non-preset parameters) in
their metadata; an artifact of another policy is refused.

An artifact is two files: ``surrogate.npz`` (the compiled forests as flat arrays, see
:mod:`models.trees`) and ``surrogate.json`` (features, target definition, model parameters,
metrics, dataset hash, versions, the command that built it). Loading needs numpy and numba only.
An artifact built for another profile (id or simulation-relevant content) or another feature set
is refused with a message saying how to rebuild it.

Forests in an artifact: ``full_throughput``/``full_starved`` (the size-bounded random forests)
and ``small_throughput``/``small_starved`` (single trees of at most 32 rules). The throughput
forests predict ``throughput / min(arriving, saturation)`` (:func:`models.features.throughput_base`);
the classifiers' class 1 is "starved".
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numba
import numpy as np

from models.edge import load_edge
from models.features import ARRIVING, FEATURES, N_FEATURES, SATURATION, engine_terms, fill_features, throughput_base
from models.packed_cache import load_packed, store_packed
from models.scenario import GpuScenario, Predictions
from models.trees import FlatForest, forest_row
from twin.atomic import write_bytes_atomic, write_json_atomic
from twin.errors import BadInputError, InfeasibleError, ProfileError
from twin.policies.memory import kv_capacity
from twin.policies.spec import PolicySpec, policy_label, policy_record
from twin.profile import Profile, artifacts_dir

ARTIFACT_SCHEMA_VERSION = 1
ARRAYS_FILE = "surrogate.npz"
METADATA_FILE = "surrogate.json"
FOREST_NAMES = ("full_throughput", "full_starved", "small_throughput", "small_starved")
#: The latency forests (log10 p99 TTFT and TPOT): in artifacts trained on datasets that have the targets.
LATENCY_FORESTS = ("full_ttft", "small_ttft", "full_tpot", "small_tpot")
KINDS = {"surrogate": "full", "small-tree": "small"}


def simulation_hash(profile: Profile, policy: PolicySpec | None = None) -> str:
    """Hash of the numbers the twin simulates with (and the default lengths datasets draw around).

    Descriptions, provenance and settings the twin does not read do not enter, so a profile
    schema gaining an informational field does not invalidate datasets and surrogates. A non-stock
    ``policy`` adds its parameters and the profile's ``policy_terms``; stock hashes are unchanged.
    """
    e, kv, so = profile.engine, profile.kv, profile.scheduler_overhead
    parts = (e.block_size, e.max_num_batched_tokens, e.max_num_seqs, e.max_model_len, e.admission_rule,
             kv.no_lora_tokens, kv.a_max_points, sorted(kv.tokens.items()), profile.step_latency.as_array(),
             (so.k1_us, so.k2_us, so.k3_us, so.intercept_us),
             sorted((r, sorted(v.items())) for r, v in profile.adapter_load.ms.items()),
             profile.default_input_tokens, profile.default_output_tokens)
    # Terms absent from a profile add nothing, so hashes made before they existed still hold.
    if profile.step_latency.l3:
        parts += (("l3", profile.step_latency.l3),)
    if profile.default_length_cv:
        parts += (("length_cv", profile.default_length_cv),)
    if policy is not None:
        t = profile.policy_terms
        parts += (sorted(t.adapter_kv_tokens.items()), t.cpu_lora_us_per_token_rank, sorted(policy.to_dict().items()))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def surrogate_dir(profile_id: str, policy: PolicySpec | None = None) -> Path:
    """``artifacts/surrogates/<profile-id>/`` for stock vLLM, ``.../<profile-id>/<policy>/`` for another policy."""
    d = artifacts_dir() / "surrogates" / profile_id
    return d if policy is None else d / policy.name


def has_artifact(profile: Profile, directory: str | Path | None = None) -> bool:
    d = artifact_dir(profile, directory)
    return (d / ARRAYS_FILE).is_file() and (d / METADATA_FILE).is_file()


def arrays_digest(forests: dict[str, FlatForest]) -> str:
    h = hashlib.sha256()
    for name in (*FOREST_NAMES, *(n for n in LATENCY_FORESTS if n in forests)):
        for key, arr in sorted(forests[name].arrays(name + ".").items()):
            h.update(key.encode())
            h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def save_artifact(directory: str | Path, forests: dict[str, FlatForest], metadata: dict[str, Any]) -> dict[str, Any]:
    """Write the arrays and the metadata (atomically); returns the metadata as written."""
    directory = Path(directory)
    arrays: dict[str, np.ndarray] = {}
    for name in (*FOREST_NAMES, *(n for n in LATENCY_FORESTS if n in forests)):
        arrays.update(forests[name].arrays(name + "."))
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    meta = {**metadata, "artifact_schema_version": ARTIFACT_SCHEMA_VERSION, "features": list(FEATURES),
            "arrays_sha256": arrays_digest(forests), "arrays_bytes": len(buf.getvalue())}
    write_bytes_atomic(directory / ARRAYS_FILE, buf.getvalue())
    write_json_atomic(directory / METADATA_FILE, meta)
    return meta


@dataclass
class SurrogateArtifact:
    metadata: dict[str, Any]
    forests: dict[str, FlatForest]


def artifact_dir(profile: Profile, directory: str | Path | None = None, policy: PolicySpec | None = None) -> Path:
    """``directory``, or the shipped place of ``profile``'s artifact under ``policy``."""
    return Path(directory) if directory else surrogate_dir(profile.profile_id, policy)


def _rebuild_hint(profile: Profile, policy: PolicySpec | None) -> tuple[str, str]:
    train = f"planner train --profile {profile.profile_id}" + ("" if policy is None else f" --policy {policy.name}")
    return train, f"rebuild it with `{train}`, or plan with --predictor twin (exact, slower)"


def _edge_rebuild_hint(profile: Profile) -> str:
    return (f"rebuild it with `planner train-edge --profile {profile.profile_id}`, or remove edge.npz and edge.json "
            "to plan without it")


def client_cap(dataset_files: list[dict[str, Any]]) -> int:
    """The largest cap on requests in flight the twin's client had in the datasets described by
    ``dataset_files`` (their build metadata; 0: none, as in production)."""
    return max((f.get("grid", {}).get("max_in_flight", 0) for f in dataset_files), default=0)


def artifact_metadata(profile: Profile, directory: str | Path | None = None,
                      policy: PolicySpec | None = None) -> dict[str, Any]:
    """The metadata of ``profile``'s artifact under serving ``policy`` (None: stock vLLM), checked
    against the profile, the policy and this feature set; ProfileError if it does not fit."""
    d = artifact_dir(profile, directory, policy)
    record = policy_record(policy)
    train, rebuild = _rebuild_hint(profile, policy)
    if not has_artifact(profile, d):
        what = "" if policy is None else f" under policy {policy_label(record)}"
        raise ProfileError(f"no surrogate for profile {profile.profile_id}{what} in {d}; build one with "
                           f"`{train}` or use --predictor twin")
    try:
        meta = json.loads((d / METADATA_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ProfileError(f"{d / METADATA_FILE}: unreadable surrogate metadata ({exc}); {rebuild}") from None
    if meta.get("artifact_schema_version") != ARTIFACT_SCHEMA_VERSION:
        raise ProfileError(f"{d}: surrogate schema {meta.get('artifact_schema_version')} is not "
                           f"{ARTIFACT_SCHEMA_VERSION}; {rebuild}")
    if meta.get("profile_id") != profile.profile_id:
        raise ProfileError(f"{d}: surrogate was trained for profile {meta.get('profile_id')}, "
                           f"not {profile.profile_id}; {rebuild}")
    if meta.get("policy") != record:
        raise ProfileError(f"{d}: surrogate was trained for serving policy {policy_label(meta.get('policy'))}, "
                           f"not {policy_label(record)}; {rebuild}")
    if meta.get("profile_simulation_hash") != simulation_hash(profile, policy):
        raise ProfileError(f"{d}: profile {profile.profile_id} changed since its surrogate was trained; {rebuild}")
    if meta.get("features") != list(FEATURES):
        raise ProfileError(f"{d}: surrogate uses features {meta.get('features')}, this lora-planner computes "
                           f"{list(FEATURES)}; {rebuild}")
    if not isinstance(meta.get("arrays_sha256"), str):
        raise ProfileError(f"{d / METADATA_FILE}: no arrays_sha256; {rebuild}")
    cap = client_cap(meta.get("dataset", {}).get("files", []))
    if cap and directory is None:
        raise ProfileError(f"{d}: surrogate was trained with a client cap of {cap} requests in flight (a measurement "
                           f"client), not for planning; {rebuild}")
    return meta


def load_artifact(profile: Profile, directory: str | Path | None = None,
                  policy: PolicySpec | None = None) -> SurrogateArtifact:
    """The artifact of ``profile`` under serving ``policy`` (None: stock vLLM); ProfileError if none fits."""
    d = artifact_dir(profile, directory, policy)
    meta = artifact_metadata(profile, d, policy)
    return SurrogateArtifact(meta, _read_forests(d, meta, _rebuild_hint(profile, policy)[1]))


def _read_forests(d: Path, meta: dict[str, Any], rebuild: str) -> dict[str, FlatForest]:
    """The forests of the artifact in ``d``, checked against ``meta``'s arrays_sha256."""
    try:
        with np.load(d / ARRAYS_FILE, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as exc:
        raise ProfileError(f"{d / ARRAYS_FILE}: unreadable surrogate arrays ({exc}); {rebuild}") from None
    names = (*FOREST_NAMES, *(n for n in LATENCY_FORESTS if f"{n}.roots" in arrays))
    try:
        forests = {name: FlatForest.from_arrays(arrays, name + ".", classifier=name.endswith("starved"))
                   for name in names}
    except BadInputError as exc:
        raise ProfileError(f"{d}: {exc}; {rebuild}") from None
    if arrays_digest(forests) != meta.get("arrays_sha256"):
        raise ProfileError(f"{d}: arrays do not match their metadata (arrays_sha256); {rebuild}")
    return forests


class SurrogatePredictor:
    """Predictions from compiled trees: ``kind`` "surrogate" (the forests) or "small-tree".

    ``threads`` > 1 (None: numba's thread count, the cores unless NUMBA_NUM_THREADS says otherwise)
    evaluates batches of at least ``2 × models.trees.PARALLEL_BLOCK_ROWS`` rows in parallel; the
    answers do not depend on it. The default is the calling thread only: the packer's batches are
    small, and on a machine whose cores are busy (parallel planner jobs) waiting for a descheduled
    thread makes a parallel batch slower than a serial one. ``edge``: load the edge classifier beside the
    forests where one ships (:mod:`models.edge`; the full forests only).
    """

    def __init__(self, profile: Profile, kind: str = "surrogate", directory: str | Path | None = None,
                 policy: PolicySpec | None = None, threads: int | None = 1, edge: bool = True):
        if kind not in KINDS:
            raise BadInputError(f"unknown surrogate kind '{kind}' ({', '.join(KINDS)})")
        if threads is not None and threads < 1:
            raise BadInputError(f"threads must be >= 1 (got {threads})")
        self.profile = profile
        self.kind = kind
        self.policy = policy
        self.threads = threads
        self._capacity = kv_capacity(profile, policy)
        d = artifact_dir(profile, directory, policy)
        self.metadata = artifact_metadata(profile, d, policy)
        names = (f"{KINDS[kind]}_throughput", f"{KINDS[kind]}_starved")
        ttft_name, tpot_name = f"{KINDS[kind]}_ttft", f"{KINDS[kind]}_tpot"
        names += tuple(n for n in (ttft_name, tpot_name) if n in self.metadata.get("compiled", {}))
        packed = load_packed(self.metadata["arrays_sha256"], names)  # only the ones this predictor evaluates
        if packed is None:
            forests = _read_forests(d, self.metadata, _rebuild_hint(profile, policy)[1])
            packed = {name: forest.packed for name, forest in forests.items()}
            store_packed(self.metadata["arrays_sha256"], packed)
        #: the forests this predictor evaluates, in the evaluation layout (models.trees.PackedForest); the
        #: latency ones (log10 p99 TTFT and TPOT, ms) are None for an artifact trained without the target
        self.throughput_forest, self.starved_forest = packed[names[0]], packed[names[1]]
        self.ttft_forest, self.tpot_forest = packed.get(ttft_name), packed.get(tpot_name)
        #: the edge classifier beside the forests (models.edge; the full forests' only), None where none ships
        self.edge = None if kind != "surrogate" or not edge else load_edge(
            d, self.metadata["arrays_sha256"], simulation_hash(profile, policy), _edge_rebuild_hint(profile))
        self._kv: dict[tuple[int, int], int | None] = {}
        self.terms = engine_terms(profile)  #: the profile numbers the features use
        self._x = np.empty(N_FEATURES)
        self._x32 = np.empty(N_FEATURES, np.float32)
        self._out = np.empty(2)

    @property
    def profile_id(self) -> str:
        return self.profile.profile_id

    def _kv_tokens(self, a_max: int, rank: int) -> int:
        key = (a_max, rank)
        if key not in self._kv:
            self._kv[key] = self._capacity.tokens_for(a_max, rank)
        kv = self._kv[key]
        if kv is None:
            raise InfeasibleError(
                f"memory error: with max_lora_rank {rank} the engine of profile {self.profile.profile_id} "
                f"starts with at most --max-loras {self.profile.kv.max_a_max(rank)} (asked {a_max})")
        return kv

    def features(self, scenarios: Sequence[GpuScenario]) -> np.ndarray:
        X = np.empty((len(scenarios), N_FEATURES))
        for i, sc in enumerate(scenarios):
            rank = self._rank(sc)
            fill_features(self.terms, sc.ranks, sc.rates_rps, sc.input_tokens, sc.output_tokens, int(sc.a_max), int(rank),
                          float(self._kv_tokens(int(sc.a_max), rank)), X[i])
        return X

    def predict_features(self, X: np.ndarray) -> Predictions:
        """Predictions for a feature matrix (rows of ``FEATURES``)."""
        threads = self.threads if self.threads is not None else numba.get_num_threads()
        ratio = self.throughput_forest.predict_raw(X, threads)[:, 0]
        proba = self.starved_forest.predict_raw(X, threads)
        base = np.minimum(X[:, ARRIVING], X[:, SATURATION])
        ttft = None if self.ttft_forest is None else 10.0 ** self.ttft_forest.predict_raw(X, threads)[:, 0]
        tpot = None if self.tpot_forest is None else 10.0 ** self.tpot_forest.predict_raw(X, threads)[:, 0]
        edge = None if self.edge is None else self.edge.passes(X)
        return Predictions(ratio * base, proba[:, 1] > proba[:, 0], X[:, ARRIVING].copy(), ttft, tpot,
                           passes_edge=edge)

    def _rank(self, sc: GpuScenario) -> int:
        need = int(sc.ranks.max())
        rank = sc.max_lora_rank if sc.max_lora_rank is not None else self.profile.kv.rank_for(need)
        if rank is None or rank < need:
            raise ProfileError(f"profile {self.profile.profile_id} cannot serve rank {need} with "
                               f"max_lora_rank {rank} (profiled: {', '.join(map(str, self.profile.kv.lora_ranks))})")
        return rank

    def predict(self, scenarios: Sequence[GpuScenario]) -> Predictions:
        n = len(scenarios)
        if n > 4 or self.ttft_forest is not None or self.tpot_forest is not None or self.edge is not None:
            return self.predict_features(self.features(scenarios))
        # Few scenarios (the packer's case): one compiled call per scenario, no batch arrays.
        thr, starved, arriving = np.empty(n), np.empty(n, bool), np.empty(n)
        t, s = self.throughput_forest, self.starved_forest
        for i, sc in enumerate(scenarios):
            rank = self._rank(sc)
            thr[i], starved[i], arriving[i] = _predict_one(
                self.terms, sc.ranks, sc.rates_rps, sc.input_tokens, sc.output_tokens, int(sc.a_max), int(rank),
                float(self._kv_tokens(int(sc.a_max), rank)),
                t.nodes, t.thresholds, t.leaf_row, t.leaf_value, t.roots,
                s.nodes, s.thresholds, s.leaf_row, s.leaf_value, s.roots, self._x, self._x32, self._out)
        return Predictions(thr, starved, arriving)


@numba.njit(cache=True)
def _predict_one(terms, ranks, rates, input_tokens, output_tokens, a_max, rank, kv_tokens,
                 t_nodes, t_thresholds, t_leaf_row, t_leaf_value, t_roots,
                 s_nodes, s_thresholds, s_leaf_row, s_leaf_value, s_roots, x, x32, out):
    """(throughput, starved, arriving) of one scenario: features, then both forests (packed layout)."""
    fill_features(terms, ranks, rates, input_tokens, output_tokens, a_max, rank, kv_tokens, x)
    for k in range(x.shape[0]):
        x32[k] = x[k]
    forest_row(t_nodes, t_thresholds, t_leaf_row, t_leaf_value, t_roots, x32, out)
    thr = out[0] * throughput_base(x)
    forest_row(s_nodes, s_thresholds, s_leaf_row, s_leaf_value, s_roots, x32, out)
    return thr, out[1] > out[0], x[ARRIVING]
