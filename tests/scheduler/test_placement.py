"""Where models run on Celery workers (scheduler/placement.py): they stick, go to the least loaded live
worker when new or orphaned, and move off a worker two models busier than the least loaded one."""

from __future__ import annotations

from scheduler.placement import Placement, place_models


def test_new_models_go_to_the_least_loaded_worker_and_then_stay():
    placed: dict[str, str] = {}
    changes = place_models({"a", "b", "c"}, placed, {"w1", "w2"})
    assert changes == [Placement("a", "w1", None), Placement("b", "w2", None), Placement("c", "w1", None)]
    assert place_models({"a", "b", "c"}, placed, {"w1", "w2"}) == []  # sticky


def test_a_dead_workers_models_are_lost_and_go_to_the_live_ones():
    placed = {"a": "w1", "b": "w2", "c": "w1"}
    [change] = place_models({"a"}, placed, {"w2", "w3"})
    assert change == Placement("a", "w3", "w1") and change.lost and placed["a"] == "w3"


def test_a_joining_worker_takes_models_from_a_busier_one_but_not_one_in_parts():
    placed = {m: "w1" for m in "abcd"}
    changes = place_models({"a", "b"}, placed, {"w1", "w2"}, splitting={"a"})
    assert changes == [Placement("b", "w2", "w1", moved=True)]  # "a" holds parts of a request: it stays
    assert not changes[0].lost
    assert place_models({"c"}, placed, {"w1", "w2"}) == [Placement("c", "w2", "w1", moved=True)]  # 3 against 1
    assert place_models({"d"}, placed, {"w1", "w2"}) == []  # 2 against 2: it stays
