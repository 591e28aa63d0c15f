"""HTTP to the server: one asyncio loop on a background thread serves sync and async callers.

Sync calls schedule coroutines on that loop and return futures; async twins await the same
coroutines from the caller's loop. Transient failures (connection errors, 408, 429, 5xx) are
retried with exponential backoff (tenacity), honouring Retry-After; the server dedupes a retried
request by its (model, seq_id), so a retry never runs anything twice. The first retry for each
reason (a server it cannot reach, a status) is logged at once, as a warning of logger "loraplex":
a wrong URL would otherwise look like a hang for the whole retry window.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential_jitter

from loraplex.config import ClientConfig
from loraplex.errors import APIConnectionError, status_error

RETRY_STATUS = {408, 429, 500, 502, 503, 504}
log = logging.getLogger("loraplex")


class _Retryable(Exception):
    def __init__(self, error: Exception, retry_after: float | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.retry_after = retry_after


def _wait(base: wait_exponential_jitter):
    def wait(state) -> float:
        error = state.outcome.exception()
        hinted = getattr(error, "retry_after", None)
        return max(hinted or 0.0, base(state))
    return wait


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text
    detail = body.get("detail", body) if isinstance(body, dict) else body
    return detail if isinstance(detail, str) else str(detail)


class Transport:
    def __init__(self, config: ClientConfig, *, timeout: float = 60.0, retry_seconds: float = 120.0) -> None:
        self.config = config
        self.retry_seconds = retry_seconds
        self._told: set[str] = set()  # the retry reasons logged already (each once)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="loraplex-sdk", daemon=True)
        self._thread.start()
        headers = {"X-API-Key": config.api_key, "User-Agent": "loraplex-sdk"}
        self._client: httpx.AsyncClient = self.run(self._make_client(headers, timeout)).result()

    async def _make_client(self, headers: dict, timeout: float) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.config.base_url + "/api/v1", headers=headers, timeout=timeout)

    def run(self, coro: Coroutine) -> Future:
        """Run a coroutine on the SDK's loop; a concurrent future of its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def request(self, method: str, path: str, *, json: Any = None, content: bytes | None = None,
                      headers: dict | None = None, retry: bool = True) -> httpx.Response:
        """One call, retried while transient; raises the typed error of a final failure."""
        retrying = AsyncRetrying(
            retry=retry_if_exception(lambda e: retry and isinstance(e, _Retryable)),
            wait=_wait(wait_exponential_jitter(multiplier=0.5, max=8.0, jitter=0.5)),
            stop=stop_after_delay(self.retry_seconds), reraise=True,
            before_sleep=lambda state: self._tell(method, path, state.outcome.exception()),
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._once(method, path, json, content, headers)
        except _Retryable as e:
            raise e.error from None
        raise AssertionError("unreachable")

    def _tell(self, method: str, path: str, error: BaseException | None) -> None:
        """Log the first retry for each reason: what is retried, why, and for how long at most."""
        cause = getattr(error, "error", error)
        reason = getattr(cause, "status_code", None) or type(cause).__name__
        if reason in self._told:
            return
        self._told.add(reason)
        log.warning("loraplex: %s %s failed (%s); retrying for up to %.0f s (later retries for this reason are "
                    "not logged)", method, self.config.base_url + "/api/v1" + path, cause, self.retry_seconds)

    async def _once(self, method, path, json, content, headers) -> httpx.Response:
        try:
            response = await self._client.request(method, path, json=json, content=content, headers=headers)
        except httpx.TransportError as e:
            raise _Retryable(APIConnectionError(f"{self.config.base_url}: {e}")) from None
        if response.status_code < 400:
            return response
        error = status_error(response.status_code, _message(response))
        if response.status_code in RETRY_STATUS:
            after = response.headers.get("retry-after")
            raise _Retryable(error, float(after) if after and after.replace(".", "", 1).isdigit() else None)
        raise error

    async def stream_to(self, path: str, write) -> None:
        """GET a binary body in chunks, `write(chunk, total_bytes_or_None)` per chunk."""
        async with self._client.stream("GET", path, timeout=None) as response:
            if response.status_code >= 400:
                await response.aread()
                raise status_error(response.status_code, _message(response))
            total = int(response.headers["content-length"]) if "content-length" in response.headers else None
            async for chunk in response.aiter_bytes():
                write(chunk, total)

    def close(self) -> None:
        if self._loop.is_running():
            self.run(self._client.aclose()).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
