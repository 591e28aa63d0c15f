"""Large forward/forward_backward requests run in parts: the planner's policy (shares, order,
tokens in flight) and the executor's side (bits of the whole, a resent part never runs twice)."""

from __future__ import annotations

import json

import numpy as np
import torch

from contract.queue import Job
from contract.queue import QueuedRequest
from contract.queue import Cycle, Part
from contract.queue import PartProgress
from loraplex.wire.client import encode_forward_backward_request
from scheduler.planner import CyclePlanner
from workers.trainer.engine import TrainerEngine
from workers.trainer.executor import InProcessExecutor


def req(model: str, seq: int, tokens: int = 10, tenant: str | None = None, kind: str = "forward_backward"):
    return QueuedRequest(f"{model}-{seq}", tenant or f"tenant-{model}", model, seq, kind, tokens)


# --- the planner ---------------------------------------------------------------------------------


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


# --- the executor --------------------------------------------------------------------------------


def payload(model: str, seq: int, seed: int, n_datums: int, length: int) -> bytes:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(n_datums):
        row = rng.integers(0, 512, length + 1)
        data.append((row[:-1], {"target_tokens": row[1:], "weights": rng.random(length).astype(np.float32)}))
    return encode_forward_backward_request(model, seq, data, "cross_entropy", compress=False)


def executor(model_path, tmp_path, name: str, models=("m",), **kw) -> InProcessExecutor:
    ex = InProcessExecutor(TrainerEngine(model_path, max_rank=16, max_pass_tokens=64), tmp_path / name, **kw)
    for i, model in enumerate(models):
        q = req(model, 0, kind="create_model")
        body = json.dumps({"lora_config": {"rank": 4, "seed": i}}).encode()
        assert ex.run_cycle(Cycle(others=[q]), {q.id: Job(q, body)})[q.id].error is None
    return ex


def run_part(ex: InProcessExecutor, q: QueuedRequest, body: bytes, start: int, max_tokens: int = 100):
    return ex.run_cycle(Cycle(forward_backward=[q]), {q.id: Job(q, body, Part(start, max_tokens))})[q.id]


def test_a_part_sent_again_is_answered_from_what_ran_never_run_twice(tiny_model_path, tmp_path):
    """As after a restart of the scheduler that leaves the engine (a Celery worker) running: the new
    scheduler sends the request from its first datum again."""
    q, body = req("m", 1, tokens=12 * 30), payload("m", 1, seed=1, n_datums=12, length=30)
    whole = executor(tiny_model_path, tmp_path, "whole")
    expected = whole.run_cycle(Cycle(forward_backward=[q]), {q.id: Job(q, body)})[q.id]
    ex = executor(tiny_model_path, tmp_path, "parts")
    first = run_part(ex, q, body, 0)
    second = run_part(ex, q, body, first.progress.datums)
    assert 0 < first.progress.datums < second.progress.datums < 12
    grads = ex.engine.adapter("m").flat_grads.clone()
    again = run_part(ex, q, body, 0)  # the restarted scheduler's first part
    assert again.progress == second.progress and again.result is None
    assert torch.equal(ex.engine.adapter("m").flat_grads, grads)  # nothing ran
    outcome, start = again, again.progress.datums
    while outcome.progress is not None:
        outcome = run_part(ex, q, body, outcome.progress.datums)
    assert outcome.result == expected.result  # the bytes of the whole request's answer
    grads = ex.engine.adapter("m").flat_grads.clone()
    assert torch.equal(grads, whole.engine.adapter("m").flat_grads)
    assert run_part(ex, q, body, 0).result == expected.result  # the last part's answer was lost: asked again
    assert torch.equal(ex.engine.adapter("m").flat_grads, grads)


def test_a_request_sent_whole_after_its_first_parts_ran_runs_only_the_rest(tiny_model_path, tmp_path):
    """A scheduler restarted without splitting (or with a larger budget) sends it whole."""
    q, body = req("m", 1, tokens=12 * 30), payload("m", 1, seed=2, n_datums=12, length=30)
    whole = executor(tiny_model_path, tmp_path, "whole")
    expected = whole.run_cycle(Cycle(forward_backward=[q]), {q.id: Job(q, body)})[q.id]
    ex = executor(tiny_model_path, tmp_path, "parts")
    assert run_part(ex, q, body, 0).progress is not None
    outcome = ex.run_cycle(Cycle(forward_backward=[q]), {q.id: Job(q, body)})[q.id]
    assert outcome.result == expected.result
    assert torch.equal(ex.engine.adapter("m").flat_grads, whole.engine.adapter("m").flat_grads)


def test_a_part_whose_earlier_parts_the_engine_lost_fails_clearly(tiny_model_path, tmp_path):
    q, body = req("m", 1, tokens=12 * 30), payload("m", 1, seed=3, n_datums=12, length=30)
    outcome = run_part(executor(tiny_model_path, tmp_path, "fresh"), q, body, 5)
    assert outcome.error["category"] == "server" and "first 5 datums" in outcome.error["error"]


def test_a_bad_datum_fails_the_request_at_its_first_part_with_no_gradient(tiny_model_path, tmp_path):
    q = req("m", 1, tokens=12 * 30)
    body = encode_forward_backward_request("m", 1, [([1, 2, 3], {"target_tokens": np.array([2, 3, 4]),
                                                                 "weights": np.ones(3, np.float32)})] * 11
                                           + [([1, 2, 3], {"target_tokens": np.array([2, 3, 9999]),
                                                           "weights": np.ones(3, np.float32)})],
                                           "cross_entropy", compress=False)
    ex = executor(tiny_model_path, tmp_path, "bad")
    outcome = run_part(ex, q, body, 0, max_tokens=6)
    assert outcome.error["category"] == "user" and "data[11]" in outcome.error["error"]
    assert not ex.engine.adapter("m").flat_grads.any()


def test_a_model_halfway_through_a_request_in_parts_is_not_evicted(tiny_model_path, tmp_path):
    """Eviction writes the state with the gradients so far: the rest of the request could then run
    on a reloaded copy while the executor forgot what ran. It keeps the model instead."""
    ex = executor(tiny_model_path, tmp_path, "one", models=("m", "n"), max_resident=1)
    q, body = req("m", 1, tokens=12 * 30), payload("m", 1, seed=4, n_datums=12, length=30)
    other, other_body = req("n", 1, tokens=30), payload("n", 1, seed=5, n_datums=1, length=30)
    first = run_part(ex, q, body, 0)
    assert ex.run_cycle(Cycle(forward_backward=[other]), {other.id: Job(other, other_body)})[other.id].error is None
    assert "m" in ex.engine.adapters and ex.splitting() == {"m"}
    outcome = first
    while outcome.progress is not None:
        outcome = run_part(ex, q, body, outcome.progress.datums)
    assert outcome.error is None and ex.splitting() == set()
