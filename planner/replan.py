"""Nightly re-planning: move as few adapters and restart as few engines as the new workload allows.

1. Every previous instance keeps the adapters still in the workload, with their traffic shares. If
   it keeps up with its current ``--max-loras``/``--max-lora-rank`` nothing restarts; else the best
   A_max is tried (a restart); else its hottest adapters are evicted one by one until it keeps up.
2. New adapters, evicted ones and traffic shares no instance serves any more go, hottest first, to
   the first existing instance that keeps up with them without a restart, else with one.
3. What is left gets new instances from the greedy packer.
4. With ``confirm`` (a surrogate's re-plan, as `planner replan` does by default), every GPU is run
   in the twin; while one falls short (or misses a TTFT limit) steps 1-3 rerun with a load margin,
   and previous instances that fell short give up all their adapters to be placed anew.
5. A previous instance left with nothing (its adapters gone, or given up in step 4) lends its GPU
   to the new group sharing most adapters with it: a restart (or only loads and unloads, when the
   settings match) instead of stopping one engine and starting another.

The result carries a ``changes`` section: per instance the adapters to load and unload and whether
the engine must restart (``--max-loras``, ``--max-lora-rank`` and ``--max-cpu-loras`` are start-up
settings in vLLM), plus new and removed instances.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from planner.confirm import Progress, replan_confirmed
from planner.greedy import plan_greedy
from planner.packing import GpuGroup, PackRequest, a_max_limit, best_a_max, keeps_up
from planner.placement import InstancePlan, Placement, adapter_rows, build_instances, engine_settings, plan_inputs
from planner.verdict import DEFAULT_BAR, DEFAULT_RUN, ServiceBar, TwinRun
from twin.errors import LoraPlannerError

_SHARE_EPS = 1e-9


class _Slot:
    """One previous instance while it is being re-planned."""

    def __init__(self, prev: InstancePlan, shares: dict[int, float]):
        self.prev = prev
        self.group = GpuGroup(dict(shares), prev.a_max)
        self.max_lora_rank = prev.max_lora_rank

    def try_settle(self, req: PackRequest, shares: dict[int, float]) -> bool:
        """Accept ``shares`` if they keep up: with the current settings if possible, else the best A_max."""
        if keeps_up(req, shares, self.prev.a_max, self.prev.max_lora_rank):
            self.group = GpuGroup(shares, self.prev.a_max)
            self.max_lora_rank = self.prev.max_lora_rank
            return True
        verdict = best_a_max(req, shares)
        if verdict.ok:
            self.group = GpuGroup(shares, verdict.a_max)
            self.max_lora_rank = req.profile.kv.rank_for(int(req.ranks[list(shares)].max()))
        return verdict.ok


def replan(previous: Placement, workload_path, req: PackRequest, split_hot: bool = True, confirm: bool = False,
           run: TwinRun = DEFAULT_RUN, bar: ServiceBar = DEFAULT_BAR, progress: Progress | None = None) -> Placement:
    """Re-plan ``req``'s workload from ``previous``; with ``confirm``, every GPU of the result is checked
    in the twin and the whole re-plan reruns with a load margin while one falls short
    (:func:`planner.confirm.replan_confirmed`)."""
    def assign(r: PackRequest, dropped: set[str]) -> list[tuple[str | None, GpuGroup]]:
        slots, new_groups = _assign(previous, r, split_hot, dropped)
        return ([(s.prev.instance_id, GpuGroup(s.group.shares, s.group.a_max, s.max_lora_rank)) for s in slots]
                + [(None, g) for g in new_groups])

    confirmation = None
    if confirm:
        labelled, confirmation = replan_confirmed(req, assign, run, bar, progress)
    else:
        labelled = assign(req, set())
    by_id = {p.instance_id: p for p in previous.instances}
    kept = [by_id[prev_id] for prev_id, _ in labelled if prev_id is not None]  # first in ``labelled``
    instances = build_instances(req, [g for _, g in labelled], twin=confirmation and confirmation.rows)
    restarted = {prev.instance_id for inst, prev in zip(instances, kept) if _take_over(inst, prev)}
    restarted |= _name_new_instances(previous, instances[len(kept):], {p.instance_id for p in kept})
    instances.sort(key=lambda i: _instance_number(i.instance_id))
    inputs = plan_inputs(workload_path, req, "greedy", 0.0)
    if confirmation is not None:
        inputs["confirmation"] = confirmation.to_dict()
    placement = Placement(inputs, instances, adapter_rows(req), engine_settings(req.profile))
    placement.changes = changes(previous, placement, restarted)
    return placement


def _take_over(inst: InstancePlan, prev: InstancePlan) -> bool:
    """Run ``inst`` on ``prev``'s GPU (its id); return whether the engine must restart. ``--max-loras``,
    ``--max-lora-rank`` and ``--max-cpu-loras`` are start-up settings: without a restart the engine keeps
    its ``--max-cpu-loras``, which must then hold every adapter."""
    inst.instance_id = prev.instance_id
    restart = ((inst.a_max, inst.max_lora_rank) != (prev.a_max, prev.max_lora_rank)
               or max(len(inst.adapters), inst.a_max) > prev.max_cpu_loras)
    if not restart:
        inst.max_cpu_loras = prev.max_cpu_loras
    return restart


def _name_new_instances(previous: Placement, new: list[InstancePlan], kept: set[str]) -> set[str]:
    """Name the new instances, reusing the GPUs of previous instances that keep nothing (emptied, or
    given up by the confirmation): each such GPU takes the new group sharing most adapters with it,
    so it unloads and loads the fewest. Returns the reused ids whose engine must restart."""
    free = [p for p in previous.instances if p.instance_id not in kept]
    unnamed = list(new)
    restarted: set[str] = set()
    for prev in free:
        if not unnamed:
            break
        inst = max(unnamed, key=lambda i: len(set(i.adapters) & set(prev.adapters)))  # first on ties
        unnamed.remove(inst)
        if _take_over(inst, prev):
            restarted.add(prev.instance_id)
    next_id = 1 + max((_instance_number(p.instance_id) for p in previous.instances), default=-1)
    for k, inst in enumerate(unnamed):
        inst.instance_id = f"gpu-{next_id + k}"
    return restarted


def _assign(previous: Placement, req: PackRequest, split_hot: bool,
            dropped: set[str]) -> tuple[list[_Slot], list[GpuGroup]]:
    """Steps 1-3: the previous instances that stay (with what they keep and gain), and new groups.
    Instances in ``dropped`` keep nothing: all their adapters are placed anew."""
    index = {a.adapter_id: i for i, a in enumerate(req.workload.adapters)}
    load = req.arriving_tok_s
    slots: list[_Slot] = []
    todo: dict[int, float] = {i: 1.0 for i in range(len(index))}  # traffic share still unserved
    for prev in previous.instances:
        shares = {index[a]: s for a, s in prev.adapters.items() if a in index}
        if prev.instance_id in dropped or not shares or a_max_limit(req.kv, req.ranks[list(shares)]) < 1:
            continue
        slot = _Slot(prev, shares)
        while shares and not slot.try_settle(req, dict(shares)):
            del shares[max(shares, key=lambda i: load[i] * shares[i])]  # evict the hottest
        if shares:
            slots.append(slot)
            for i, s in slot.group.shares.items():
                todo[i] -= s
    pending = sorted(((i, s) for i, s in todo.items() if s > _SHARE_EPS), key=lambda e: -load[e[0]] * e[1])
    left: list[tuple[int, float]] = []
    for i, s in pending:
        for slot in slots:
            trial = dict(slot.group.shares)
            trial[i] = trial.get(i, 0.0) + s
            if slot.try_settle(req, trial):
                break
        else:
            left.append((i, s))
    new_groups = plan_greedy(req, split_hot=split_hot, entries=left, max_gpus=req.max_gpus - len(slots)) if left else []
    return slots, new_groups


def _instance_number(instance_id: str) -> int:
    tail = instance_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def changes(previous: Placement, new: Placement, restarted: set[str]) -> dict[str, Any]:
    before = {p.instance_id: p for p in previous.instances}
    after = {p.instance_id: p for p in new.instances}
    per_instance = []
    for iid, inst in after.items():
        old = before.get(iid)
        old_adapters = set(old.adapters) if old else set()
        per_instance.append({
            "instance_id": iid, "status": "kept" if old else "new",
            "restart": iid in restarted, "load": sorted(set(inst.adapters) - old_adapters),
            "unload": sorted(old_adapters - set(inst.adapters)),
            "a_max": [old.a_max if old else None, inst.a_max],
        })
    removed = sorted(set(before) - set(after))
    old_routes, new_routes = previous.routes(), new.routes()
    moved = sorted(a for a in new_routes if a in old_routes and
                   {r["instance_id"] for r in old_routes[a]} != {r["instance_id"] for r in new_routes[a]})
    return {
        "previous_workload_sha256": previous.inputs.get("workload", {}).get("sha256"),
        "instances": per_instance, "removed_instances": removed,
        "moved_adapters": moved,
        "added_adapters": sorted(set(new_routes) - set(old_routes)),
        "dropped_adapters": sorted(set(old_routes) - set(new_routes)),
        "restarts": sorted(restarted), "new_instances": [p["instance_id"] for p in per_instance if p["status"] == "new"],
    }


class AlreadyRunningError(LoraPlannerError):
    """Another re-plan holds the lock on the same output."""


@contextmanager
def exclusive(out: str | os.PathLike):
    """Hold ``OUT.lock`` for the duration; refuse if a live process holds it, take over a stale one."""
    lock = Path(f"{out}.lock")
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            try:
                pid = int(lock.read_text().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and _alive(pid):
                raise AlreadyRunningError(f"another re-plan (pid {pid}) is writing {out}; "
                                          f"wait for it, or remove {lock} if it is gone") from None
            lock.unlink(missing_ok=True)  # stale: its process is gone
    else:
        raise AlreadyRunningError(f"cannot take the lock {lock}")
    try:
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        yield
    finally:
        lock.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
