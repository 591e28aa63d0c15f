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


class StateWriter:
    def __init__(self, on_written: Callable[[str, str | Path, dict], None] | None = None) -> None:
        self._on_written = on_written  # (model id, where, extra) after a state is written whole
        self._pending: dict[str, tuple[Location, TrainingState, dict]] = {}  # model id -> what to write
        self._writing: str | None = None
        self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="state-writer", daemon=True)
        self._thread.start()

    def submit(self, model_id: str, path: Location, state: TrainingState, extra: dict) -> None:
        with self._changed:
            self._pending[model_id] = (path, state, extra)
            self._changed.notify_all()

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
            try:
                where = path() if callable(path) else path
                state.write(where, extra)
                if self._on_written is not None:
                    self._on_written(model_id, where, extra)
            except Exception:  # the durable state stays older; a restart replays more
                log.exception("writing the training state of %s failed", model_id)
            finally:
                with self._changed:
                    self._writing = None
                    self._changed.notify_all()
