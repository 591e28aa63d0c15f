"""Wake the API's long-polls when a request finishes (the scheduler runs in another thread).

Waiters are asyncio tasks; `notify` may be called from any thread. A waiter registers before it
checks the database, so a result stored between the check and the wait is never missed.

In one process the notifier also hands over the stored answer, so the woken long-poll answers
without reading it back from the database. The answer is given only after it was committed: what
a client sees has survived a restart.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator


@dataclass(frozen=True)
class Answer:
    """A finished request's stored outcome, as the database row holds it."""

    result: bytes | None
    content_type: str | None
    error: dict[str, Any] | None

    @classmethod
    def of_row(cls, row) -> "Answer":
        """From a `db.models.Request` row, or a selected row with the same column names."""
        return cls(row.result, row.result_content_type, row.error)


class Watch:
    """One long-poll's wait for one request."""

    def __init__(self) -> None:
        self.finished = asyncio.Event()
        self.answer: Answer | None = None  # set with `finished` when the notifier knows it

    def wake(self, answer: Answer | None) -> None:
        if answer is not None:
            self.answer = answer
        self.finished.set()


class Notifier:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, Watch]]] = defaultdict(list)

    @contextmanager
    def watch(self, request_id: str) -> Iterator[Watch]:
        watch = Watch()
        entry = (asyncio.get_running_loop(), watch)
        with self._lock:
            self._waiters[request_id].append(entry)
        try:
            yield watch
        finally:
            with self._lock:
                waiters = self._waiters.get(request_id, [])
                if entry in waiters:
                    waiters.remove(entry)
                if not waiters:
                    self._waiters.pop(request_id, None)

    def notify(self, request_id: str, answer: Answer | None = None) -> None:
        """`request_id` finished; `answer` (if known) is its committed outcome."""
        with self._lock:
            waiters = list(self._waiters.get(request_id, []))
        for loop, watch in waiters:
            loop.call_soon_threadsafe(watch.wake, answer)
