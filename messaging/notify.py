"""Wake the API's long-polls when a request finishes (the scheduler runs in another thread).

Waiters are asyncio tasks; `notify` may be called from any thread. A waiter registers before it
checks the database, so a result stored between the check and the wait is never missed.

In one process the notifier also hands over the stored answer, so the woken long-poll answers
without reading it back from the database. The answer is given only after it was committed: what
a client sees has survived a restart.

A streaming call also follows a request's progress: a `Feed` gets each engine step's new tokens
(`progress`, from the engine thread) and then the finish, in that order, registered like a watch
before the request is submitted so no step is missed.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ContextManager


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


@dataclass(frozen=True)
class Finished:
    """A feed's last item: the request finished; `answer` is its committed outcome when known."""

    answer: Answer | None


class Feed:
    """One streaming call's view of one request: lists of deltas (contract/sampling.py SampleDelta)
    in the order the engine made them, then `Finished`."""

    def __init__(self) -> None:
        self.items: asyncio.Queue[list[Any] | Finished] = asyncio.Queue()

    def wake(self, answer: Answer | None) -> None:
        self.items.put_nowait(Finished(answer))


class Notifier:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, Watch | Feed]]] = defaultdict(list)

    @contextmanager
    def _registered(self, request_id: str, waiter):
        entry = (asyncio.get_running_loop(), waiter)
        with self._lock:
            self._waiters[request_id].append(entry)
        try:
            yield waiter
        finally:
            with self._lock:
                waiters = self._waiters.get(request_id, [])
                if entry in waiters:
                    waiters.remove(entry)
                if not waiters:
                    self._waiters.pop(request_id, None)

    def watch(self, request_id: str) -> ContextManager[Watch]:
        return self._registered(request_id, Watch())

    def feed(self, request_id: str) -> ContextManager[Feed]:
        return self._registered(request_id, Feed())

    def notify(self, request_id: str, answer: Answer | None = None) -> None:
        """`request_id` finished; `answer` (if known) is its committed outcome."""
        with self._lock:
            waiters = list(self._waiters.get(request_id, []))
        for loop, waiter in waiters:
            loop.call_soon_threadsafe(waiter.wake, answer)

    def progress(self, request_id: str, deltas: list[Any]) -> None:
        """New tokens of `request_id` (from any thread): to its feeds, in order, before its `notify`."""
        with self._lock:
            feeds = [(loop, w) for loop, w in self._waiters.get(request_id, []) if isinstance(w, Feed)]
        for loop, feed in feeds:
            loop.call_soon_threadsafe(feed.items.put_nowait, deltas)
