"""An executor's durable copy of each adapter's training state: two "live" folders per model.

Written after create_model and load_weights before the outcome is returned, and after
forward_backwards and optim_steps in the background (a copy taken on the engine's thread, gradients
accumulated since the last optim_step included, written by `StateWriter`). Writing it is not what
makes an acknowledged request durable: the database holds every acknowledged request, and after a
restart the scheduler replays the ones after the live state's seq_id. So a model training faster
than `interval` seconds has its state captured at most once per interval (a SmolLM2 rank-16 state
is 68 MB: copying, hashing and writing it after every step cost a core for ~0.3 s); a later
request's state is captured by a timer once its interval has passed, so a model that stops training
is written soon after, and `close` captures every state still unwritten. The price: a crash
replays up to `interval` seconds of each model's work. Gradients are captured too, so that this
bound holds for forward_backwards that no optim_step has followed yet (a backlog of them used to be
replayed whole). A model halfway through a request run in parts (`busy`) is not captured: its
gradients hold part of a request that a restart runs again from its first datum.

Integrity: a model's state alternates between two slots, `<live>/<model>` and `<live>/<model>.alt`.
A write goes to the slot that does not hold the newest complete state, and becomes the newest
only once it is written whole (its manifest, with the SHA-256 of its tensors, is published last:
storage/checkpoint_files.py); so while a run trains, the previous state is kept beside the newest
(twice the disk of one state), and each is checked against its SHA-256 when it is loaded. A run
paged out (idle) keeps one copy, once it is written whole (`keep_one_copy`). If the
newest is corrupt, truncated or gone, the model is restored from the previous one and the
scheduler replays the requests after it from the database (`place` reports the model, as for a
dead engine; after a restart `durable_seq` is what the replay starts from). create_model and
load_weights start a new history: their state goes to both slots, and every manifest names the
seq_id its history started at (`lineage_seq`), so a state from before a load is never used as a
base for replaying requests after it. Where no usable state is left, the model's requests fail
with `LiveStateError`, naming what was found and what to do (`loraplex-admin models rebuild`).

Prefetch (`prefetch`, workers/trainer/prefetch.py): runs the scheduler says are queued are read,
verified and (on CPU) built into their adapter on a background thread; `restore` then uses that copy
if it is of the very slot and manifest it would load, and reads the slot itself otherwise. Every
write of a model discards its copy.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from contract.configs import LoraConfig
from storage import store
from storage.checkpoint_files import CheckpointError
from storage.live_slots import SLOTS, Slot, candidates, cannot_restore, read_slots, slot_paths
from workers.compute_thread import ComputeThread, run_on
from storage.peft_export import read_verified_state
from workers.trainer.adapters import OPTIMIZER_STATE, Adapter
from workers.trainer.checkpoints import TrainingState, load_training_state
from workers.trainer.prefetch import Prefetcher
from workers.trainer.state_writer import StateWriter

if TYPE_CHECKING:
    from workers.trainer.engine import TrainerEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restored:
    seq: int  # the seq_id the loaded state reflects
    expected: int  # the seq_id this process last wrote or reported for the model (-1: none)
    problems: list[str]  # what was wrong with newer slots
    prefetched: bool = False  # loaded from a copy read ahead (workers/trainer/prefetch.py), not from the store

    @property
    def behind(self) -> bool:
        """Older than what was written or reported: requests after `seq` must be replayed onto it."""
        return self.seq < self.expected


def in_memory_bytes(slot: Slot) -> int:
    """About what the slot's state takes once loaded: in memory an adapter also holds gradients (zeros if none
    were stored), so weights-sized tensors stored -> held: weights, gradients, the optimizer's state."""
    manifest = slot.manifest
    optimizer_tensors = len(OPTIMIZER_STATE.get(manifest.get("optimizer", "adamw"), ("", "")))
    stored = 1 + (optimizer_tensors if manifest.get("has_optimizer_state") else 0) + bool(manifest.get("has_gradients"))
    held = 2 + (optimizer_tensors if manifest.get("has_optimizer_state") else 0)
    return store.size(slot.path) * held // stored


