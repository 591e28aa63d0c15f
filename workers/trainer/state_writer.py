"""Writes adapters' durable training state on a background thread, newest state first.

The executor captures a copy of an adapter's state (a memory copy, workers/trainer/live_state.py says
when) and goes on at once; this thread writes the copy to the store. Writing on the request's
path cost 3.4 ms of a `tiny` round and 45-78 ms per SmolLM2 step. A model's newer state replaces
an older one still waiting. Until it is written the model's durable seq_id is the last written
one, and after a restart (or a dead worker) the scheduler replays the acknowledged requests after
it from the database (scheduler/service.py): nothing acknowledged is lost, only recomputed.

Where a state goes may be decided when it is written (`path` a function, called on this thread):
workers/trainer/live_state.py picks the slot that does not hold the newest complete state, which only
this thread changes, through `on_written` (called once a state is written whole).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from workers.trainer.checkpoints import TrainingState

log = logging.getLogger(__name__)


Location = str | Path | Callable[[], str | Path]


MAX_PENDING_BYTES = 1 << 30  # copies waiting to be written, before `submit` waits for the writer


class StateWriter:
    def __init__(self, on_written: Callable[[str, str | Path, dict], None] | None = None,
                 max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self._on_written = on_written  # (model id, where, extra) after a state is written whole
        self._pending: dict[str, tuple[Location, TrainingState, dict]] = {}  # model id -> what to write
        self._then: dict[str, list[Callable[[], None]]] = {}  # model id -> to run once its pending state is written
        self._writing: str | None = None
        self._finishing: str | None = None  # the model being written, once its callbacks are taken (running them)
        self._closed = False
        self._changed = threading.Condition()
        # The copies waiting here are memory beyond the trainer's budget (a page-out frees its run only as
        # its copy is written): past this, `submit` waits for the writer first.
        self.max_pending_bytes = max_pending_bytes
        self._thread = threading.Thread(target=self._run, name="state-writer", daemon=True)
        self._thread.start()

    def submit(self, model_id: str, path: Location, state: TrainingState, extra: dict) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._pending_bytes() + state.nbytes <= self.max_pending_bytes
                                   or not self._pending)
            self._pending[model_id] = (path, state, extra)
            self._changed.notify_all()

    def _pending_bytes(self) -> int:
        return sum(state.nbytes for _, state, _ in self._pending.values())

    def when_written(self, model_id: str, then: Callable[[], None]) -> None:
        """Run `then` on the writer's thread once the model's state waiting or being written is written whole
        (never if that write fails); at once, here, if none is."""
        with self._changed:
            if model_id in self._pending or (self._writing == model_id and self._finishing != model_id):
                self._then.setdefault(model_id, []).append(then)
                return
        then()

    def flush(self, model_id: str | None = None) -> None:
        """Wait until `model_id`'s submitted state (or, with None, every one) is written."""

        def done() -> bool:
            if model_id is None:
                return not self._pending and self._writing is None
            return model_id not in self._pending and self._writing != model_id

        with self._changed:
            self._changed.wait_for(done)

    def close(self) -> None:
        self.flush()
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    return
                model_id = next(iter(self._pending))
                path, state, extra = self._pending.pop(model_id)
                self._writing = model_id
            written = False
            try:
                where = path() if callable(path) else path
                state.write(where, extra)
                if self._on_written is not None:
                    self._on_written(model_id, where, extra)
                written = True
            except Exception:  # the durable state stays older; a restart replays more
                log.exception("writing the training state of %s failed", model_id)
            with self._changed:  # one hold: a `when_written` finds the model writing, or its callbacks taken
                # a failed write drops them; a newer state of the model already waiting runs them when written
                then = self._then.pop(model_id, []) if not written or model_id not in self._pending else []
                self._finishing = model_id
            # Still `_writing`: a flush of the model waits for these too (they may remove a slot its restore reads).
            for action in then if written else []:
                try:
                    action()
                except Exception:
                    log.exception("after writing the training state of %s", model_id)
            with self._changed:
                self._writing = self._finishing = None
                self._changed.notify_all()
