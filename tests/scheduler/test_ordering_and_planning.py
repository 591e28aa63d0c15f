"""seq_id order per model, batching of consecutive forward/backward runs, and fair cycles."""

import pytest

from contract.queue import QueuedRequest
from scheduler.ordering import ReorderBuffer
from scheduler.planner import CyclePlanner


def req(model, seq, kind="forward_backward", tenant=None, tokens=10):
    return QueuedRequest(f"{model}-{seq}", tenant or f"tenant-{model}", model, seq, kind, tokens)


def test_out_of_order_arrival_waits_for_the_first_chunk():
    buf = ReorderBuffer()
    for seq in (3, 2):  # chunks 2 and 3 arrive first; chunk 1 last
        buf.add(req("m", seq), next_seq=1)
    assert buf.runnable() == {}
    buf.add(req("m", 1))
    assert [r.seq_id for r in buf.runnable()["m"]] == [1, 2, 3]


def test_run_stops_at_the_first_non_batchable_request():
    buf = ReorderBuffer()
    for seq, kind in [(1, "forward_backward"), (2, "forward"), (3, "optim_step"), (4, "forward_backward")]:
        buf.add(req("m", seq, kind), next_seq=1)
    run = buf.runnable()["m"]
    assert [r.seq_id for r in run] == [1, 2]
    buf.start(run)
    assert buf.runnable() == {}  # nothing else of a model while it runs
    buf.finish(run)
    assert [r.seq_id for r in buf.runnable()["m"]] == [3]


def test_a_second_copy_of_a_request_runs_once():
    """Around a scheduler restart a request may arrive from the database and from the inbox."""
    buf = ReorderBuffer()
    buf.add(req("m", 1), next_seq=1)
    buf.add(req("m", 1))  # while waiting: the same entry
    run = buf.runnable()["m"]
    assert [r.seq_id for r in run] == [1]
    buf.start(run)
    buf.add(req("m", 1))  # while running: dropped
    buf.finish(run)
    assert buf.runnable() == {} and len(buf) == 0
    with pytest.raises(ValueError, match="already ran"):
        buf.add(req("m", 1))


def test_a_failed_request_does_not_block_the_next():
    buf = ReorderBuffer()
    buf.add(req("m", 1), next_seq=1)
    buf.add(req("m", 2, "optim_step"))
    run = buf.runnable()["m"]
    buf.start(run)
    buf.finish(run)  # finished, whatever its outcome
    assert [r.seq_id for r in buf.runnable()["m"]] == [2]


def test_a_gap_is_reported_once_later_requests_waited_long_enough_behind_it():
    buf = ReorderBuffer()
    buf.add(req("m", 1), next_seq=1)
    assert buf.stalled(now=0.0, after_seconds=10) == []  # no gap: seq 1 is there
    buf.start(run := buf.runnable()["m"])
    buf.finish(run)
    buf.add(req("m", 3))  # seq 2 missing
    assert buf.stalled(now=100.0, after_seconds=10) == []  # the clock starts when the gap is first seen
    assert buf.stalled(now=109.0, after_seconds=10) == []
    assert buf.stalled(now=110.0, after_seconds=10) == [req("m", 3)]
    buf.add(req("m", 2))  # it arrived after all: no gap
    assert buf.stalled(now=200.0, after_seconds=10) == []
    buf.start(run := buf.runnable()["m"])
    assert [r.seq_id for r in run] == [2, 3]
    assert buf.stalled(now=300.0, after_seconds=10) == []  # nothing waits while it runs
    buf.finish(run)
    buf.add(req("m", 5))  # a new gap restarts the clock
    assert buf.stalled(now=301.0, after_seconds=10) == []
    assert buf.stalled(now=311.0, after_seconds=10) == [req("m", 5)] and buf.next_seq("m") == 4


def test_a_seq_id_that_already_ran_is_refused():
    buf = ReorderBuffer()
    buf.add(req("m", 1), next_seq=1)
    run = buf.runnable()["m"]
    buf.start(run)
    buf.finish(run)
    with pytest.raises(ValueError):
        buf.add(req("m", 1))


def test_cycle_batches_all_tenants_and_separates_optim_steps():
    runnable = {
        "a": [req("a", 1)], "b": [req("b", 1), req("b", 2)], "c": [req("c", 5, "optim_step")],
        "d": [req("d", 0, "create_model")],
    }
    cycle = CyclePlanner(token_budget=1000).plan(runnable)
    assert sorted(r.id for r in cycle.forward_backward) == ["a-1", "b-1", "b-2"]
    assert [r.id for r in cycle.optim_steps] == ["c-5"] and [r.id for r in cycle.others] == ["d-0"]


def test_a_huge_backlog_cannot_starve_a_small_tenant():
    big = [req("big", s, tenant="hog", tokens=400) for s in range(1, 20)]
    small = [req("small", 1, tenant="mouse", tokens=30)]
    planner = CyclePlanner(token_budget=1000)
    for _ in range(2):  # whichever tenant goes first, the small request is in the first cycle
        cycle = planner.plan({"big": list(big), "small": list(small)})
        assert "small-1" in [r.id for r in cycle.forward_backward]
        assert sum(r.num_tokens for r in cycle.forward_backward) <= 1000


def test_a_request_larger_than_the_budget_still_runs():
    cycle = CyclePlanner(token_budget=100).plan({"m": [req("m", 1, tokens=5000)]})
    assert [r.id for r in cycle.forward_backward] == ["m-1"]
