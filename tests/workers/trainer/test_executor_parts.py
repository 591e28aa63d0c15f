"""Large forward/forward_backward requests run in parts, the executor's side: bits of the whole, a
resent part never runs twice. The planner's policy: tests/scheduler/test_split_requests.py."""

from __future__ import annotations

import json

import numpy as np
import torch

from contract.queue import Job
from contract.queue import Cycle, Part
from contract.queue import QueuedRequest
from loraplex.wire.client import encode_forward_backward_request
from workers.trainer.engine import TrainerEngine
from workers.trainer.executor import InProcessExecutor


def req(model: str, seq: int, tokens: int = 10, kind: str = "forward_backward") -> QueuedRequest:
    return QueuedRequest(f"{model}-{seq}", f"tenant-{model}", model, seq, kind, tokens)


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
    outcome = again
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
