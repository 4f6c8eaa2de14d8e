"""`planner plan --pool` and `planner replan` of pool plans: the cheapest fleet over GPU kinds."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from click.testing import CliRunner

from planner.cli import main
from planner.placement import read_placement
from twin import load_profile

WL = "datasets/workloads/mixed-ranks-128-adapters.csv"  # ranks 8, 16 and 32: the CPU profile serves 8 and 16
H100, CPU = "h100-64gb-llama-3.1-8b", "cpu-2core-tiny-llama"


def pool_yaml(path, cpu_price=0.01, h100_count=None, cpu_count=None) -> str:
    kinds = [{"name": "h100-64gb", "profile": H100, "price_per_hour": 2.0, "count": h100_count},
             {"name": "cpu", "profile": CPU, "price_per_hour": cpu_price, "count": cpu_count}]
    lines = ["kinds:"]
    for k in kinds:
        lines.append(f"  - {{name: {k['name']}, profile: {k['profile']}, price_per_hour: {k['price_per_hour']}"
                     + (f", count: {k['count']}" if k["count"] else "") + "}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def plan(*args):
    return CliRunner().invoke(main, ["plan", *map(str, args)])


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    d = tmp_path_factory.mktemp("pool")
    res = plan(WL, "--pool", pool_yaml(d / "pool.yaml"), "--out", d / "plan.json")
    assert res.exit_code == 0, res.output
    return d, read_placement(d / "plan.json"), json.loads((d / "plan.json").read_text())


def single_gpus(tmp_path, doc) -> int:
    """GPUs of `planner plan --profile H100` asked about the pool plan's requests."""
    ln = doc["inputs"]["lengths"]
    res = plan(WL, "--profile", H100, "--input-tokens", ln["mean_input_tokens"], "--output-tokens",
               ln["mean_output_tokens"], "--out", tmp_path / "single.json")
    assert res.exit_code == 0, res.output
    return json.loads((tmp_path / "single.json").read_text())["summary"]["gpus"]


def test_a_mix_beats_the_one_kind_that_serves_everything_and_each_gpu_holds_on_its_own_kind(mixed, tmp_path):
    _d, p, doc = mixed
    s = doc["summary"]
    assert s["all_ok"] and set(s["gpus_by_kind"]) == {"h100-64gb", "cpu"} and min(s["gpus_by_kind"].values()) >= 1
    assert s["cost_per_hour"] == pytest.approx(2.0 * s["gpus_by_kind"]["h100-64gb"] + 0.01 * s["gpus_by_kind"]["cpu"])
    assert s["cost_per_hour"] < 2.0 * single_gpus(tmp_path, doc)
    ranks = {a["adapter_id"]: a["rank"] for a in p.adapters}
    profiles = {"h100-64gb": load_profile(H100), "cpu": load_profile(CPU)}
    for inst in p.instances:
        prof = profiles[inst.kind]
        assert inst.instance_id.startswith(f"{inst.kind}-gpu-")
        assert inst.kv_tokens == prof.kv.tokens_for(inst.a_max, inst.max_lora_rank)  # its own kind's memory
        assert p.engine_args(inst)["max_model_len"] == prof.engine.max_model_len
        assert inst.twin["meets"]
        if inst.kind == "cpu":
            assert max(ranks[a] for a in inst.adapters) <= 16
    singles = {r["kind"]: r for r in doc["inputs"]["pool"]["single_kind"]}
    assert singles["cpu"]["gpus"] is None and "cannot serve" in singles["cpu"]["why_not"]
    assert singles["h100-64gb"]["cost_per_hour"] >= s["cost_per_hour"]
    kinds = {k["name"]: k for k in doc["inputs"]["pool"]["kinds"]}
    assert kinds["cpu"]["confirmation"]["slowdown"] == pytest.approx(profiles["cpu"].planning_slowdown())
    assert kinds["h100-64gb"]["confirmation"]["slowdown"] == pytest.approx(profiles["h100-64gb"].planning_slowdown())


def test_a_mix_dearer_than_one_kind_is_not_taken(tmp_path, mixed):
    res = plan(WL, "--pool", pool_yaml(tmp_path / "pool.yaml", cpu_price=1.5), "--out", tmp_path / "plan.json")
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["summary"]["gpus_by_kind"] == {"h100-64gb": single_gpus(tmp_path, doc), "cpu": 0}


def test_counts_are_honoured_and_a_pool_too_small_is_refused(tmp_path, mixed):
    free = mixed[2]["summary"]
    cap = free["gpus_by_kind"]["cpu"] - 1  # fewer than the mix without a count uses
    res = plan(WL, "--pool", pool_yaml(tmp_path / "pool.yaml", cpu_count=cap), "--out", tmp_path / "plan.json")
    assert res.exit_code == 0, res.output
    capped = json.loads((tmp_path / "plan.json").read_text())["summary"]
    assert capped["gpus_by_kind"]["cpu"] <= cap
    alone = next(r for r in mixed[2]["inputs"]["pool"]["single_kind"] if r["kind"] == "h100-64gb")
    assert capped["cost_per_hour"] <= alone["cost_per_hour"]
    res = plan(WL, "--pool", pool_yaml(tmp_path / "small.yaml", h100_count=1, cpu_count=1))
    assert res.exit_code == 3 and "too few GPUs" in res.output and "its count is 1" in res.output


