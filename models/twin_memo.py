"""The twin's answers this process has had, so that a scenario asked again is not simulated again.

A plan asks the twin the same question more than once: a pool plan packs overlapping sets of adapters
for the options it prices (a GPU filled from the same adapters is the same scenario), and judging a
packing simulates GPUs its packer asked about already. The twin is deterministic (fixed seeds), so a
kept answer is the answer. An answer is keyed by the scenario's numbers and by everything its run
simulates with (:func:`run_key`); at most :data:`MAX_ANSWERS` are kept, the oldest dropped first
(about 20 MB).
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from models.scenario import GpuScenario

#: Answers kept at most (a 2,000-adapter pool plan over three kinds asks about 40,000 scenarios).
MAX_ANSWERS = 1 << 17
_ROW = struct.Struct("6d")  # one answer: the six figures of models.twin_predictor._simulate


def run_key(*parts: object) -> bytes:
    """A digest of what a run simulates with (profiles' simulation hashes, duration, seed, policy, ...),
    from the parts' ``repr``."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def scenario_key(run: bytes, sc: GpuScenario, few: bool) -> bytes:
    """The digest of ``sc`` asked in ``run`` (``few``: judged as a GPU of few adapters)."""
    h = hashlib.blake2b(run, digest_size=16)
    for a in (sc.ranks, sc.rates_rps, sc.input_tokens, sc.output_tokens):
        h.update(np.ascontiguousarray(a, dtype=np.float64).tobytes())
    h.update(repr((sc.a_max, sc.max_lora_rank, sc.max_ttft_ms, sc.max_tpot_ms, few)).encode())
    return h.digest()


class TwinMemo:
    """Answers by key, the oldest dropped first past ``limit``."""

    def __init__(self, limit: int = MAX_ANSWERS) -> None:
        self.limit = limit
        self._answers: dict[bytes, bytes] = {}

    def __len__(self) -> int:
        return len(self._answers)

    def get(self, key: bytes) -> tuple[float, ...] | None:
        row = self._answers.get(key)
        return None if row is None else _ROW.unpack(row)

    def put(self, key: bytes, answer: tuple[float, ...]) -> None:
        if key not in self._answers and len(self._answers) >= self.limit:
            del self._answers[next(iter(self._answers))]
        self._answers[key] = _ROW.pack(*answer)

    def clear(self) -> None:
        self._answers.clear()


#: This process's answers (the planner's one process asks the twin; its workers only simulate).
MEMO = TwinMemo()
