"""The edge classifier: will a packed GPU pass its twin judging run?

The throughput and latency forests learn one twin run of each grid scenario at the profile's speed. The
packer asks them about a GPU filled to the edge, where a judging run (a slower GPU, more traffic, two
seeds, the p99.9 bound: :mod:`planner.verdict`) decides in ways they never saw: near the knee a GPU's
p99 TTFT is either a few tenths of a second or many seconds, and a regression of it averages the two.
Of the GPUs a 10,000-adapter plan of log-uniform rates packs, a sixth then missed the SLO in the twin
and had their adapters packed again, up to seven rounds.

This classifier learns the verdict itself, from GPUs the packer packed and the twin judged
(``planner train-edge``, :mod:`planner.judged_gpus`): the scenario's :data:`models.features.FEATURES`
at the load the packer asks about (the bar's slowdown times the traffic, times the judging run's size
scaling), and the share of its adapters its LoRA slots hold at once (:data:`EDGE_FEATURES`), labelled by
:meth:`planner.verdict.TwinCheck.meets`. That share says directly whether a request can wait for a slot:
without it the trees took the README's GPU of 60 adapters on 60 slots for its nearest judged GPUs, 92
adapters on 64 slots that failed, and its plan took three GPUs instead of two. The packer then takes a window only where
the class "passes" has at least :data:`MIN_PASS_PROBABILITY`, on top of the forests' tests
(:attr:`planner.packing.PackRequest.edge`).

Its labels are one bar's and one judging rule's, recorded in ``edge.json``; a plan whose bar is at least
as strict in every term (a GPU failing the recorded bar fails it too) uses it, any other plan does not.
The artifact (``edge.npz`` + ``edge.json`` beside the surrogate it was packed with) names that
surrogate's ``arrays_sha256`` and the profile's simulation hash; a mismatch is refused like a stale
surrogate.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.features import FEATURES
from models.packed_cache import load_packed, store_packed
from models.trees import FlatForest, PackedForest
from twin.atomic import write_bytes_atomic, write_json_atomic
from twin.errors import BadInputError, ProfileError

ARRAYS_FILE = "edge.npz"
METADATA_FILE = "edge.json"
EDGE_SCHEMA_VERSION = 1
#: A window is packed only where the edge forest gives "passes" at least this probability. A window it gives
#: even odds is one the judging runs pass or fail by their arrival seeds, so it must give more; the higher, the
#: fewer GPUs packed again and the more GPUs in all. On the benchmark's random fleets 0.5, 0.6 and 0.7 took
#: 546, 545 and 549 GPUs at 2,000 adapters and packed 76, 48 and 31 again; at 0.6 one GPU of the 42 plans
#: missed the SLO with another seed (none at 0.5 and 0.7), and 0.7 packs the README's plan on three GPUs for
#: two (docs/surrogates.md, "The edge classifier").
MIN_PASS_PROBABILITY = 0.7
#: The classifier's inputs: the forests' features, then min(1, A_max / adapters) (:func:`edge_features`).
EDGE_FEATURES = (*FEATURES, "resident_share")
SERVED, A_MAX = FEATURES.index("served_adapters"), FEATURES.index("a_max")
#: The bar and judging-run terms the labels depend on, and the direction in which a plan's may differ
#: (+1: a larger value is stricter, -1: a smaller one is).
BAR_TERMS = {"max_ttft_s": -1, "max_tpot_ms": -1, "min_served": +1, "slowdown": +1}
RUN_TERMS = ("duration_s", "load", "seed", "second_seed", "tail_factor", "tpot_factor", "size_scaled", "min_requests",
             "max_duration_s")


@dataclass(frozen=True)
class EdgeModel:
    forest: PackedForest
    metadata: dict[str, Any]

    def applies(self, bar: dict[str, Any], run: dict[str, Any]) -> bool:
        """Is a GPU that fails this model's bar sure to fail ``bar`` under judging run ``run`` (both as their
        ``to_dict`` writes them)? Then the model's verdicts are safe to pack by."""
        mine_bar, mine_run = self.metadata["bar"], self.metadata["run"]
        if any(run.get(k) != mine_run.get(k) for k in RUN_TERMS):
            return False
        for key, direction in BAR_TERMS.items():
            mine, theirs = mine_bar.get(key), bar.get(key)
            if mine is None:
                continue
            if theirs is None or direction * (theirs - mine) < -1e-12:
                return False
        return True

    def passes(self, X: np.ndarray) -> np.ndarray:
        """Rows of ``FEATURES`` (float64) the model lets pack."""
        return self.forest.predict_raw(edge_features(X))[:, 1] >= MIN_PASS_PROBABILITY


def edge_features(X: np.ndarray) -> np.ndarray:
    """Rows of :data:`EDGE_FEATURES` from rows of ``FEATURES`` (the compiled search computes the last the same
    way, in float64, before the forests' float32)."""
    return np.hstack([X, np.minimum(1.0, X[:, A_MAX] / X[:, SERVED])[:, None]])


