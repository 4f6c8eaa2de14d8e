"""What holds of any vLLM server, checked on the stock engine loop (``twin.core.simulate_core``) over random
engines and workloads at extreme settings (``conftest.random_core_args``).

Each run records its whole event trace, which keeps the loop explicit (``tests/test_twin_steady_decode.py``
shows the fast steps give the same results), and the trace is replayed independently of the loop's own
counters: per request its state and computed tokens, per step the batch. Not checked here, for want of an
output that shows them: how many adapters sit in the GPU's LoRA slots (the loop keeps ``n_resident <= a_max``
internally; the batch's distinct adapters are checked instead).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
from conftest import random_core_args

from twin import core
from twin.states import FINISHED, PENDING, REJECTED, RUNNING, WAITING

TRACE_CAP = 200_000
#: A kind's place in a step: preemptions, then the running requests scheduled, admissions, finishes.
STEP_ORDER = {core.EV_PREEMPTED: 0, core.EV_SCHEDULED: 1, core.EV_ADMITTED: 2, core.EV_FINISHED: 3}


@dataclass
class Step:
    start_s: float
    tokens: int = 0
    seqs: int = 0
    adapters: set = field(default_factory=set)
    blocks: int = 0  # KV blocks the running requests hold once the step's tokens are allocated
    running: int = 0  # requests running once the step's admissions are in


@dataclass
class Run:
    arrival: np.ndarray
    adapter: np.ndarray
    in_len: np.ndarray
    out_len: np.ndarray
    duration: float
    a_max: int
    usable_blocks: int
    block_size: int
    max_batched: int
    max_num_seqs: int
    state: np.ndarray
    first_tok: np.ndarray
    finish: np.ndarray
    counters: np.ndarray
    timeseries: np.ndarray
    steps: list[Step] = field(default_factory=list)
    replayed: np.ndarray = None  # each request's state in the replay
    admitted_s: np.ndarray = None  # each request's first admission (NaN: never)
    finished_computed: np.ndarray = None  # tokens computed when it finished, since its last preemption (-1: not)
    illegal: list[str] = field(default_factory=list)  # events a request's state did not allow


def _replay(run: Run, trace: np.ndarray) -> None:
    """Replay ``trace`` into ``run``'s per-request states and per-step batches; a request holds
    ceil(computed tokens / block size) blocks while running (vLLM's allocation). A step whose running loop
    preempted every running request schedules nothing: a step of no tokens."""
    n = run.arrival.shape[0]

    def blocks(tokens):
        return -(-int(tokens) // run.block_size)

    state = np.full(n, PENDING, np.int8)
    computed = np.zeros(n, np.int64)
    run.admitted_s = np.full(n, np.nan)
    run.finished_computed = np.full(n, -1, np.int64)
    running: set[int] = set()
    held = 0  # blocks the running requests hold
    step, rank = None, 9
    for t, r, tokens, kind in trace:
        r, kind = int(r), int(kind)
        if step is None or t != step.start_s or STEP_ORDER[kind] < rank:
            step = Step(t)
            run.steps.append(step)
        rank = STEP_ORDER[kind]
        if kind == core.EV_ADMITTED:
            if state[r] in (RUNNING, FINISHED):
                run.illegal.append(f"request {r} admitted while {state[r]}")
            state[r] = RUNNING
            running.add(r)
            if np.isnan(run.admitted_s[r]):
                run.admitted_s[r] = t
        elif state[r] != RUNNING:
            run.illegal.append(f"request {r}: event {kind} while {state[r]}")
        if kind in (core.EV_PREEMPTED, core.EV_FINISHED):
            held -= blocks(computed[r])
            running.discard(r)
            if kind == core.EV_FINISHED:
                state[r] = FINISHED
                run.finished_computed[r] = computed[r]
            else:
                state[r] = WAITING
                computed[r] = 0
        else:
            held -= blocks(computed[r])
            computed[r] += int(tokens)
            held += blocks(computed[r])
            step.tokens += int(tokens)
            step.seqs += 1
            step.adapters.add(int(run.adapter[r]))
            step.running = len(running)
            step.blocks = held
    run.replayed = state


@functools.cache
def runs() -> tuple[Run, ...]:
    rng = np.random.default_rng(49)
    out = []
    for _ in range(150):
        args = random_core_args(rng)
        arrival, adapter, in_len, out_len, _s, _l, _ms, duration, a_max, usable, block, budget, seqs = args[:13]
        state, first_tok, finish, _hist, counters, _busy, ts, trace = core.simulate_core(*args, TRACE_CAP,
                                                                                          core.itl_edges())
        assert counters[5] < TRACE_CAP, "the trace holds every event"
        run = Run(arrival, adapter.view(np.int64), in_len, out_len, duration, a_max, usable, block, budget, seqs,
                  state, first_tok, finish, counters, ts)
        _replay(run, trace)
        out.append(run)
    assert sum(r.counters[0] for r in out) > 1000 and sum(len(r.steps) for r in out) > 10_000  # runs worth checking
    return tuple(out)


def test_requests_are_conserved():
    """Every request that arrived is finished, running, waiting or rejected, as its events say; none is
    lost or served twice."""
    for run in runs():
        assert run.illegal == []
        arrived = int((run.state != PENDING).sum())
        assert (run.state[:arrived] != PENDING).all()  # arrivals are taken in order ...
        assert arrived >= int((run.arrival < run.duration).sum())  # ... every one before the end
        counts = {s: int((run.state == s).sum()) for s in (FINISHED, RUNNING, WAITING, REJECTED)}
        assert arrived == sum(counts.values())
        assert counts[REJECTED] == run.counters[2]
        for s in (FINISHED, RUNNING):
            np.testing.assert_array_equal(run.state == s, run.replayed == s)
        assert (run.replayed[(run.state == WAITING) | (run.state == REJECTED)] != RUNNING).all()


def test_finished_requests_computed_every_token():
    """A finished request computed its prompt and every output token but the last since it last started."""
    for run in runs():
        done = run.state == FINISHED
        np.testing.assert_array_equal(run.finished_computed[done], (run.in_len + run.out_len - 1)[done])
        assert (run.finish[done] >= 0).all() and (run.finish[~done] < 0).all()


def test_kv_blocks_never_exceed_the_cache():
    for run in runs():
        assert max((s.blocks for s in run.steps), default=0) <= run.usable_blocks
        if run.timeseries.shape[0]:
            assert 0 <= run.timeseries[:, 3].min() and run.timeseries[:, 3].max() <= 1


def test_no_request_runs_before_it_arrives():
    for run in runs():
        admitted = ~np.isnan(run.admitted_s)
        assert (run.admitted_s[admitted] >= run.arrival[admitted]).all()
        sampled = run.first_tok >= 0
        assert (run.first_tok[sampled] >= run.arrival[sampled]).all()
        assert (run.first_tok[sampled] >= run.admitted_s[sampled]).all()
        done = run.state == FINISHED
        assert (run.finish[done] >= run.first_tok[done]).all()


def test_batches_keep_the_token_and_sequence_limits():
    """max_num_batched_tokens and max_num_seqs."""
    for run in runs():
        assert all(s.tokens <= run.max_batched for s in run.steps)
        assert all(s.seqs <= run.max_num_seqs and s.running <= run.max_num_seqs for s in run.steps)
        if run.timeseries.shape[0]:
            assert run.timeseries[:, 1].max() <= run.max_num_seqs


def test_batches_hold_at_most_max_loras_adapters():
    for run in runs():
        assert all(len(s.adapters) <= run.a_max for s in run.steps)
