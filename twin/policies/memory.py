"""Which ``--max-loras`` an engine starts with, and with how much KV, under a serving policy.

Stock vLLM carves ``A_max`` LoRA slots of ``max_lora_rank`` out of GPU memory at start-up, so the
profile's measured KV table decides (:class:`twin.profile.KVCapacity`; past its last start, a memory
error). The alternative policies keep adapters and KV in one pool of the profile's no-LoRA KV
tokens (``twin.policies.run``): every ``A_max`` starts, and it only caps a batch's distinct adapters.
Planner, predictors and dataset builder ask :func:`kv_capacity` instead of ``profile.kv`` so both
cases answer through the same two questions (``tokens_for``, ``max_a_max``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from twin.policies.spec import PolicySpec
from twin.profile import KVCapacity, Profile


@dataclass(frozen=True)
class UnifiedPool:
    """The start-up view of an engine with one KV/adapter pool: every A_max starts with the whole pool."""

    kv: KVCapacity

    @property
    def no_lora_tokens(self) -> int:
        return self.kv.no_lora_tokens

    @property
    def a_max_points(self) -> tuple[int, ...]:
        return self.kv.a_max_points

    @property
    def lora_ranks(self) -> tuple[int, ...]:
        return self.kv.lora_ranks

    def rank_for(self, adapter_rank: int) -> int | None:
        return self.kv.rank_for(adapter_rank)

    def max_a_max(self, max_lora_rank: int) -> int:
        """No start-up limit on a profiled rank (0 on an unprofiled one, as the KV table)."""
        return sys.maxsize if max_lora_rank in self.kv.tokens else 0

    def tokens_for(self, a_max: int, max_lora_rank: int) -> int | None:
        self.kv.check_rank(max_lora_rank)
        return self.kv.no_lora_tokens if a_max >= 1 else None

    def tokens_array(self, max_lora_rank: int, top: int) -> np.ndarray:
        """``tokens_for(a, max_lora_rank)`` for every a in 0..top (int64, -1: would not start)."""
        self.kv.check_rank(max_lora_rank)
        out = np.full(top + 1, self.kv.no_lora_tokens, np.int64)
        out[0] = -1
        return out


def kv_capacity(profile: Profile, policy: PolicySpec | None) -> KVCapacity | UnifiedPool:
    """What decides whether an engine starts and its KV tokens: the KV table (stock) or the unified pool."""
    return profile.kv if policy is None else UnifiedPool(profile.kv)