@pytest.mark.parametrize("text, words", [
    ("kinds: [", "not YAML"),
    ("kinds:\n  - name: a\n   profile: x\n", "pool.yaml:3:4: not YAML: expected <block end>"),
    ("", "not a valid pool: it is empty; a pool file lists its GPU kinds under 'kinds:'"),
    (f"kinds: [{{name: a, profile: {H100}, price_per_hr: 1}}]",
     "kinds.0.price_per_hour: Field required; kinds.0.price_per_hr: Extra inputs are not permitted"),
    ("kinds: []", "kinds: List should have at least 1 item"),
    (f"kinds: [{{name: a, profile: {H100}, price_per_hour: 1}}, {{name: a, profile: {CPU}, price_per_hour: 1}}]",
     "kind 'a' appears twice"),
    (f"kinds: [{{name: a, profile: {H100}, price_per_hour: -1}}]", "kinds.0.price_per_hour"),
    (f"kinds: [{{name: A100, profile: {H100}, price_per_hour: 1}}]", "kinds.0.name"),
    (f"kinds: [{{name: a, profile: {H100}, price_per_hour: 1, gpus: 3}}]", "kinds.0.gpus: Extra inputs"),
    ("kinds: [{name: a, profile: no-such-profile, price_per_hour: 1}]", "kind a: unknown profile 'no-such-profile'"),
    (f"kinds: [{{name: a, profile: {H100}, price_per_hour: 1, node_selector: {{'bad key!': x}}}}]",
     "kinds.0.node_selector"),
])
def test_a_bad_pool_file_is_one_line_naming_the_field(tmp_path, text, words):
    (tmp_path / "pool.yaml").write_text(text)
    res = plan(WL, "--pool", tmp_path / "pool.yaml")
    assert res.exit_code == 2 and words in res.output, res.output


def test_pool_refuses_what_the_pool_decides_and_adapters_no_kind_serves(tmp_path):
    pool = pool_yaml(tmp_path / "pool.yaml")
    for extra in (["--profile", H100], ["--gpus", "4"], ["--algorithm", "maxbase"], ["--no-confirm"]):
        res = plan(WL, "--pool", pool, *extra)
        assert res.exit_code == 2, (extra, res.output)
    assert "drop --gpus (each kind's count says how many of it there are)" in plan(WL, "--pool", pool, "--gpus",
                                                                                   "4").output
    (tmp_path / "cpu.yaml").write_text(f"kinds: [{{name: cpu, profile: {CPU}, price_per_hour: 1}}]")
    res = plan(WL, "--pool", tmp_path / "cpu.yaml")
    assert res.exit_code == 2 and "cannot be served by any kind of the pool (cpu serves ranks up to 16)" in res.output


def test_a_plan_of_one_profile_names_no_kind(tmp_path):
    res = plan("datasets/workloads/small-8-adapters.csv", "--out", tmp_path / "plan.json")
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert "pool" not in doc["inputs"] and "cost_per_hour" not in doc["summary"]
    assert all("kind" not in i for i in doc["instances"])


def test_an_instance_of_a_kind_the_pool_lacks_is_refused_on_read(mixed, tmp_path):
    doc = json.loads(json.dumps(mixed[2]))
    doc["instances"][0]["kind"] = "a100"
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    res = CliRunner().invoke(main, ["render", str(tmp_path / "bad.json")])
    assert res.exit_code == 2 and "its kind a100 is not one of the pool's kinds" in res.output


def test_replan_of_the_same_workload_changes_nothing(mixed, tmp_path, monkeypatch):
    import planner.replan

    def no_bound(*_a):
        raise AssertionError("a pool re-plan records no lower bound: none is worked out")

    monkeypatch.setattr(planner.replan, "lower_bound", no_bound)
    d, p, _doc = mixed
    res = CliRunner().invoke(main, ["replan", WL, "--previous", str(d / "plan.json"), "--out", str(tmp_path / "re.json")])
    assert res.exit_code == 0, res.output
    re = read_placement(tmp_path / "re.json")
    assert [(i.instance_id, i.kind, i.a_max, i.adapters) for i in re.instances] == \
        [(i.instance_id, i.kind, i.a_max, i.adapters) for i in p.instances]
    assert not re.changes["moved_adapters"] and not re.changes["new_instances"] and not re.changes["restarts"]
    assert "lower_bound" not in re.inputs


