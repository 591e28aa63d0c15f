"""Repairing a model whose stored training state is lost (the server's `live` folders, see
workers/trainer/live_state.py): what `loraplex-admin models state | rebuild | reset` do.

A rebuild needs a base (a state known to reflect every request up to some seq_id) and the
requests after it, which the database holds with their payloads. Bases, best (latest) first:
- a stored live state that verifies and descends from the model's last create_model/load_weights;
- a training-state checkpoint this model saved (save_weights) that verifies: it holds the state
  after the last optim_step (or create/load) before the save, so the replay starts there, and the
  gradients accumulated between that step and the save are replayed too;
- the model's last create_model (a fresh adapter: its lora_config, seed included, is stored) or
  load_weights (the checkpoint it loaded, if it still verifies and was not saved over since).
The requests after the base are replayed by the scheduler's own replay (`_replay_lost_work`: the
code a restart runs), on a trainer engine in this process, and the result is written to both
slots as the state after the model's last applied seq_id. Run it while the model's requests fail
(the server then holds no copy of it in memory) or with the server stopped. A reset is refused while
a scheduler runs (admin/models_cli.py): the model it holds would overwrite the reset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import sqlalchemy as sa
from sqlalchemy.orm import Session

from contract.kinds import STARTS_HISTORY, RequestKind
from contract.payloads import CreateModelPayload, LoadWeightsPayload, SaveWeightsPayload
from contract.queue import Outcome
from db.models import Checkpoint, CheckpointKind, Request, RequestState, TrainingModel
from service.settings import Settings
from storage.checkpoint_files import CheckpointError, verify_training_state
from storage.live_slots import read_slots
from workers.trainer.engine import TrainerEngine
from workers.trainer.executor import InProcessExecutor

CHANGES_WEIGHTS = (RequestKind.OPTIM_STEP, *STARTS_HISTORY)


@dataclass(frozen=True)
class Base:
    seq: int  # the state reflects every request of the model up to this seq_id
    what: str  # how the operator is told about it
    load: Callable[[TrainerEngine, str], None]  # puts the state into the engine under the model's id
    problem: str | None = None  # why it cannot be used (None: verified)


def _done(s: Session, model_id: str, kinds: tuple[RequestKind, ...], up_to: int) -> list[Request]:
    return list(s.scalars(sa.select(Request).where(
        Request.model_id == model_id, Request.kind.in_(kinds), Request.state == RequestState.DONE,
        Request.seq_id <= up_to).order_by(Request.seq_id)))


def _verified(location: str, model_id: str | None = None) -> str | None:
    """Why the training state at `location` cannot be used, or None."""
    try:
        manifest = verify_training_state(location)
    except CheckpointError as e:
        return str(e)
    if model_id is not None and manifest.get("adapter_id") != model_id:
        return f"it holds model {manifest.get('adapter_id')}'s state, not this model's"
    return None


def _loader(location: str, with_optimizer: bool = True, optimizer: str | None = None
            ) -> Callable[[TrainerEngine, str], None]:
    def load(engine: TrainerEngine, model_id: str) -> None:
        engine.load_state(model_id, location, with_optimizer=with_optimizer, optimizer=optimizer)
    return load


def bases(s: Session, model: TrainingModel, live_dir: str) -> list[Base]:
    """Every base the model could be rebuilt from, latest first (those with a problem say why not)."""
    last = model.last_applied_seq_id
    starts = _done(s, model.id, STARTS_HISTORY, last)
    if not starts:
        return []
    start = starts[-1]
    found = []
    for slot in read_slots(live_dir, model.id):
        if slot.manifest is None:
            continue
        what = f"stored live state ({slot.label}, after seq_id {slot.seq})"
        if slot.seq < start.seq_id or slot.seq > last:
            problem = f"it is from before the {start.kind} at seq_id {start.seq_id}" if slot.seq < start.seq_id \
                else f"it is after the last applied seq_id {last}"
        else:
            problem = _verified(slot.path)
        found.append(Base(slot.seq, what, _loader(slot.path), problem))
    changes = _done(s, model.id, CHANGES_WEIGHTS, last)
    saves: dict[str, Request] = {}  # storage path -> the last save to it (what its files hold)
    for save in _done(s, model.id, (RequestKind.SAVE_WEIGHTS,), last):
        if save.seq_id > start.seq_id:
            saves[SaveWeightsPayload.parse(save.payload).storage_path] = save
    for location, save in saves.items():
        checkpoint = s.scalar(sa.select(Checkpoint).where(Checkpoint.storage_path == location,
                                                          Checkpoint.kind == CheckpointKind.TRAINING_STATE))
        if checkpoint is None:
            continue  # deleted
        step = max(r.seq_id for r in changes if r.seq_id <= save.seq_id)
        found.append(Base(step, f"checkpoint {checkpoint.tinker_path} (saved at seq_id {save.seq_id})",
                          _loader(location), _verified(location, model.id)))
    if start.kind == RequestKind.CREATE_MODEL:
        created = CreateModelPayload.parse(start.payload)

        def create(engine: TrainerEngine, model_id: str) -> None:
            engine.create_adapter(model_id, created.lora_config, created.optimizer)
        found.append(Base(start.seq_id, f"its create_model (seq_id {start.seq_id})", create))
    else:
        body = LoadWeightsPayload.parse(start.payload)
        loaded = s.scalar(sa.select(Checkpoint).where(Checkpoint.storage_path == body.storage_path))
        problem = "that checkpoint was deleted" if loaded is None else (
            "that checkpoint was saved over since" if start.started_at and loaded.created_at > start.started_at
            else _verified(body.storage_path))
        found.append(Base(start.seq_id, f"its load_weights of {body.tinker_path} (seq_id {start.seq_id})",
                          _loader(body.storage_path, body.optimizer, body.optimizer_type), problem))
    return sorted(found, key=lambda b: b.seq, reverse=True)


class _ReplayOnto:
    """An executor (contract.executor.Executor) for the scheduler's replay, over an engine that holds the base."""

    engines_restart_with_scheduler = True

    def __init__(self, executor: InProcessExecutor, model_id: str, base_seq: int) -> None:
        self.executor, self.model_id, self.base_seq = executor, model_id, base_seq
        self.replayed = 0
        self.failures: list[str] = []

    def place(self, model_ids: set[str]) -> set[str]:
        return set()  # the base is in the engine already

    def trainer_memory(self) -> dict:
        return {}  # a repair's engine serves no one

    def prefetch(self, model_ids: list[str]) -> None:
        pass  # the base is in the engine already

    def close(self) -> None:
        pass  # `rebuild` closes the executor it wraps

    def durable_seq(self, model_id: str, at_most: int | None = None) -> int | None:
        return self.base_seq if model_id == self.model_id else None

    def run_cycle(self, cycle, jobs) -> dict[str, Outcome]:
        outcomes = self.executor.run_cycle(cycle, jobs)
        self.replayed += len(outcomes)
        self.failures += [f"seq_id {q.seq_id} ({q.kind}): {outcomes[q.id].error['error']}"
                          for q in cycle.all() if outcomes[q.id].error]
        return outcomes


