"""APIFuture: the result of an accepted request, with `.result()` for sync code and `await` for async.

Behind it: the request was POSTed and answered with a request id; the future long-polls
`retrieve_future` (the server holds each poll up to ~30 s, then says try_again) until the result
or the failure arrives, and decodes it. Waits longer than a few seconds show a tqdm bar.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

from tqdm.auto import tqdm

from loraplex._transport import Transport
from loraplex.errors import RequestFailedError
from loraplex.wire.codec import PROTOBUF

T = TypeVar("T")
PROGRESS_AFTER_SECONDS = 3.0


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
                continue
            if "error" in payload:
                raise RequestFailedError(payload["error"], payload.get("category", "server"), request_id)
        return decode(response.content, content_type)


class APIFuture(Generic[T]):
    def __init__(self, transport: Transport, coro: Coroutine[Any, Any, T], description: str) -> None:
        self._future: concurrent.futures.Future[T] = transport.run(coro)
        self.description = description

    def result(self, timeout: float | None = None) -> T:
        """Block until the result is there (TimeoutError after `timeout` seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            return self._future.result(timeout=PROGRESS_AFTER_SECONDS if timeout is None else min(timeout, PROGRESS_AFTER_SECONDS))
        except concurrent.futures.TimeoutError:
            pass
        with tqdm(desc=f"waiting for {self.description}", unit="s", bar_format="{desc}: {elapsed}", disable=None) as bar:
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{self.description} did not finish within {timeout} s")
                try:
                    return self._future.result(timeout=1.0 if remaining is None else min(1.0, remaining))
                except concurrent.futures.TimeoutError:
                    bar.update(1)

    def done(self) -> bool:
        return self._future.done()

    def __await__(self):
        return asyncio.wrap_future(self._future).__await__()

    async def result_async(self) -> T:
        return await self

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "pending"
        return f"APIFuture({self.description}, {state})"