def test_replan_keeps_adapters_on_their_kind_and_places_new_ones(mixed, tmp_path):
    d, p, _doc = mixed
    with open(WL, newline="") as f:
        rows = list(csv.DictReader(f))
    night = [{**r, "rate_rps": str(float(r["rate_rps"]) * (3.0 if k % 4 == 0 else 1.0))} for k, r in enumerate(rows[4:])]
    night += [{**rows[0], "adapter_id": f"new-{k}", "rank": str([8, 16, 32][k % 3]), "rate_rps": "0.5"} for k in range(9)]
    with open(tmp_path / "night.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(night)
    res = CliRunner().invoke(main, ["replan", str(tmp_path / "night.csv"), "--previous", str(d / "plan.json"),
                                    "--out", str(tmp_path / "re.json")])
    assert res.exit_code == 0, res.output
    re = read_placement(tmp_path / "re.json")
    assert re.summary()["all_ok"] and set(re.changes["added_adapters"]) == {f"new-{k}" for k in range(9)}
    assert set(re.changes["dropped_adapters"]) == {r["adapter_id"] for r in rows[:4]}
    before = {a: i.kind for i in p.instances for a in i.adapters}
    after = {a: i.kind for i in re.instances for a in i.adapters}
    assert all(after[a] == k for a, k in before.items() if a in after)
    assert all(after[f"new-{k}"] == "h100-64gb" for k in range(2, 9, 3))  # rank 32: the CPU kind cannot serve it
    assert all(i.instance_id.startswith(f"{i.kind}-gpu-") for i in re.instances)


def _two_h100_kinds(path, a_count: int, b_count: int | None = None) -> str:
    path.write_text("kinds:\n" + "".join(
        f"  - {{name: {n}, profile: {H100}, price_per_hour: {p}{'' if c is None else f', count: {c}'}}}\n"
        for n, p, c in (("a", 1.0, a_count), ("b", 2.0, b_count))))
    return str(path)


def test_replan_moves_what_a_kind_at_its_count_has_no_room_for_to_the_next_kind_and_back(tmp_path):
    """The cheaper kind's one GPU, at its count, falls short with tonight's traffic: the adapters it has no room
    for go to the next kind (a forced move, with its reason), every GPU passes; a quiet night brings them back to
    the cheaper kind of the same profile (within --max-moves); where no kind has room the re-plan is refused
    naming the kind's count and what to do, not --gpus (which a pool re-plan refuses)."""
    wl = tmp_path / "w.csv"
    wl.write_text("adapter_id,rank,rate_rps\n" + "".join(f"a{k},{[8, 16][k % 2]},0.5\n" for k in range(8)))
    res = plan(wl, "--pool", _two_h100_kinds(tmp_path / "pool.yaml", 1), "--out", tmp_path / "plan.json")
    assert res.exit_code == 0, res.output
    before = read_placement(tmp_path / "plan.json")
    assert [i.kind for i in before.instances] == ["a"]
    night = tmp_path / "night.csv"
    night.write_text("adapter_id,rank,rate_rps\n" + "".join(
        f"a{k},{[8, 16][k % 2]},{20.0 if k < 2 else 0.5}\n" for k in range(8)))
    res = CliRunner().invoke(main, ["replan", str(night), "--previous", str(tmp_path / "plan.json"),
                                    "--out", str(tmp_path / "re.json")])
    assert res.exit_code == 0, res.output
    re = read_placement(tmp_path / "re.json")
    assert re.summary()["all_ok"] and re.summary()["gpus_by_kind"]["a"] == 1 and re.summary()["gpus_by_kind"]["b"] >= 1
    spilled = [m for m in re.changes["moves"] if "kind a is at its count (1 GPU)" in m["reason"]]
    assert spilled and all(m["to"][0].startswith("b-gpu-") for m in spilled)
    assert "at its count of 1 GPU with no room for" in res.output
    res = CliRunner().invoke(main, ["replan", str(wl), "--previous", str(tmp_path / "re.json"),
                                    "--out", str(tmp_path / "quiet.json")])  # a quiet night: back where it is cheaper
    assert res.exit_code == 0, res.output
    quiet = read_placement(tmp_path / "quiet.json")
    assert quiet.summary()["all_ok"] and quiet.summary()["gpus_by_kind"] == {"a": 1, "b": 0}
    assert {m["adapter_id"] for m in quiet.changes["moves"]} == {m["adapter_id"] for m in spilled}
    assert all(m["reason"] == "back to kind a: cheaper, with room under its count" for m in quiet.changes["moves"])
    res = CliRunner().invoke(main, ["replan", str(wl), "--previous", str(tmp_path / "re.json"),
                                    "--out", str(tmp_path / "held.json"), "--max-moves", "0"])
    assert res.exit_code == 0 and read_placement(tmp_path / "held.json").summary()["gpus_by_kind"]["b"] >= 1
    (tmp_path / "one.yaml").write_text(f"kinds: [{{name: a, profile: {H100}, price_per_hour: 1, count: 1}}]")
    res = plan(wl, "--pool", tmp_path / "one.yaml", "--out", tmp_path / "one.json")
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["replan", str(night), "--previous", str(tmp_path / "one.json"),
                                    "--out", str(tmp_path / "re1.json")])
    assert res.exit_code == 3 and "kind a is at its count (1 GPU) and has no room for" in res.output, res.output
    assert "`planner plan --pool` chooses every adapter's kind again" in res.output and "--gpus" not in res.output
    assert not (tmp_path / "re1.json").exists()


def test_a_pool_of_kinds_serving_models_of_other_shapes_is_planned_with_a_note_saying_so(tmp_path):
    """A LoRA adapter fits one base model: a Llama kind beside a Qwen one is priced all the same (the CPU kind's
    tiny model exercises pools that way), with a note naming each kind's model shape; kinds of one model get
    none."""
    small = "datasets/workloads/small-8-adapters.csv"
    (tmp_path / "two.yaml").write_text(f"kinds: [{{name: a, profile: {H100}, price_per_hour: 1}}, "
                                       "{name: b, profile: h100-64gb-qwen2.5-7b, price_per_hour: 1}]")
    res = plan(small, "--pool", tmp_path / "two.yaml")
    assert res.exit_code == 0, res.output
    assert ("note: the kinds' profiles serve models of different shapes (a: 32 layers, 8 KV heads of 128; b: 28 "
            "layers, 4 KV heads of 128)") in res.output
    res = plan(small, "--pool", "datasets/workloads/h100-pool.yaml")
    assert res.exit_code == 0 and "models of different shapes" not in res.output, res.output
    # its 80 GB kind's profile is measured on 5 real runs: the plan says so
    note = ("note: kind h100-80gb: profile h100-80gb-llama-3.1-8b is not plan-grade: its safety margin rests on 5 "
            "real runs (plan-grade from 10: `planner margin` sizes it from validation runs), so treat its plans as estimates")
    assert [line for line in res.output.splitlines() if line.startswith("note:")] == [note]


def test_a_kind_that_serves_none_of_the_adapters_is_passed_over(tmp_path):
    (tmp_path / "r32.csv").write_text("adapter_id,rank,rate_rps\na0,32,0.5\na1,32,0.2\na2,32,1.0\n")
    res = plan(tmp_path / "r32.csv", "--pool", pool_yaml(tmp_path / "pool.yaml"), "--out", tmp_path / "plan.json")
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["summary"]["gpus_by_kind"] == {"h100-64gb": 1, "cpu": 0}
    cpu = next(r for r in doc["inputs"]["pool"]["single_kind"] if r["kind"] == "cpu")
    assert cpu["gpus"] is None and "cannot serve any" in cpu["why_not"]


def test_a_pool_file_that_is_no_regular_file_or_too_large_is_refused(tmp_path):
    (tmp_path / "big.yaml").write_text("# " + "x" * (1 << 20) + "\n")
    for path, words in (("/dev/zero", "not a regular file"), (tmp_path, "is a directory"),
                        (tmp_path / "big.yaml", "too large for the pool file")):
        res = plan(WL, "--pool", path)
        assert res.exit_code == 2 and words in res.output, res.output


