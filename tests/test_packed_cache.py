"""The packed-forest cache: a second load maps the first load's forests and predicts the same."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from models.packed_cache import load_packed
from models.scenario import GpuScenario
from models.surrogate import FOREST_NAMES, SurrogatePredictor
from twin import load_profile

LLAMA = "h100-64gb-llama-3.1-8b"


def scenarios():
    rng = np.random.default_rng(3)
    out = []
    for _ in range(12):
        n = int(rng.integers(4, 200))
        out.append(GpuScenario(rng.choice([8, 16, 32], n), rng.choice([0.4, 0.1, 0.02], n), np.full(n, 220.0),
                               np.full(n, 200.0), int(rng.choice([8, 32, 64]))))
    return out


def predictions(pred):
    scs = scenarios()
    batch = pred.predict(scs)
    one = [pred.predict([sc]) for sc in scs]  # the packer's compiled single-row path
    return np.concatenate([batch.throughput_tok_s, [p.throughput_tok_s[0] for p in one]]), batch.starved


def mapped(a) -> bool:
    """Whether ``a`` views a memory-mapped file (not arrays built in memory)."""
    while a is not None:
        if isinstance(a, (np.memmap, mmap.mmap)):
            return True
        a = getattr(a, "base", None)
    return False


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LORA_PLANNER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cached_forests_predict_what_the_artifact_does(cache, monkeypatch):
    prof = load_profile(LLAMA)
    first = SurrogatePredictor(prof)
    sha = first.metadata["arrays_sha256"]
    entries = {e.name.split("-v")[0] for e in (cache / "packed-forests").iterdir()}
    assert entries == {sha, first.edge.metadata["arrays_sha256"]}  # the edge classifier has an entry of its own
    cached = load_packed(sha, FOREST_NAMES)
    assert cached is not None and cached["full_throughput"].n_nodes == first.throughput_forest.n_nodes
    second = SurrogatePredictor(prof)
    assert mapped(second.throughput_forest.nodes)  # mapped, not rebuilt
    small = SurrogatePredictor(prof, "small-tree")
    assert mapped(small.throughput_forest.nodes) and small.throughput_forest.n_trees == 1
    monkeypatch.setenv("LORA_PLANNER_CACHE", "off")
    uncached = SurrogatePredictor(prof)
    assert not mapped(uncached.throughput_forest.nodes)
    for a, b in ((first, second), (first, uncached)):
        (ta, sa), (tb, sb) = predictions(a), predictions(b)
        assert np.array_equal(ta, tb) and np.array_equal(sa, sb)


def test_a_damaged_entry_is_rebuilt(cache):
    prof = load_profile(LLAMA)
    reference = predictions(SurrogatePredictor(prof))
    sha = SurrogatePredictor(prof).metadata["arrays_sha256"]
    entry = next(e for e in (cache / "packed-forests").iterdir() if e.name.startswith(sha))
    nodes = np.load(entry / "full_throughput.nodes.npy")
    internal = (nodes[:, 0] & 128) == 0
    nodes[np.flatnonzero(internal)[:5], 0] |= 0x7FFFFF00  # children far past the last node
    np.save(entry / "full_throughput.nodes.npy", nodes)
    assert load_packed(entry.name.split("-v")[0], FOREST_NAMES) is None and not entry.exists()
    (entry.parent / "junk").mkdir()
    rebuilt = SurrogatePredictor(prof)
    assert entry.is_dir()
    assert all(np.array_equal(a, b) for a, b in zip(reference, predictions(rebuilt)))


def test_an_unwritable_cache_is_skipped(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("LORA_PLANNER_CACHE", str(blocker))
    pred = SurrogatePredictor(load_profile(LLAMA))
    assert pred.predict(scenarios()[:2]).throughput_tok_s.shape == (2,)
