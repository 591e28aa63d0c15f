"""Thread-safe id counters (per-client seq_ids, per-session model and sampler numbers)."""

from __future__ import annotations

import itertools
import threading


class Counter:
    def __init__(self, start: int = 0) -> None:
        self._values = itertools.count(start)
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            return next(self._values)
