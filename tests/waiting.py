"""Waiting for a state instead of sleeping for a guessed time."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], what: str | Callable[[], str], timeout: float = 30.0,
               interval: float = 0.05) -> T:
    """Call `condition` every `interval` seconds until it returns something truthy, and return that;
    fail naming `what` (the state waited for; a function to say it as it is then) if `timeout` seconds
    pass first."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"waited {timeout:g} s for {what() if callable(what) else what}"
        time.sleep(interval)
