"""An executor's durable copy of each adapter's training state: the "live" folder per model.

Written after create_model and load_weights before the outcome is returned, and after optim_steps
in the background (a copy taken on the engine's thread, written by `StateWriter`). Writing it is
not what makes an acknowledged step durable: the database holds every acknowledged request, and
after a restart the scheduler replays the ones after the live state's seq_id. So a model stepping
faster than `interval` seconds has its state captured at most once per interval (a SmolLM2 rank-16
state is 68 MB: copying, hashing and writing it after every step cost a core for ~0.3 s); a later
step's state is captured by a timer once its interval has passed, so a model that stops training
is written soon after, and `close` captures every state still unwritten. The price: a crash
replays up to `interval` seconds of each model's steps.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

from scheduler.state_writer import StateWriter
from workers import store
from workers.compute_thread import ComputeThread, run_on
from workers.trainer.checkpoints import TrainingState, read_manifest
from workers.trainer.engine import TrainerEngine


class LiveStates:
    def __init__(self, engine: TrainerEngine, live_dir: str | Path, engine_lock: threading.RLock,
                 interval: float = 0.0, compute: ComputeThread | None = None) -> None:
        self.engine = engine
        self._compute = compute  # where the timer's and close's captures (copies) run, as the engine's work
        self.live_dir = str(live_dir)
        self.interval = interval
        self.writer = StateWriter()
        # Held by whoever runs the engine, and here around every capture: none sees half a step.
        # Everything below changes only under it.
        self._engine_lock = engine_lock
        self._captured_at: dict[str, float] = {}  # model -> monotonic time of its last capture
        self._unwritten: dict[str, int] = {}  # model -> seq_id of its newest optim_step not captured yet
        self._timer: threading.Timer | None = None  # one-shot, only while states wait for their interval
        self._timer_due = math.inf
        self._closed = False

    def path(self, model_id: str) -> str:
        return store.join(self.live_dir, model_id)

    def persist(self, model_id: str, seq_id: int, *, wait: bool = True, with_gradients: bool = False) -> None:
        """Capture the model's state as of `seq_id` now; write it before returning, or (wait=False) in the
        background (the capture is a copy). Every write of a model goes through the writer, so none overtakes a newer one."""
        state = TrainingState.capture(self.engine.adapter(model_id), with_gradients=with_gradients)
        self._captured_at[model_id] = time.monotonic()
        self._unwritten.pop(model_id, None)
        self.writer.submit(model_id, self.path(model_id), state, {"seq_id": seq_id})
        if wait:
            self.writer.flush(model_id)

    def stepped(self, model_id: str, seq_id: int) -> None:
        """After an optim_step: capture now if the model's interval has passed, else when it has."""
        due = self._captured_at.get(model_id, -math.inf) + self.interval
        if time.monotonic() >= due:
            self.persist(model_id, seq_id, wait=False)
        else:
            self._unwritten[model_id] = seq_id
            self._wake_at(due)

    def forget(self, model_id: str) -> None:
        """The model left the engine (deleted, or evicted with its full state written)."""
        self._unwritten.pop(model_id, None)
        self._captured_at.pop(model_id, None)

    def durable_seq(self, model_id: str) -> int | None:
        """The seq_id the model's durable state reflects, or None if it has none."""
        self.writer.flush(model_id)
        manifest = read_manifest(self.path(model_id))
        return None if manifest is None else int(manifest.get("extra", {}).get("seq_id", -1))

    def close(self) -> None:
        """Capture every state not captured yet and finish writing them all."""
        with self._engine_lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
            run_on(self._compute, lambda: self._capture_due(math.inf), work="trainer")
        self.writer.close()

    def _capture_due(self, now: float) -> float:
        """Capture the states whose interval has passed by `now`; the time the next one is due."""
        next_due = math.inf
        for model_id, seq_id in list(self._unwritten.items()):
            due = self._captured_at.get(model_id, -math.inf) + self.interval
            if due > now:
                next_due = min(next_due, due)
            elif model_id in self.engine.adapters:
                self.persist(model_id, seq_id, wait=False)
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
