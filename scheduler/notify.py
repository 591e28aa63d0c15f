"""Wake the API's long-polls when a request finishes (the scheduler runs in another thread).

Waiters are asyncio tasks; `notify` may be called from any thread. A waiter registers before it
checks the database, so a result stored between the check and the wait is never missed.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator


class Notifier:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = defaultdict(list)

    @contextmanager
    def watch(self, request_id: str) -> Iterator[asyncio.Event]:
        event = asyncio.Event()
        entry = (asyncio.get_running_loop(), event)
        with self._lock:
            self._waiters[request_id].append(entry)
        try:
            yield event
        finally:
            with self._lock:
                waiters = self._waiters.get(request_id, [])
                if entry in waiters:
                    waiters.remove(entry)
                if not waiters:
                    self._waiters.pop(request_id, None)

    def notify(self, request_id: str) -> None:
        with self._lock:
            waiters = list(self._waiters.get(request_id, []))
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)
