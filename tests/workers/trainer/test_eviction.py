"""A trainer with room for fewer adapters than it serves writes the least recently used ones out,
gradients included, and reloads them on use: the numbers equal those of a trainer that keeps all."""

from __future__ import annotations

import json
import threading

import numpy as np

from contract.queue import Job
from contract.queue import QueuedRequest
from contract.queue import Cycle
from loraplex.wire.client import decode_forward_backward_output, encode_forward_backward_request
from workers.compute_thread import ComputeThread
from workers.trainer.engine import TrainerEngine
from workers.trainer.executor import InProcessExecutor

TOKENS = {"a": list(range(10, 30)), "b": list(range(40, 52)), "c": list(range(60, 90))}


def request(model: str, seq: int, kind: str, payload: bytes) -> tuple[QueuedRequest, Job]:
    q = QueuedRequest(f"{model}-{seq}", f"tenant-{model}", model, seq, kind)
    return q, Job(q, payload)


def forward_backward(model: str, seq: int, forward_only: bool = False):
    tokens = TOKENS[model]
    inputs = {"target_tokens": np.array(tokens[1:]), "weights": np.ones(len(tokens) - 1, np.float32)}
    body = encode_forward_backward_request(model, seq, [(tokens[:-1], inputs)], "cross_entropy", forward_only=forward_only,
                                          compress=False)
    return request(model, seq, "forward" if forward_only else "forward_backward", body)


def history():
    """Per model: create, two forward_backward (gradients accumulate across evictions), a step, a forward."""
    for model in TOKENS:
        yield [request(model, 0, "create_model", json.dumps({"lora_config": {"rank": 4, "seed": ord(model)}}).encode())]
    for seq in (1, 2):
        for model in TOKENS:
            yield [forward_backward(model, seq)]
    yield [request(m, 3, "optim_step", json.dumps({"adam_params": {"learning_rate": 1e-2}}).encode()) for m in TOKENS]
    for model in TOKENS:
        yield [forward_backward(model, 4, forward_only=True)]


def run(executor: InProcessExecutor, budget_after_creates: int | None = None) -> tuple[dict[str, list[float]], int]:
    """Forward logprobs per model, and the most adapters resident besides those of a cycle.
    `budget_after_creates`: the memory budget from the first forward_backward on (create_model refuses
    a run that could never fit the budget it is created under)."""
    logprobs, most_idle_resident = {}, 0
    for step in history():
        kind = step[0][0].kind
        if kind == "forward_backward" and budget_after_creates is not None:
            executor.residency.budget_bytes = budget_after_creates
        cycle = Cycle(forward_backward=[q for q, _ in step] if kind in ("forward", "forward_backward") else [],
                      optim_steps=[q for q, _ in step] if kind == "optim_step" else [],
                      others=[q for q, _ in step] if kind == "create_model" else [])
        outcomes = executor.run_cycle(cycle, {q.id: job for q, job in step})
        assert all(o.error is None for o in outcomes.values()), outcomes
        most_idle_resident = max(most_idle_resident, len(set(executor.engine.adapters) - {q.model_id for q, _ in step}))
        if kind == "forward":
            q = step[0][0]
            logprobs[q.model_id] = decode_forward_backward_output(outcomes[q.id].result)[0][0]["logprobs"].tolist()
    return logprobs, most_idle_resident


def test_evicted_adapters_continue_exactly_where_they_stopped(tiny_model_path, tmp_path):
    kept, idle = run(InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path / "all"))
    assert idle == 2
    moved, idle = run(InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path / "one", max_resident=1))
    assert idle == 0  # room for one: only the cycle's own adapter is in memory
    assert moved == kept


def test_eviction_inside_a_cycle_on_the_compute_thread(tiny_model_path, tmp_path):
    """As in the embedded server: the cycle runs on the compute thread while the caller holds the
    engine's lock; evicting from inside it must not wait for that lock."""
    kept, _ = run(InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path / "all"))
    compute = ComputeThread()
    executor = InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path / "one", max_resident=1,
                                 compute=compute)
    finished: list = []
    caller = threading.Thread(target=lambda: finished.append(run(executor)), daemon=True)
    caller.start()
    caller.join(120)
    assert finished, "a cycle that evicts never finished (deadlock)"
    moved, idle = finished[0]
    assert idle == 0 and moved == kept
    compute.close()
