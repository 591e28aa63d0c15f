"""A model's durable state alternates between two slots, so the previous verified state is always
kept beside the newest; a newest state that is corrupt, truncated or gone is passed over for the
previous one and the model reported for replay; a state from before a load_weights is never used;
a model with no usable state fails its own requests, clearly, and no one else's.
(Through a real server, with the replay: tests/scheduler/test_live_state_recovery.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from contract.queue import Cycle
from storage.checkpoint_files import verify_training_state
from storage.live_slots import read_slots
from tests.redis_dbs import redis_url
from tests.workers.trainer.test_eviction import forward_backward, request
from tests.workers.trainer.test_live_state import create, train_step
from workers.trainer.engine import TrainerEngine
from workers.trainer.executor import InProcessExecutor


def corrupt(folder: Path, how: str) -> None:
    """Damage a stored state as storage faults do."""
    tensors = folder / "state.safetensors"
    if how == "flip":
        raw = bytearray(tensors.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        tensors.write_bytes(bytes(raw))
    elif how == "truncate":
        tensors.write_bytes(tensors.read_bytes()[:1000])
    elif how == "delete":
        tensors.unlink()
    elif how == "delete folder":
        shutil.rmtree(folder)
    else:
        raise ValueError(how)


def stored(executor: InProcessExecutor, model: str) -> list[tuple[int, str]]:
    """(seq_id, slot folder name) of the model's stored states, newest first."""
    executor.live.writer.flush(model)
    return [(s.seq, Path(s.path).name) for s in read_slots(executor.live.live_dir, model) if s.manifest]


@pytest.fixture
def executor(tiny_model_path, tmp_path):
    executor = InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path / "live")
    yield executor
    executor.close()


def trained(executor: InProcessExecutor, model: str = "c") -> None:
    """create (0), three rounds (steps at 2, 4, 6), a forward_backward (7) whose gradient is pending,
    then evicted: its full state, gradient included, written as of seq_id 7."""
    create(executor, model)
    for seq in (1, 3, 5):
        train_step(executor, model, seq)
        # each step's state written before the next: a writer that falls behind (a loaded machine)
        # writes only the newest, which would shift which slot holds which seq_id
        executor.live.writer.flush(model)
    fb, job = forward_backward(model, 7)
    assert executor.run_cycle(Cycle(forward_backward=[fb]), {fb.id: job})[fb.id].error is None
    executor.evict(model)


def forward(executor: InProcessExecutor, model: str, seq: int):
    q, job = forward_backward(model, seq, forward_only=True)
    return executor.run_cycle(Cycle(forward_backward=[q]), {q.id: job})[q.id]


def test_the_previous_verified_state_is_kept_beside_the_newest(executor):
    create(executor, "c")
    assert sorted(stored(executor, "c")) == [(0, "c"), (0, "c.alt")]  # a new history: both slots
    sizes = []
    for seq in (1, 3, 5):
        train_step(executor, "c", seq)
        newest, previous = stored(executor, "c")
        assert (newest[0], previous[0]) == (seq + 1, max(seq - 1, 0))  # never overwrites the newest
        sizes.append([sum(f.stat().st_size for f in Path(executor.live.live_dir, name).iterdir())
                      for _, name in (newest, previous)])
    for slot in read_slots(executor.live.live_dir, "c"):
        verify_training_state(slot.path)
    assert sizes[-1][0] == sizes[-1][1]  # two whole states: twice the disk of one


@pytest.mark.parametrize("how", ["flip", "truncate", "delete", "delete folder"])
def test_a_damaged_newest_state_is_passed_over_and_the_model_reported_for_replay(executor, how):
    trained(executor)
    assert stored(executor, "c") == [(7, "c.alt"), (6, "c")]
    corrupt(Path(executor.live.live_dir, "c.alt"), how)
    # run without `place` first: its requests are not run on the older state (gradient of 7 missing)
    outcome = forward(executor, "c", 8)
    assert outcome.error["category"] == "server"
    assert "restored from an older copy (after seq_id 6" in outcome.error["error"]
    assert "c" not in executor.engine.adapters
    assert executor.place({"c"}) == {"c"}  # the scheduler replays onto it what followed seq_id 6 ...
    assert executor.durable_seq("c") == 6
    assert "c" in executor.engine.adapters  # ... loaded from there, and then runs as usual
    assert executor.place({"c"}) == set()
    assert forward(executor, "c", 8).error is None