def save_edge(directory: str | Path, forest: FlatForest, metadata: dict[str, Any]) -> dict[str, Any]:
    """Write ``edge.npz`` and ``edge.json`` (atomically); returns the metadata as written."""
    directory = Path(directory)
    buf = io.BytesIO()
    np.savez_compressed(buf, **forest.arrays("edge."))
    meta = {**metadata, "edge_schema_version": EDGE_SCHEMA_VERSION, "features": list(EDGE_FEATURES),
            "min_pass_probability": MIN_PASS_PROBABILITY, "arrays_sha256": hashlib.sha256(buf.getvalue()).hexdigest()}
    write_bytes_atomic(directory / ARRAYS_FILE, buf.getvalue())
    write_json_atomic(directory / METADATA_FILE, meta)
    return meta


def load_edge(directory: Path, surrogate_sha256: str, simulation_hash: str, rebuild: str) -> EdgeModel | None:
    """The edge model in ``directory`` (None when there is none), checked against the surrogate and profile
    its GPUs were packed and judged with; ProfileError naming ``rebuild`` when it does not fit."""
    meta_path, arrays_path = directory / METADATA_FILE, directory / ARRAYS_FILE
    if not meta_path.is_file() and not arrays_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        digest = hashlib.sha256(arrays_path.read_bytes()).hexdigest()
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"{directory}: unreadable edge classifier ({exc}); {rebuild}") from None
    problems = [] if meta.get("arrays_sha256") == digest else [f"{ARRAYS_FILE} does not match its arrays_sha256"]
    if meta.get("edge_schema_version") != EDGE_SCHEMA_VERSION:
        problems.append(f"schema {meta.get('edge_schema_version')} is not {EDGE_SCHEMA_VERSION}")
    if meta.get("features") != list(EDGE_FEATURES):
        problems.append("its features are not this lora-planner's")
    if meta.get("surrogate_arrays_sha256") != surrogate_sha256:
        problems.append("its GPUs were packed by another surrogate")
    if meta.get("profile_simulation_hash") != simulation_hash:
        problems.append("the profile changed since")
    if problems:
        raise ProfileError(f"{directory / METADATA_FILE}: stale edge classifier ({'; '.join(problems)}); {rebuild}")
    packed = load_packed(digest, ("edge",))  # packing the trees takes longer than a small plan's packing
    if packed is None:
        try:
            with np.load(arrays_path, allow_pickle=False) as z:
                forest = FlatForest.from_arrays({k: z[k] for k in z.files}, "edge.", classifier=True)
        except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error, BadInputError) as exc:
            raise ProfileError(f"{arrays_path}: unreadable edge classifier ({exc}); {rebuild}") from None
        packed = {"edge": forest.packed}
        store_packed(digest, packed)
    return EdgeModel(packed["edge"], meta)


#: The forest: enough trees for stable probabilities near the threshold; leaves of at least a few GPUs, since
#: a GPU's verdict near the knee turns on its arrival seeds.
N_TREES = 200
MIN_SAMPLES_LEAF = 3


def fit_edge(X: np.ndarray, passed: np.ndarray, jobs: int = 1):
    """A fitted scikit-learn forest of "passes" (class True) on ``X`` (rows of :data:`EDGE_FEATURES`)."""
    from sklearn.ensemble import RandomForestClassifier

    if passed.all() or not passed.any():
        raise BadInputError("the judged GPUs all passed or all failed: an edge classifier needs both")
    return RandomForestClassifier(N_TREES, min_samples_leaf=MIN_SAMPLES_LEAF, n_jobs=jobs, random_state=0).fit(
        X, passed.astype(bool))


def evaluate_edge(X: np.ndarray, passed: np.ndarray, seed: np.ndarray, first_round: np.ndarray,
                  jobs: int = 1) -> dict[str, Any]:
    """Leave-one-seed-out: a forest fitted on the other seeds' GPUs judges each seed's (``X``: rows of
    :data:`EDGE_FEATURES`), at :data:`MIN_PASS_PROBABILITY`. Reported over every GPU and over the first
    packing's (``first_round``)."""
    from sklearn.metrics import roc_auc_score

    prob = np.empty(len(passed))
    for s in np.unique(seed):
        test = seed == s
        prob[test] = fit_edge(X[~test], passed[~test], jobs).predict_proba(X[test])[:, 1]
    let = prob >= MIN_PASS_PROBABILITY

    def shares(mask):
        return {"gpus": int(mask.sum()), "passed": int((passed & mask).sum()),
                "passed_kept": round(float((let & passed & mask).sum() / max(1, (passed & mask).sum())), 4),
                "failed_caught": round(float((~let & ~passed & mask).sum() / max(1, (~passed & mask).sum())), 4)}

    return {"method": "leave one workload seed out", "auc": round(float(roc_auc_score(passed, prob)), 4),
            "all": shares(np.ones(len(passed), bool)), "first_packing": shares(first_round)}