def _planner(tmp_path, pool_file=None, workload=None, **counts):
    """A PoolPlanner of ``workload`` (default: WL) over ``pool_file`` (default: :func:`pool_yaml` with ``counts``)."""
    from planner.cli_plan import load_predictor_for
    from planner.plan import PlanOptions
    from planner.pool import read_pool
    from planner.pool_plan import PoolPlanner
    from planner.workload_csv import read_workload

    pool = read_pool(pool_file or pool_yaml(tmp_path / f"pool-{len(list(tmp_path.iterdir()))}.yaml", **counts))
    return PoolPlanner(workload or read_workload(WL), pool, lambda p: load_predictor_for(p, "auto"), PlanOptions(),
                       None)


def test_judging_takes_surrogate_kinds_first_and_stops_where_an_option_cannot_beat_the_bound(tmp_path, monkeypatch):
    from planner.pool_plan import PoolChoice, PoolPlanner

    planner = _planner(tmp_path)
    judged = []
    monkeypatch.setattr(PoolPlanner, "confirm",
                        lambda self, pack, reuse=False, bound=None: judged.append(pack.kind.name) or pack)
    option = PoolChoice([planner.pack(k, members) for k, members in
                         ((planner.pool.kinds[1], planner.servable["cpu"].nonzero()[0][:40]),
                          (planner.pool.kinds[0], planner.servable["cpu"].nonzero()[0][40:]))], None)
    assert planner.judge(option, bound=option.cost) is None and judged == []
    assert planner.judge(option).cost == option.cost and judged == ["h100-64gb", "cpu"]


def test_a_mix_that_judging_takes_over_a_count_is_formed_again_with_room_kept(tmp_path, monkeypatch):
    """Judging that adds a GPU of the counted kind to every packing of it: the first mix comes out over the count,
    so the mixes are formed again with one GPU of room kept on that kind, and the plan is within the count."""
    from planner.pool_plan import PoolPlanner, plan_pool

    monkeypatch.setattr(PoolPlanner, "confirm", lambda self, pack, reuse=False, bound=None: pack)
    free = plan_pool(_planner(tmp_path)).chosen
    cpu = next(p.gpus for p in free.packs if p.kind.name == "cpu")
    formed = []
    mixes = PoolPlanner.mixes
    monkeypatch.setattr(PoolPlanner, "mixes", lambda self, *a: formed.append(mixes(self, *a)) or formed[-1])
    monkeypatch.setattr(PoolPlanner, "confirm", _a_cpu_gpu_more)
    planner = _planner(tmp_path, cpu_count=cpu)
    chosen = plan_pool(planner).chosen
    assert planner.slack == {"cpu": 1} and len(formed) == 2
    cpu_packed = [[p.gpus for p in m.packs if p.kind.name == "cpu"] for m in formed[1]]
    assert cpu_packed and all(g <= [cpu - 1] for g in cpu_packed)
    assert not chosen.over_count()