class LiveStates:
    def __init__(self, engine: TrainerEngine, live_dir: str | Path, engine_lock: threading.RLock,
                 interval: float = 0.0, compute: ComputeThread | None = None,
                 busy: Callable[[], set[str]] = set, prefetch_bytes: int = 0) -> None:
        """busy: the models whose state must not be captured now (halfway through a request in parts).
        prefetch_bytes: the most bytes of states read ahead (`prefetch`; 0: none are)."""
        self.engine = engine
        self._busy = busy
        self._compute = compute  # where the timer's and close's captures (copies) run, as the engine's work
        self.live_dir = str(live_dir)
        self.interval = interval
        self.writer = StateWriter(on_written=self._written)
        # Held by whoever runs the engine, and here around every capture: none sees half a step.
        # Everything below changes only under it.
        self._engine_lock = engine_lock
        self._captured_at: dict[str, float] = {}  # model -> monotonic time of its last capture
        self._unwritten: dict[str, int] = {}  # model -> seq_id of its newest training request not captured yet
        self._timer: threading.Timer | None = None  # one-shot, only while states wait for their interval
        self._timer_due = math.inf
        self._closed = False
        # model -> its newest complete slot (set by the writer's thread after a write, and by restore)
        self._newest: dict[str, Slot] = {}
        self._expected: dict[str, int] = {}  # model -> the seq_id its stored state should reflect
        self._lineage: dict[str, int | None] = {}  # model -> the seq_id its history started at
        self._lineage_kind: dict[str, str | None] = {}  # model -> what started it: "create_model" / "load_weights"
        # model -> the seq_id of the create_model it was made again from, none of its stored states verifying
        self._recreated: dict[str, int] = {}
        # model -> the newest seq_id the database holds as applied, as the scheduler read it at recovery.
        # A stored state newer than that was written before its step's outcome was committed, and the
        # server stopped in between: the step runs again, so restoring that state would apply it twice.
        self._ceiling: dict[str, int] = {}
        self.prefetcher = Prefetcher(self._locate, self._load_ahead, prefetch_bytes) if prefetch_bytes > 0 else None

    def path(self, model_id: str) -> str:
        """The model's newest written slot as far as this process knows (else the main one)."""
        known = self._newest.get(model_id)
        return known.path if known is not None else slot_paths(self.live_dir, model_id)[0]

    # --- writing ---------------------------------------------------------------------------------

    def persist(self, model_id: str, seq_id: int, *, wait: bool = True, with_gradients: bool = False,
                resets: bool = False, started_by: str | None = None, handed_over: bool = False) -> None:
        """Capture the model's state as of `seq_id` now; write it before returning, or (wait=False) in the
        background (the capture is a copy). Every write of a model goes through the writer, so none overtakes
        a newer one. `resets`: the state starts a new history (create_model, load_weights: `started_by`):
        both slots, waited for. `handed_over`: the model leaves the engine now (paged out): its tensors are
        copied by the writer, not here (TrainingState.capture)."""
        state = TrainingState.capture(self.engine.adapter(model_id), with_gradients=with_gradients,
                                      handed_over=handed_over)
        self._captured_at[model_id] = time.monotonic()
        self._unwritten.pop(model_id, None)
        self._recreated.pop(model_id, None)
        if resets:
            self._lineage[model_id], self._lineage_kind[model_id] = seq_id, started_by
        self._expected[model_id] = seq_id
        self._ceiling.pop(model_id, None)  # the model went on from a state the database agrees with
        if self.prefetcher is not None:  # its stored state changes: no copy read before may be used
            self.prefetcher.discard(model_id)
        extra = {"seq_id": seq_id, "lineage_seq": self._lineage.get(model_id),
                 "lineage_kind": self._lineage_kind.get(model_id)}
        if resets:
            for path in slot_paths(self.live_dir, model_id):  # one after the other: one always holds a whole state
                self.writer.submit(model_id, path, state, extra)
                self.writer.flush(model_id)
            return
        self.writer.submit(model_id, lambda: self._target(model_id), state, extra)
        if wait:
            self.writer.flush(model_id)

    def _target(self, model_id: str) -> str:
        """The slot to write next (on the writer's thread): the one not holding the newest complete state."""
        main, alt = slot_paths(self.live_dir, model_id)
        known = self._newest.get(model_id)
        return alt if known is not None and known.path == main else main

    def _written(self, model_id: str, path: str | Path, extra: dict) -> None:
        """The writer wrote a state whole: it is the model's newest one to restore from."""
        label = next(label for (suffix, label), p in zip(SLOTS, slot_paths(self.live_dir, model_id)) if p == str(path))
        self._newest[model_id] = Slot(str(path), label, {"extra": extra})

    # --- restoring -------------------------------------------------------------------------------

    def restore(self, model_id: str) -> Restored | None:
        """Load the model's newest stored state that verifies into the engine (None: it has none, and
        this process never wrote one). LiveStateError if none of its stored states can be used."""
        ready = self.prefetcher.take(model_id) if self.prefetcher is not None else None
        self.writer.flush(model_id)
        slots = read_slots(self.live_dir, model_id)
        expected = self._expected.get(model_id, -1)
        if expected < 0 and all(s.manifest is None and not store.exists(s.path) for s in slots):
            return None
        problems: list[str] = []
        # The database's word holds for the first restore after recovery only: from then on the model's
        # outcomes are stored as it runs (and a repair may write newer states from another process).
        ceiling = self._ceiling.pop(model_id, None)
        for slot in candidates(slots, problems):
            if ceiling is not None and slot.seq > ceiling:
                problems.append(f"{slot.describe()}: it is ahead of the database (applied up to seq_id "
                                f"{ceiling}): its step's outcome was never stored, so the step runs again")
                continue
            read = ready is not None and ready.matches(slot)
            try:  # a copy read ahead was verified against this very manifest; the store's is verified now
                if read and isinstance(ready.loaded, Adapter):
                    self.engine.adapters[model_id] = ready.loaded
                else:
                    self.engine.load_state(model_id, slot.path, read=(ready.manifest, ready.loaded) if read else None)
            except CheckpointError as e:
                problems.append(f"{slot.describe()}: {e}")
                continue
            except Exception as e:  # whatever stops one slot from loading, the other may still do
                log.exception("loading the stored state of %s from %s failed", model_id, slot.path)
                problems.append(f"{slot.describe()}: it could not be loaded ({type(e).__name__})")
                continue
            self._newest[model_id] = slot
            self._lineage[model_id] = slot.lineage
            self._lineage_kind[model_id] = slot.manifest.get("extra", {}).get("lineage_kind")
            return Restored(slot.seq, expected, problems, prefetched=read)
        recreated = self._recreate(model_id, slots, ceiling)
        if recreated is not None:
            problems.append(f"made again from its create_model at seq_id {recreated}: the requests after it replay")
            return Restored(recreated, expected, problems)
        raise cannot_restore(model_id, problems)

    def _recreate(self, model_id: str, slots: list[Slot], ceiling: int | None) -> int | None:
        """Where no stored state verifies but the newest readable manifest says the model's history began with
        a create_model (whose adapter its seeded LoraConfig makes again, bit for bit), create it afresh: the
        scheduler replays the requests after that create_model from the database, the journal of every run.
        Its seq_id; None where the history began with a load_weights (`loraplex-admin models rebuild` can
        start from that checkpoint)."""
        newest = next((s for s in slots if s.manifest is not None), None)
        extra = newest.manifest.get("extra", {}) if newest is not None else {}
        seq = extra.get("lineage_seq")
        if extra.get("lineage_kind") != "create_model" or seq is None or (ceiling is not None and seq > ceiling):
            return None
        self.engine.create_adapter(model_id, LoraConfig(**newest.manifest["lora_config"]),
                                   newest.manifest.get("optimizer", "adamw"))
        self._newest.pop(model_id, None)
        self._lineage[model_id], self._lineage_kind[model_id] = seq, "create_model"
        self._recreated[model_id] = seq
        return seq

    def prefetch(self, model_ids: list[str]) -> None:
        """Read these models' stored states ahead, on a background thread, for their next `restore`."""
        if self.prefetcher is not None:
            self.prefetcher.want(model_ids)

    def _locate(self, model_id: str) -> tuple[Slot, int] | None:
        """(On the prefetch thread.) The slot `restore` would load first, and its size; None for a model in memory
        or with no stored state. A write of it still waiting is waited for: its slot is the one to read."""
        if model_id in self.engine.adapters:
            return None
        self.writer.flush(model_id)
        usable = candidates(read_slots(self.live_dir, model_id), [])
        return (usable[0], in_memory_bytes(usable[0])) if usable else None

    def _load_ahead(self, model_id: str, slot: Slot) -> tuple[dict, object, int]:
        """(On the prefetch thread.) The slot's verified manifest and, on CPU, the adapter `restore` would
        build from it (the engine's load_state, bit for bit); on a GPU its tensors, in host memory."""
        manifest, tensors = read_verified_state(slot.path)
        if self.engine.device.type != "cpu":
            return manifest, tensors, sum(t.numel() * t.element_size() for t in tensors.values())
        adapter = load_training_state(model_id, slot.path, self.engine.base_layers, self.engine.dtype,
                                      self.engine.max_rank, read=(manifest, tensors))
        return manifest, adapter, adapter.resident_bytes

    def restart_from(self, model_id: str, seq_id: int) -> None:
        """The scheduler replays the model's requests after `seq_id` onto its restored state now."""
        self._expected[model_id] = seq_id

    def durable_seq(self, model_id: str, at_most: int | None = None) -> int | None:
        """The seq_id to replay the model's requests after, if its engine lost them: that of its newest
        state this process wrote or restored, else its newest stored one's (verified when loaded: a
        corrupt one makes the load fall back, and `place` reports the model to be replayed from there).
        `at_most`: the seq_id the database holds as applied; a newer stored state is never restored."""
        self.writer.flush(model_id)
        if at_most is not None:
            self._ceiling[model_id] = at_most
        ceiling = self._ceiling.get(model_id)
        known = self._newest.get(model_id)
        if model_id in self._recreated:
            seq = self._recreated[model_id]
        elif known is not None and (ceiling is None or known.seq <= ceiling):
            seq = known.seq
        else:
            stored = [s for s in read_slots(self.live_dir, model_id)
                      if s.manifest is not None and (ceiling is None or s.seq <= ceiling)]
            if not stored:
                return None
            seq = stored[0].seq
        self._expected[model_id] = seq
        return seq

    # --- when to write ---------------------------------------------------------------------------

    def ran(self, model_id: str, seq_id: int) -> None:
        """After a forward_backward or an optim_step (`seq_id`: the last request the model ran): capture
        its state now if its interval has passed, else when it has."""
        self._unwritten[model_id] = seq_id
        due = self._captured_at.get(model_id, -math.inf) + self.interval
        if time.monotonic() >= due:
            self._capture_due(time.monotonic(), only=model_id)
        else:
            self._wake_at(due)

    def keep_one_copy(self, model_id: str) -> None:
        """Once the model's newest state is written whole (now, or when its pending write ends), remove the
        other slot: a run paged out while idle costs one copy on disk, not two, and its next write makes two
        again. (Its manifest's SHA-256 is of the bytes written; reading them back would only read the page
        cache.) A lone copy damaged later is made again from the database's journal of requests (`restore`)."""
        def remove_the_other() -> None:
            newest = self._newest.get(model_id)
            if newest is None or newest.seq != self._expected.get(model_id):
                return  # not written by this process, or behind: keep both
            for path in slot_paths(self.live_dir, model_id):
                if path != newest.path and store.exists(path):
                    store.delete(path)

        self.writer.when_written(model_id, remove_the_other)

    def captured_seq(self, model_id: str) -> int | None:
        """The seq_id of the model's newest captured state (gradients included, maybe still being written),
        if nothing it ran since waits to be captured."""
        return None if model_id in self._unwritten else self._expected.get(model_id)

    def forget(self, model_id: str) -> None:
        """The model left the engine (deleted, or evicted with its full state written). What its stored
        state should reflect is kept: a reload must reach it."""
        self._unwritten.pop(model_id, None)
        self._captured_at.pop(model_id, None)
        if self.prefetcher is not None:
            self.prefetcher.discard(model_id)

    def close(self) -> None:
        """Capture every state not captured yet and finish writing them all."""
        with self._engine_lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
            run_on(self._compute, lambda: self._capture_due(math.inf), work="trainer")
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.writer.close()

    def _capture_due(self, now: float, only: str | None = None) -> float:
        """Capture the states whose interval has passed by `now` (of `only`, if given); the time the next
        one is due. A busy model waits for its request's last part, whose `ran` captures it."""
        next_due = math.inf
        busy = self._busy()
        for model_id, seq_id in list(self._unwritten.items()):
            due = self._captured_at.get(model_id, -math.inf) + self.interval
            if (only is not None and model_id != only) or model_id in busy:
                continue
            if due > now:
                next_due = min(next_due, due)
            elif model_id in self.engine.adapters:
                self.persist(model_id, seq_id, wait=False, with_gradients=True)
            else:
                self._unwritten.pop(model_id)
        return next_due

    def _wake_at(self, due: float) -> None:
        if self._closed or self._timer_due <= due:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = threading.Timer(max(0.0, due - time.monotonic()), self._on_timer)
        self._timer.daemon = True
        self._timer_due = due
        self._timer.start()

    def _on_timer(self) -> None:
        with self._engine_lock:
            if threading.current_thread() is not self._timer:  # cancelled while it waited for the lock
                return
            self._timer, self._timer_due = None, math.inf
            if not self._closed:
                self._wake_at(run_on(self._compute, lambda: self._capture_due(time.monotonic()), work="trainer"))