def test_a_state_from_before_a_load_weights_is_never_a_base(executor, tmp_path):
    trained(executor)
    old_history = tmp_path / "old"
    shutil.copytree(Path(executor.live.live_dir, "c"), old_history)  # seq_id 6, history from create_model
    checkpoint = tmp_path / "ckpt"
    assert executor.place({"c"}) == set()  # loaded as it was evicted
    executor.engine.save_state("c", checkpoint)
    q, job = request("c", 8, "load_weights", json.dumps({"storage_path": str(checkpoint), "optimizer": True,
                                                         "tinker_path": "tinker://run/weights/ckpt"}).encode())
    assert executor.run_cycle(Cycle(others=[q]), {q.id: job})[q.id].error is None
    assert sorted(stored(executor, "c")) == [(8, "c"), (8, "c.alt")]  # a new history: both slots
    executor.evict("c")
    # a crash between the two writes of the load would leave an older history beside it:
    shutil.rmtree(Path(executor.live.live_dir, "c"))
    shutil.copytree(old_history, Path(executor.live.live_dir, "c"))
    corrupt(Path(executor.live.live_dir, "c.alt"), "flip")
    outcome = forward(executor, "c", 9)
    assert outcome.error["category"] == "server"
    assert "predates the create_model or load_weights at seq_id 8" in outcome.error["error"]


def loaded(executor: InProcessExecutor, tmp_path: Path, model: str = "c") -> None:
    """trained(), then a load_weights of its own checkpoint at seq_id 8 (a history that begins with a load),
    and an evict."""
    trained(executor, model)
    checkpoint = tmp_path / "ckpt"
    assert executor.place({model}) == set()
    executor.engine.save_state(model, checkpoint)
    q, job = request(model, 8, "load_weights", json.dumps({"storage_path": str(checkpoint), "optimizer": True,
                                                           "tinker_path": "tinker://run/weights/ckpt"}).encode())
    assert executor.run_cycle(Cycle(others=[q]), {q.id: job})[q.id].error is None
    executor.evict(model)


def test_a_model_without_usable_state_fails_alone_and_says_what_to_do(executor, tmp_path):
    loaded(executor, tmp_path, "c")
    create(executor, "b")
    for slot in ("c", "c.alt"):
        corrupt(Path(executor.live.live_dir, slot), "truncate")
    broken, broken_job = forward_backward("c", 9, forward_only=True)
    fine, fine_job = forward_backward("b", 1, forward_only=True)
    outcomes = executor.run_cycle(Cycle(forward_backward=[broken, fine]), {broken.id: broken_job, fine.id: fine_job})
    assert outcomes[fine.id].error is None
    message = outcomes[broken.id].error["error"]
    assert outcomes[broken.id].error["category"] == "server"
    assert message.startswith("the training state of model c cannot be restored: ")
    assert "the main copy (after seq_id 8): state.safetensors failed its integrity check" in message
    assert "the alternate copy (after seq_id 8): state.safetensors failed its integrity check" in message
    assert "loraplex-admin models rebuild c" in message and "load_state" in message
    assert str(tmp_path) not in message  # file names within the state, never the server's paths


def test_a_model_begun_by_create_model_without_usable_state_is_made_again_for_a_replay(executor, tiny_model_path):
    """Its create_model's seeded config makes the same adapter again; `place` reports it, so that the
    scheduler replays every request after the create_model from the database."""
    trained(executor, "c")
    for slot in ("c", "c.alt"):
        corrupt(Path(executor.live.live_dir, slot), "truncate")
    assert executor.place({"c"}) == {"c"}
    assert executor.durable_seq("c") == 0
    fresh = TrainerEngine(tiny_model_path, max_rank=16)
    fresh.create_adapter("c", executor.engine.adapter("c").config)
    assert torch.equal(executor.engine.adapter("c").flat_weights, fresh.adapter("c").flat_weights)


def test_the_celery_scheduler_replays_from_the_newest_state_that_verifies(executor):
    """In distributed mode the scheduler reads the shared store itself: a dead worker's model is
    replayed from the state the next worker will load, not from a damaged newer one."""
    from scheduler.celery_executor import CeleryExecutor

    trained(executor)
    scheduler_side = CeleryExecutor(redis_url(__name__), "tiny", executor.live.live_dir)
    assert scheduler_side.durable_seq("c") == 7
    assert scheduler_side._newest_state_verifies("c")
    corrupt(Path(executor.live.live_dir, "c.alt"), "flip")
    assert scheduler_side.durable_seq("c") == 6
    assert not scheduler_side._newest_state_verifies("c")  # a model moved now is replayed from 6
