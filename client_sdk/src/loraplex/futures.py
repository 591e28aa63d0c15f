"""APIFuture: the result of an accepted request, with `.result()` for sync code and `await` for async.

Behind it: the request was POSTed and answered with a request id; the future long-polls
`retrieve_future` (the server holds each poll up to ~30 s, then says try_again with the request's
queue position) until the result or the failure arrives, and decodes it. A wait longer than a few
seconds shows a tqdm bar with the queue position on a terminal; elsewhere (a script's log, a pipe)
a line on stderr after 10 s and then every minute.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import json
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

from tqdm.auto import tqdm

from loraplex._transport import Transport
from loraplex.errors import RequestFailedError
from loraplex.wire.codec import PROTOBUF

T = TypeVar("T")
PROGRESS_AFTER_SECONDS = 3.0
LINE_AFTER_SECONDS, LINE_EVERY_SECONDS = 10.0, 60.0  # progress lines where stderr is no terminal


class Waiting:
    """What the server last said of a pending request: its id and how many requests are ahead of it."""

    request_id: str | None = None
    queue_position: int | None = None

    def describe(self) -> str:
        return "" if self.queue_position is None else f"queue position {self.queue_position}"


_WAITING: contextvars.ContextVar[Waiting] = contextvars.ContextVar("loraplex_waiting")


async def _reporting(waiting: Waiting, coro: Coroutine[Any, Any, T]) -> T:
    _WAITING.set(waiting)  # this task's context: `retrieve` below, awaited by coro, fills it in
    return await coro


def json_result(raw: bytes, _content_type: str) -> dict:
    """The decoder of results that are JSON (every request type but forward/backward and sample)."""
    return json.loads(raw)


async def retrieve(transport: Transport, request_id: str, request_type: str, decode: Callable[[bytes, str], T]) -> T:
    """Poll until the request is finished; decode(body, content_type) its result."""
    body = {"request_id": request_id, "allow_metadata_only": False}
    headers = {"X-Tinker-Request-Type": request_type, "Accept": f"{PROTOBUF}, application/json"}
    while True:
        response = await transport.request("POST", "/retrieve_future", json=body, headers=headers)
        content_type = response.headers.get("content-type", "")
        if content_type.startswith("application/json"):
            payload = response.json()
            if payload.get("type") == "try_again":
                waiting = _WAITING.get(None)
                if waiting is not None:
                    waiting.request_id, waiting.queue_position = request_id, payload.get("queue_position")
                continue
            if "error" in payload:
                raise RequestFailedError(payload["error"], payload.get("category", "server"), request_id)
        return decode(response.content, content_type)


class APIFuture(Generic[T]):
    def __init__(self, transport: Transport, coro: Coroutine[Any, Any, T], description: str) -> None:
        self.waiting = Waiting()
        self._future: concurrent.futures.Future[T] = transport.run(_reporting(self.waiting, coro))
        self.description = description

    def result(self, timeout: float | None = None) -> T:
        """Block until the result is there (TimeoutError after `timeout` seconds)."""
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        try:
            return self._future.result(timeout=PROGRESS_AFTER_SECONDS if timeout is None else min(timeout, PROGRESS_AFTER_SECONDS))
        except concurrent.futures.TimeoutError:
            pass
        next_line = started + LINE_AFTER_SECONDS
        with tqdm(desc=f"waiting for {self.description}", unit="s", bar_format="{desc}: {elapsed}{postfix}",
                  disable=None) as bar:
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{self.description} did not finish within {timeout} s")
                try:
                    return self._future.result(timeout=1.0 if remaining is None else min(1.0, remaining))
                except concurrent.futures.TimeoutError:
                    bar.set_postfix_str(self.waiting.describe(), refresh=False)
                    bar.update(1)
                    if bar.disable and time.monotonic() >= next_line:  # no terminal: a plain line now and then
                        next_line += LINE_EVERY_SECONDS
                        self._tell(time.monotonic() - started)

    def _tell(self, waited: float) -> None:
        where = ", ".join(filter(None, [self.waiting.request_id and f"request {self.waiting.request_id}",
                                        self.waiting.describe()]))
        print(f"loraplex: still waiting for {self.description} after {waited:.0f} s"
              + (f" ({where})" if where else ""), file=sys.stderr, flush=True)

    def done(self) -> bool:
        return self._future.done()

    def __await__(self):
        return asyncio.wrap_future(self._future).__await__()

    async def result_async(self) -> T:
        return await self

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "pending"
        return f"APIFuture({self.description}, {state})"