def rebuild(s: Session, sessions, model: TrainingModel, settings: Settings, base: Base, engine: TrainerEngine) -> int:
    """Put `base` into `engine`, replay the model's requests after it and write the result as the model's
    stored state (both slots). The number of requests replayed; RuntimeError if one failed now."""
    from messaging.notify import Notifier
    from scheduler.service import SchedulerService

    executor = InProcessExecutor(engine, settings.live_dir)
    try:
        base.load(engine, model.id)
        replay = _ReplayOnto(executor, model.id, base.seq)
        scheduler = SchedulerService(sessions, replay, settings.cycle_token_budget, Notifier())
        scheduler._replay_lost_work(s, only={model.id})  # what a restart runs
        if replay.failures:
            raise RuntimeError("replaying failed, nothing was written: " + "; ".join(replay.failures))
        _write(executor, model, with_gradients=True)
        return replay.replayed
    finally:
        executor.close()


def _write(executor: InProcessExecutor, model: TrainingModel, *, with_gradients: bool) -> None:
    """Both slots, as the model's state after its last applied seq_id; RuntimeError unless both verify
    (the writer only logs a failed write)."""
    executor.live.persist(model.id, model.last_applied_seq_id, with_gradients=with_gradients, resets=True)
    problems = []
    for slot in read_slots(executor.live.live_dir, model.id):
        problem = _verified(slot.path) if slot.seq == model.last_applied_seq_id else "not written"
        if problem:
            problems.append(f"{slot.label}: {problem}")
    if problems:
        raise RuntimeError("writing the state failed: " + "; ".join(problems))


def reset(model: TrainingModel, settings: Settings, checkpoint: Checkpoint, engine: TrainerEngine) -> None:
    """Make a training-state checkpoint the model's stored state as of its last applied seq_id."""
    problem = _verified(checkpoint.storage_path)
    if problem:
        raise RuntimeError(f"{checkpoint.tinker_path}: {problem}")
    executor = InProcessExecutor(engine, settings.live_dir)
    try:
        engine.load_state(model.id, checkpoint.storage_path)
        _write(executor, model, with_gradients=False)
    finally:
        executor.close()


def to_replay(s: Session, model: TrainingModel, base: Base) -> int:
    """How many requests a rebuild from `base` replays: the model's finished forward_backward and
    optim_step requests after it, as the scheduler's replay selects them (other kinds change no state)."""
    return s.scalar(sa.select(sa.func.count()).select_from(Request).where(
        Request.model_id == model.id, Request.kind.in_([RequestKind.FORWARD_BACKWARD, RequestKind.OPTIM_STEP]),
        Request.state == RequestState.DONE, Request.seq_id > base.seq, Request.seq_id <= model.last_applied_seq_id))