def _a_cpu_gpu_more(self, pack, reuse=False, bound=None):
    """PoolPlanner.confirm where judging splits the cpu kind's GPU of the most adapters in two; a packing judged
    already is kept."""
    from planner.confirm import Confirmation
    from planner.packing import GpuGroup
    from planner.pool_plan import KindPack

    if pack.confirmation is not None:
        return pack
    groups = pack.groups
    if pack.kind.name == "cpu":
        k = max(range(len(groups)), key=lambda k: len(groups[k]))
        most = list(groups[k].shares.items())
        groups = groups[:k] + groups[k + 1:] + [GpuGroup(dict(part), groups[k].a_max, groups[k].max_lora_rank)
                                                for part in (most[:len(most) // 2], most[len(most) // 2:])]
    rows = [{"adapters": sorted(pack.members[g.members].tolist())} for g in groups]
    return KindPack(pack.kind, pack.members, pack.req, groups,
                    Confirmation(self.opts.bar(pack.kind.profile), self.opts.run, 0.0, 1, 0, 0, rows, 0.0))


def test_a_mix_judged_over_a_count_gives_up_the_gpus_cheapest_to_move_and_keeps_the_others_as_judged(tmp_path,
                                                                                                       monkeypatch):
    """Judging added a GPU of the counted kind: the mix is also tried with that kind giving up the judged GPU whose
    adapters cost least on the other kind, which packs them with its own; the GPUs kept are not judged again."""
    from planner.pool_plan import PoolPlanner, plan_pool

    judge = PoolPlanner.confirm
    monkeypatch.setattr(PoolPlanner, "confirm", lambda self, pack, reuse=False, bound=None: pack)
    cpu = next(p.gpus for p in plan_pool(_planner(tmp_path)).chosen.packs if p.kind.name == "cpu")
    monkeypatch.setattr(PoolPlanner, "confirm", _a_cpu_gpu_more)
    trims = []
    trimmed = PoolPlanner.trimmed
    monkeypatch.setattr(PoolPlanner, "trimmed", lambda self, judged, prices: trims.append(
        (judged, prices, trimmed(self, judged, prices))) or trims[-1][2])
    planner = _planner(tmp_path, cpu_count=cpu)
    plan_pool(planner)
    judged, prices, trim = trims[0]
    before, after = (next(p for p in o.packs if p.kind.name == "cpu") for o in (judged, trim))

    def as_sets(p):
        return [frozenset(p.members[g.members].tolist()) for g in p.groups]

    assert before.gpus == cpu + 1 and after.gpus == cpu and set(as_sets(after)) < set(as_sets(before))
    (moved,) = set(as_sets(before)) - set(as_sets(after))
    whole = [s for s, g in zip(as_sets(before), before.groups) if min(g.shares.values()) == 1.0]
    assert prices[0, sorted(moved)].sum() == min(prices[0, sorted(s)].sum() for s in whole)
    h100 = next(p for p in trim.packs if p.kind.name == "h100-64gb")
    assert moved <= set(h100.members.tolist()) and not moved & set(after.members.tolist())
    assert after.confirmation.rows == [{"adapters": sorted(s)} for s in as_sets(after)]  # each GPU's own figures
    assert judge(planner, after) is after


def _a_gpu_off_cpu_a(self, prices, bound=np.inf, gpus=1):
    """PoolPlanner.mixes of a pool of cpu-a and cpu-b: one mix, ``gpus`` GPUs' worth fewer adapters on cpu-a (the
    fewest last ones), those on cpu-b."""
    from planner.pool_plan import PoolChoice

    a, b = self.pool.kinds
    n = len(self.workload)
    alone = self.pack(a, np.arange(n)).gpus
    k = next(k for k in range(1, n) if self.pack(a, np.arange(n - k)).gpus <= alone - gpus)
    return [PoolChoice([self.pack(a, np.arange(n - k)), self.pack(b, np.arange(n - k, n))], None)]


def test_a_mix_the_twin_packed_kinds_judged_alone_show_no_cheaper_is_not_judged(tmp_path, monkeypatch):
    """Judging adds a GPU to every packing of a twin-packed kind: once a kind's packing of every adapter came out
    a GPU over its estimate, a mix whose estimate is cheaper than that only by less than that shortfall is not
    judged (it is, with the shortfall left out), and the plan is the same."""
    from planner.pool_plan import KindPack, PoolPlanner, plan_pool
    from planner.workload_csv import read_workload
    from twin.workload import Workload

    wl = Workload(tuple(a for a in read_workload(WL).adapters if a.rank <= 16))  # both kinds serve every one
    (tmp_path / "pool.yaml").write_text("kinds:\n" + "".join(  # one of cpu-b: it cannot serve everything alone
        f"  - {{name: {n}, profile: {CPU}, price_per_hour: {p}{c}}}\n"
        for n, p, c in (("cpu-a", 0.01, ""), ("cpu-b", 0.015, ", count: 1"))))
    judged = []
    monkeypatch.setattr(PoolPlanner, "confirm", lambda self, pack, reuse=False, bound=None: judged.append(
        pack.kind.name) or KindPack(pack.kind, pack.members, pack.req, pack.groups + pack.groups[-1:]))

    monkeypatch.setattr(PoolPlanner, "mixes", _a_gpu_off_cpu_a)
    outcomes = []
    for shortfall in (True, False):
        if not shortfall:
            monkeypatch.setattr(PoolPlanner, "expected_cost", lambda self, option, unjudged=1.0: option.cost)
        judged.clear()
        planner = _planner(tmp_path, tmp_path / "pool.yaml", wl)
        outcomes.append((plan_pool(planner).chosen, list(judged)))
    (chosen, with_shortfall), (same, without) = outcomes
    alone = chosen.packs[0].gpus
    assert chosen.single == same.single == "cpu-a" and same.packs[0].gpus == alone
    assert planner.estimate_shortfall == {"cpu-a": alone / (alone - 1)}
    assert with_shortfall == ["cpu-a"] and without == ["cpu-a", "cpu-a"]  # the mix's cpu-a part: a GPU more too


def test_a_twin_packed_kind_alone_within_a_gpu_of_the_best_judged_is_judged_all_the_same(tmp_path, monkeypatch):
    """Its estimate's shorter runs can pack a GPU more than the judging runs: a kind the twin packs, alone, whose
    packing costs more than a mix by less than one of its GPUs is judged however the mix judges, so it is judged
    first, and taken where the judging runs pack it on a GPU fewer (a pool plan costs no more than `planner plan`
    of any kind alone); the mix, whose judging only adds GPUs, is then passed over."""
    from planner.pool_plan import KindPack, PoolPlanner, plan_pool
    from planner.workload_csv import read_workload
    from twin.workload import Workload

    wl = Workload(tuple(a for a in read_workload(WL).adapters if a.rank <= 16))
    (tmp_path / "pool.yaml").write_text("kinds:\n" + "".join(
        f"  - {{name: {n}, profile: {CPU}, price_per_hour: {p}{c}}}\n"
        for n, p, c in (("cpu-a", 0.01, ""), ("cpu-b", 0.005, ", count: 1"))))
    judged = []

    def confirm(self, pack, reuse=False, bound=None):  # alone, the judging runs pack a GPU fewer than the estimate
        judged.append("alone" if len(pack.members) == len(wl) else pack.kind.name)
        return KindPack(pack.kind, pack.members, pack.req, pack.groups[:-1] if len(pack.members) == len(wl)
                        else pack.groups)

    monkeypatch.setattr(PoolPlanner, "confirm", confirm)
    monkeypatch.setattr(PoolPlanner, "mixes", _a_gpu_off_cpu_a)
    planner = _planner(tmp_path, tmp_path / "pool.yaml", wl)
    estimate = planner.pack(planner.pool.kinds[0], np.arange(len(wl))).gpus
    chosen = plan_pool(planner).chosen
    mix = _a_gpu_off_cpu_a(planner, None)[0]
    assert mix.cost < estimate * 0.01  # the mix is the cheaper as packed, yet the kind alone is judged first
    assert judged == ["alone"]
    assert chosen.single == "cpu-a" and chosen.packs[0].gpus == estimate - 1


def test_a_twin_packed_kind_alone_within_the_gpus_judging_is_expected_to_add_to_a_mix_is_judged_first(
        tmp_path, monkeypatch):
    """A mix two GPUs of the twin-packed kind cheaper as packed than that kind alone, whose judging is expected to
    add a GPU (ESTIMATE_SHORTFALL): the kind alone is within a GPU of what the mix is expected to cost, so it is
    judged first, and the mix after it may keep its GPUs, instead of both being judged in full (a hot
    10,000-adapter fleet: 984 s)."""
    from planner.pool_plan import PoolPlanner, plan_pool
    from planner.workload_csv import read_workload
    from twin.workload import Workload

    wl = Workload(tuple(a for a in read_workload(WL).adapters if a.rank <= 16))
    (tmp_path / "pool.yaml").write_text("kinds:\n" + "".join(
        f"  - {{name: {n}, profile: {CPU}, price_per_hour: {p}{c}}}\n"
        for n, p, c in (("cpu-a", 0.01, ""), ("cpu-b", 0.001, ", count: 2"))))
    judged = []
    monkeypatch.setattr(PoolPlanner, "confirm", lambda self, pack, reuse=False, bound=None: judged.append(
        ("alone" if len(pack.members) == len(wl) else pack.kind.name, reuse)) or pack)
    monkeypatch.setattr(PoolPlanner, "mixes", lambda self, prices, bound=np.inf: _a_gpu_off_cpu_a(
        self, prices, bound, gpus=2))
    planner = _planner(tmp_path, tmp_path / "pool.yaml", wl)
    mix = planner.mixes(None)[0]
    alone = planner.pack(planner.pool.kinds[0], np.arange(len(wl)))
    assert alone.cost - 0.01 > mix.cost + 1e-9  # more than a GPU dearer as packed
    chosen = plan_pool(planner).chosen
    assert judged[0] == ("alone", False) and ("cpu-a", True) in judged and chosen.single is None


def test_a_twin_packed_kind_balances_only_the_packing_that_prices_its_adapters(tmp_path, monkeypatch):
    """Its other packings serve only for their GPU count, which balancing keeps: the mixes formed and the plan
    are those of balancing every packing."""
    from planner.pool_plan import PoolPlanner, plan_pool

    monkeypatch.setattr(PoolPlanner, "confirm", lambda self, pack, reuse=False, bound=None: pack)
    formed = []
    mixes = PoolPlanner.mixes
    monkeypatch.setattr(PoolPlanner, "mixes", lambda self, *a: formed.append(mixes(self, *a)) or formed[-1])
    planner = _planner(tmp_path)
    chosen = plan_pool(planner).chosen
    balanced = {key[:2] for key in planner._packed if key[2]}
    assert any(not key[2] and key[0] == "cpu" for key in planner._packed)  # unbalanced packings were made
    pack = PoolPlanner.pack
    monkeypatch.setattr(PoolPlanner, "pack", lambda self, kind, members, priced=False, padded=False: pack(
        self, kind, members, True, padded))
    every = _planner(tmp_path)
    again = plan_pool(every).chosen
    assert [m.key() for m in formed[0]] == [m.key() for m in formed[1]] and chosen.key() == again.key()
    assert all(p.gpus == every._packed[key[:2] + (True, key[3])].gpus for key, p in planner._packed.items())
    assert balanced == {("cpu", planner.servable["cpu"].nonzero()[0].tobytes())} | {
        key[:2] for key in planner._packed if key[0] == "h100-64gb"}  # the surrogate's kind: every packing


@pytest.mark.parametrize("fewest", [True, False])
def test_the_pool_bisection_finds_the_edge_from_any_guess_and_stops_at_a_count_known_to_fit(fewest):
    from planner.pool_plan import _bisect

    def fitting(edge: int, asked: list[int]):
        def fits(k: int) -> bool:
            asked.append(k)
            return k >= edge if fewest else k <= edge
        return fits

    for n in (0, 1, 7, 100):
        for edge in range(n + 1):
            for guess in (0, 1, edge, n, n + 5):
                assert _bisect(n, guess, 2 * n.bit_length() + 2, fitting(edge, []), fewest) == edge
                asked: list[int] = []
                found = _bisect(n, guess, 2, fitting(edge, asked), fewest)
                known = n if fewest else 0  # taken to fit without asking
                assert len(asked) <= 2 and (found == known or found in asked)
                assert (found >= edge) if fewest else (found <= edge)


@pytest.mark.parametrize("fewest", [True, False])
def test_the_pool_bisection_from_a_guess_near_the_edge_lands_near_it_in_four_packings(fewest):
    """The guess (price shares) is some percent off: stepping from it, not halving 0..guess, brings a twin-packed
    kind's four packings within a third of the edge (halving from a guess of 379 below an edge of 433 stopped at
    582 moved where 433 were needed)."""
    from planner.pool_plan import TWIN_MOVE_PROBES, _bisect

    for edge, guess in ((379, 433), (433, 379), (490, 540), (1000, 1000), (60, 40)):
        found = _bisect(2000, guess, TWIN_MOVE_PROBES, lambda k, e=edge: k >= e if fewest else k <= e, fewest)
        assert (found >= edge if fewest else found <= edge) and abs(found - edge) <= edge / 3


def test_a_mix_keeping_judged_gpus_is_not_packed_in_full_again_where_that_could_not_make_it_the_cheapest(
        tmp_path, monkeypatch):
    """Keeping the GPUs judged before took more GPUs than the estimate: the share is packed in full again only
    where its expected judged cost leaves the option a chance to beat the best judged (a hot 10,000-adapter fleet:
    five minutes of judging, to lose all the same). That the estimate fell short for this share shows it: the
    estimate at least ESTIMATE_SHORTFALL over (or as much as the kind's packings judged in full took over theirs),
    and at most what keeping them took (a Zipf one: 32 GPUs estimated, 33 kept, 33 again in full, 170 s)."""
    from planner import pool_plan
    from planner.pool_plan import ESTIMATE_SHORTFALL, KindPack, PoolPlanner

    planner = _planner(tmp_path)
    cpu = next(k for k in planner.pool.kinds if k.name == "cpu")
    pack = planner.pack(cpu, planner.servable["cpu"].nonzero()[0][:40])
    full = []
    monkeypatch.setattr(pool_plan, "plan_groups", lambda req, *a, **k: full.append(req) or (pack.groups, None))
    monkeypatch.setattr(PoolPlanner, "_reused", lambda self, p: ("done", [], []))

    def keeping_takes(extra):
        monkeypatch.setattr(PoolPlanner, "_judge_rest", lambda self, p, *kept: KindPack(
            p.kind, p.members, p.req, p.groups + p.groups[-1:] * extra))

    keeping_takes(1)
    planner._in_full["cpu"] = [(9, 9)]  # judging the kind in full took no more than its estimate
    assert planner.confirm(pack, reuse=True, bound=pack.cost + cpu.price).gpus == pack.gpus + 1 and not full
    assert planner.confirm(pack, reuse=True, bound=pack.cost + cpu.price + 1e-6).gpus == pack.gpus and len(full) == 1
    assert planner._in_full["cpu"] == [(9, 9), (pack.gpus, pack.gpus)]  # a packing in full, noted
    keeping_takes(3)
    shortfall = max(np.ceil(pack.gpus * (1 + ESTIMATE_SHORTFALL)), pack.gpus + 1) * cpu.price
    assert planner.confirm(pack, reuse=True, bound=shortfall).gpus == pack.gpus + 3 and len(full) == 1
    assert planner.confirm(pack, reuse=True, bound=shortfall + 1e-6).gpus == pack.gpus and len(full) == 2
    planner._in_full["cpu"] = [(9, 9), (12, 6)]  # together 1.4x their estimates
    assert planner.confirm(pack, reuse=True, bound=shortfall + 1e-6).gpus == pack.gpus + 3 and len(full) == 2


def test_a_mix_is_expected_to_cost_its_judged_packings_as_they_are_and_the_others_with_the_shortfall(tmp_path):
    """The GPUs judging added to a twin-packed kind alone scale a mix's estimate of that kind, not a packing of
    it judged already (a mix trimmed to a count keeps its judged GPUs)."""
    from planner.confirm import Confirmation
    from planner.pool_plan import KindPack, PoolChoice

    planner = _planner(tmp_path)
    cpu = planner.pool.kinds[1]
    pack = planner.pack(cpu, planner.servable["cpu"].nonzero()[0])
    planner.estimate_shortfall["cpu"] = 1.5
    judged = KindPack(cpu, pack.members, pack.req, pack.groups, Confirmation(None, None, 0.0, 1, 0, 0, [], 0.0))
    assert planner.expected_cost(PoolChoice([judged], None)) == pytest.approx(pack.cost)
    assert planner.expected_cost(PoolChoice([pack], None)) == pytest.approx(np.ceil(pack.gpus * 1.5) * cpu.price)
    assert planner.expected_cost(PoolChoice([judged], None), 2.0) == pytest.approx(pack.cost)


def test_a_twin_packed_kind_asked_for_the_adapters_it_priced_is_not_packed_again(tmp_path):
    """Balancing keeps the GPU count, which is all a mix asks of its packing: the priced one serves."""
    planner = _planner(tmp_path)
    cpu = next(k for k in planner.pool.kinds if k.name == "cpu")
    members = planner.servable["cpu"].nonzero()[0]
    priced = planner.pack(cpu, members, priced=True)
    assert planner.pack(cpu, members) is priced and len(planner._packed) == 1
    assert planner.pack(cpu, members[1:]) is not priced and len(planner._packed) == 2


def test_a_mix_keeps_the_twin_packed_gpus_judged_for_an_earlier_option_and_packs_only_the_rest(tmp_path):
    """A kind the twin packs, judged serving every adapter; a mix leaving a few of them to another kind keeps
    every GPU that holds none of those (the same adapters, the same figures as the twin gives them anew) and
    packs only the adapters of the others again, every GPU judged, where that takes no more GPUs than its
    estimate (else the fewer of that and a packing of all); an option of one kind is packed in full."""
    from planner.confirm import check_groups
    from planner.pool_plan import KindPack, PoolChoice

    planner = _planner(tmp_path)
    cpu = planner.pool.kinds[1]
    members = planner.servable["cpu"].nonzero()[0]
    alone = planner.judge(PoolChoice([planner.pack(cpu, members)], "cpu")).packs[0]
    assert alone.gpus >= 3
    first = alone.groups[0]
    moved = alone.members[first.members[:2]]
    estimate = planner.pack(cpu, np.setdiff1d(members, moved))
    roomy = KindPack(cpu, estimate.members, estimate.req,  # an estimate of a GPU more than judging alone took
                     estimate.groups + estimate.groups[:1] * (alone.gpus + 1 - estimate.gpus))
    pack = planner.confirm(roomy, reuse=True)

    def as_sets(p):
        return [frozenset(p.members[g.members].tolist()) for g in p.groups]

    untouched = as_sets(alone)[1:]
    assert as_sets(pack)[:len(untouched)] == untouched
    kept = pack.groups[:len(untouched)]
    anew = check_groups(pack.req, kept, planner.opts.run, planner.opts.bar(cpu.profile))
    assert pack.confirmation.rows[:len(kept)] == [anew.row(k, planner.opts.bar(cpu.profile)) for k in range(len(kept))]
    assert len(pack.confirmation.rows) == pack.gpus and all(r["meets"] for r in pack.confirmation.rows)
    served = np.zeros(len(pack.members))
    for g in pack.groups:
        for i, share in g.shares.items():
            served[i] += share
    assert np.allclose(served, 1.0) and set(pack.members) == set(members) - set(moved)
    assert planner.confirm(estimate, reuse=True).gpus <= pack.gpus
    again = planner.judge(PoolChoice([planner.pack(cpu, members)], "cpu")).packs[0]
    assert as_sets(again) == as_sets(alone)  # a single kind is packed in full, as `planner plan` packs it


def test_a_kind_its_count_left_gpus_unused_takes_back_the_adapters_cheaper_on_it_but_not_a_hot_one(tmp_path):
    """A mix whose counted kind packs two GPUs under its count, a GPU's adapters and a hot one (replicas on six of
    its GPUs) moved to a dearer kind: filling takes the GPU's adapters back up to the count, though the hot one is
    first in line (its GPUs would not fit)."""
    from dataclasses import replace

    from planner.workload_csv import read_workload
    from twin.workload import Workload

    base = [a for a in read_workload(WL).adapters if a.rank <= 16]  # both kinds serve every one
    wl = Workload(tuple(base) + (replace(base[0], adapter_id="hot", rate_rps=40.0),))
    n, hot = len(wl.adapters), len(wl.adapters) - 1

    def planner_and_prices(count=""):
        (tmp_path / "pool.yaml").write_text("kinds:\n" + "".join(
            f"  - {{name: {k}, profile: {CPU}, price_per_hour: {p}{c}}}\n"
            for k, p, c in (("cpu-a", 0.01, count), ("cpu-b", 0.015, ""))))
        planner = _planner(tmp_path, tmp_path / "pool.yaml", wl)
        return planner, np.array([planner.adapter_prices(planner.pack(k, np.arange(n), priced=True))
                                  for k in planner.pool.kinds])

    planner, prices = planner_and_prices()
    a = planner.pool.kinds[0]
    alone = planner.pack(a, np.arange(n), priced=True)
    assert prices[0, hot] > 5 * a.price  # its replicas take six GPUs
    moved = np.array(sorted(next(g for g in alone.groups if hot not in g.shares and len(g.shares) > 3).shares))
    choice = np.zeros(n, np.int64)
    choice[moved] = choice[hot] = 1
    used = planner.pack(a, np.flatnonzero(choice == 0)).gpus
    planner, prices = planner_and_prices(f", count: {used + 2}")
    prices[1, hot] *= 10  # the hot one first in line: by far the cheapest on cpu-a for its price on cpu-b
    filled = planner.fill(choice, prices)
    assert (filled[moved] == 0).all() and filled[hot] == 1
    assert used < planner.pack(a, np.flatnonzero(filled == 0)).gpus <= used + 2
    assert planner._choice(filled).cost < planner._choice(choice).cost


def test_a_twin_packed_kind_fills_its_gpus_leaving_room_for_what_its_judging_runs_add(tmp_path):
    """Its estimate's shorter runs pack a little tighter than the judging runs: the adapters it takes from other
    kinds are those that fit on its GPUs at ESTIMATE_SHORTFALL more traffic (a rank-32 10,000-adapter share filled to
    the edge of 29 estimated GPUs of the 80 GB kind judged 30, and minutes went into a mix that lost)."""
    from planner.pool_plan import ESTIMATE_SHORTFALL, plan_pool

    planner = _planner(tmp_path)
    plan_pool(planner)
    cpu = next(k for k in planner.pool.kinds if k.name == "cpu")
    padded = [p for key, p in planner._packed.items() if key[0] == "cpu" and key[3]]
    assert padded and not any(key[3] for key in planner._packed if key[0] != "cpu")  # the surrogate's kind: as asked
    for p in padded:
        plain = planner.request(cpu, p.members)
        assert np.allclose(p.req.rates_rps, plain.rates_rps * (1 + ESTIMATE_SHORTFALL))


def test_a_mix_whose_surrogate_kinds_judging_adds_gpus_has_the_twin_packed_kind_alone_judged_before_it(
        tmp_path, monkeypatch):
    """A mix's kinds with a surrogate are judged (seconds) before it is weighed against a twin-packed kind alone:
    the GPU their judging adds brings that kind alone within a GPU of what the mix is then expected to cost, so the
    kind alone is judged first and the mix keeps its GPUs (a rank-32 10,000-adapter fleet at `80gb-at-par`: the
    64 GB share's judging added 3 GPUs, and the 80 GB kind was packed by the judging twin twice, 2.2x the
    single-kind plans' wall time)."""
    from dataclasses import replace

    from planner.confirm import Confirmation
    from planner.pool_plan import ESTIMATE_SHORTFALL, KindPack, PoolPlanner, plan_pool
    from planner.workload_csv import read_workload
    from twin.workload import Workload

    wl = Workload(tuple(replace(a, rate_rps=5 * a.rate_rps) for a in read_workload(WL).adapters if a.rank <= 16))
    (tmp_path / "pool.yaml").write_text(
        f"kinds:\n  - {{name: cpu-a, profile: {CPU}, price_per_hour: 0.015}}\n"
        f"  - {{name: h100, profile: {H100}, price_per_hour: 0.01, count: 2}}\n")
    judged = []

    def confirm(self, pack, reuse=False, bound=None):  # judging adds a GPU to every h100 packing
        if pack.confirmation is not None:
            return pack
        judged.append(("alone" if len(pack.members) == len(wl) else "mix", pack.kind.name, reuse))
        return KindPack(pack.kind, pack.members, pack.req,
                        pack.groups + pack.groups[-1:] if pack.kind.name == "h100" else pack.groups,
                        Confirmation(None, None, 0.0, 1, 0, 0, [], 0.0))

    monkeypatch.setattr(PoolPlanner, "confirm", confirm)
    monkeypatch.setattr(PoolPlanner, "mixes", lambda self, prices, bound=np.inf: _a_gpu_off_cpu_a(
        self, prices, bound, gpus=3))
    planner = _planner(tmp_path, tmp_path / "pool.yaml", wl)
    (mix,) = planner.mixes(None)
    cpu, h100 = mix.packs
    alone = planner.pack(cpu.kind, np.arange(len(wl)))
    # h100 alone packs on its count of 2, and judged on 3 it is no plan
    assert h100.gpus == 1 and planner.pack(h100.kind, np.arange(len(wl))).gpus == 2
    # As packed, the mix is expected to cost less than the cpu kind alone less one of its GPUs; with its h100
    # share judged, no longer.
    expected = np.ceil(cpu.gpus * (1 + ESTIMATE_SHORTFALL)) * cpu.kind.price
    assert alone.cost - cpu.kind.price > expected + h100.cost > alone.cost - cpu.kind.price - h100.kind.price
    chosen = plan_pool(planner).chosen
    assert judged == [("alone", "h100", False), ("mix", "h100", False), ("alone", "cpu-a", False),
                      ("mix", "cpu-a", True)]
    assert chosen.single is None and chosen.cost == pytest.approx(cpu.cost + 2 * h100.kind.price)
