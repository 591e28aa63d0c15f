"""Large forward/forward_backward requests run in parts: the planner's policy (shares, order,
tokens in flight). The executor's side (bits of the whole, a resent part never runs twice):
tests/workers/trainer/test_executor_parts.py."""

from __future__ import annotations

from contract.queue import QueuedRequest
from contract.queue import Part
from contract.queue import PartProgress
from scheduler.planner import CyclePlanner


def req(model: str, seq: int, tokens: int = 10, tenant: str | None = None, kind: str = "forward_backward"):
    return QueuedRequest(f"{model}-{seq}", tenant or f"tenant-{model}", model, seq, kind, tokens)


def test_a_request_larger_than_the_budget_runs_one_part_per_cycle_from_where_it_stopped():
    planner = CyclePlanner(token_budget=1000)
    big = req("m", 1, tokens=3500)
    cycle = planner.plan({"m": [big]})
    assert [(q.id, q.num_tokens) for q in cycle.forward_backward] == [("m-1", 1000)]  # alone: the whole budget
    assert cycle.parts == {"m-1": Part(0, 1000)} and not cycle.continuing
    planner.advanced("m-1", PartProgress(datums=7, tokens=980))  # whole passes: a bit under the cap
    cycle = planner.plan({})  # its model is running: the reorder buffer offers nothing of it
    assert cycle.parts == {"m-1": Part(7, 1000)} and cycle.continuing == {"m-1"}
    planner.advanced("m-1", PartProgress(datums=30, tokens=3300))
    assert planner.plan({}).forward_backward[0].num_tokens == 200  # what is left
    planner.finished("m-1")
    assert not planner.plan({})


def test_while_other_tenants_have_work_a_part_takes_half_the_budget_and_they_take_their_turns():
    planner = CyclePlanner(token_budget=1000)
    runnable = {"big": [req("big", 1, tokens=50_000)], "s": [req("s", 1, tokens=30)], "t": [req("t", 4, tokens=400)]}
    cycle = planner.plan(runnable)
    assert {q.id: q.num_tokens for q in cycle.forward_backward} == {"big-1": 500, "s-1": 30, "t-4": 400}
    for _ in range(3):  # whoever goes first, a small request always finds room beside the part
        assert "s-2" in [q.id for q in planner.plan({"s": [req("s", 2, tokens=30)], "t": [req("t", 5, tokens=450)]})
                         .forward_backward]


def test_a_models_later_requests_wait_for_its_last_part():
    planner = CyclePlanner(token_budget=1000)
    cycle = planner.plan({"m": [req("m", 1, tokens=2000), req("m", 2, tokens=10)]})
    assert [q.id for q in cycle.forward_backward] == ["m-1"]


def test_a_large_request_behind_its_models_requests_of_this_cycle_starts_in_the_next():
    planner = CyclePlanner(token_budget=1000)
    cycle = planner.plan({"m": [req("m", 1, tokens=10), req("m", 2, tokens=2000)]})
    assert [q.id for q in cycle.forward_backward] == ["m-1"] and not cycle.parts and not planner.splits


def test_without_splitting_a_large_request_runs_whole_and_alone():
    planner = CyclePlanner(token_budget=1000, split_requests=False)
    cycle = planner.plan({"big": [req("big", 1, tokens=5000)], "s": [req("s", 1, tokens=30)]})
    assert [q.id for q in cycle.forward_backward] in (["big-1"], ["s-1"])  # whichever goes first, alone
    assert not cycle.parts


def test_a_tenants_new_requests_wait_while_its_tokens_in_flight_exceed_the_limit():
    planner = CyclePlanner(token_budget=1000, tenant_max_tokens_in_flight=3000)
    first = planner.plan({"m1": [req("m1", 1, tokens=5000, tenant="hog")]})  # nothing in flight: it starts
    assert first.parts
    runnable = {"m2": [req("m2", 1, tokens=40, tenant="hog")], "x": [req("x", 1, tokens=40)]}
    cycle = planner.plan(runnable)  # 4,000 tokens of m1 still to run: hog's m2 waits; x does not
    assert sorted(q.id for q in cycle.forward_backward) == ["m1-1", "x-1"]
    planner.advanced("m1-1", PartProgress(datums=40, tokens=2980))  # 2,020 left: m2's 40 fit
    assert "m2-1" in [q.id for q in planner.plan(runnable).forward_backward]


def test_the_limit_counts_this_cycles_requests_too():
    planner = CyclePlanner(token_budget=10_000, tenant_max_tokens_in_flight=500)
    runnable = {f"m{i}": [req(f"m{i}", 1, tokens=300, tenant="hog")] for i in range(3)}
    assert len(planner.plan(runnable).forward_backward) == 1  # 300 + 300 > 500
