"""How often an executor writes an adapter's durable training state: after every forward_backward and optim_step with
interval 0; with an interval, at most once per interval, the newest state by a timer once it is
due, and every unwritten state on close. What is written is the state as of the seq_id it names."""

from __future__ import annotations

import json

import torch

from contract.queue import Cycle
from storage.checkpoint_files import read_manifest
from tests.waiting import wait_until
from tests.workers.trainer.test_eviction import forward_backward, request
from workers.trainer.engine import TrainerEngine
from workers.trainer.executor import InProcessExecutor


def create(executor: InProcessExecutor, model: str) -> None:
    q, job = request(model, 0, "create_model", json.dumps({"lora_config": {"rank": 4, "seed": 1}}).encode())
    assert executor.run_cycle(Cycle(others=[q]), {q.id: job})[q.id].error is None


def train_step(executor: InProcessExecutor, model: str, seq: int) -> None:
    """forward_backward at seq, optim_step at seq + 1."""
    fb, fb_job = forward_backward(model, seq)
    step, step_job = request(model, seq + 1, "optim_step", json.dumps({"adam_params": {"learning_rate": 1e-2}}).encode())
    outcomes = executor.run_cycle(Cycle(forward_backward=[fb], optim_steps=[step]), {fb.id: fb_job, step.id: step_job})
    assert all(o.error is None for o in outcomes.values()), outcomes


def written(executor: InProcessExecutor, model: str) -> tuple[int, int]:
    """(seq_id, optimizer step) of the model's durable state, once the writer is done with it."""
    executor.live.writer.flush(model)
    manifest = read_manifest(executor.live.path(model))
    return manifest["extra"]["seq_id"], manifest["step"]


def test_interval_zero_writes_after_every_optim_step(tiny_model_path, tmp_path):
    executor = InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path)
    create(executor, "c")
    for i in range(3):
        train_step(executor, "c", 1 + 2 * i)
        assert written(executor, "c") == (2 + 2 * i, i + 1)
    executor.close()


def test_a_faster_model_is_written_once_per_interval_then_by_the_timer(tiny_model_path, tmp_path):
    executor = InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path, state_write_interval=1.0)
    create(executor, "c")  # written at once (create_model waits for its state)
    assert written(executor, "c") == (0, 0)
    train_step(executor, "c", 1)
    train_step(executor, "c", 3)
    assert written(executor, "c") == (0, 0)  # within create_model's interval: not yet
    wait_until(lambda: written(executor, "c") == (4, 2),  # the timer writes the newest state
               lambda: f"the timer to write seq_id 4 (written: {written(executor, 'c')})", timeout=60)
    assert written(executor, "c") == (4, 2)
    executor.close()


def test_close_writes_every_state_not_yet_written(tiny_model_path, tmp_path):
    executor = InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path, state_write_interval=3600)
    for model in ("a", "b"):
        create(executor, model)
        train_step(executor, model, 1)
    assert written(executor, "a") == written(executor, "b") == (0, 0)
    executor.close()
    assert read_manifest(tmp_path / "a")["extra"]["seq_id"] == read_manifest(tmp_path / "b")["extra"]["seq_id"] == 2


def test_gradients_no_optim_step_applied_are_written_with_the_state(tiny_model_path, tmp_path):
    """A forward_backward's state is written like an optim_step's, its accumulated gradient in it, so a
    restart replays at most one interval of a model's work however long it accumulates."""
    executor = InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path)
    create(executor, "c")
    for seq in (1, 2, 3):
        fb, job = forward_backward("c", seq)
        assert executor.run_cycle(Cycle(forward_backward=[fb]), {fb.id: job})[fb.id].error is None
        assert written(executor, "c") == (seq, 0)
    gradients = executor.engine.adapter("c").flat_grads.clone()
    executor.close()

    restarted = InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path)
    assert restarted.durable_seq("c") == 3  # nothing to replay
    assert restarted.place({"c"}) == set()
    assert torch.equal(restarted.engine.adapter("c").flat_grads, gradients)
    restarted.close()
