"""The door every HTTP request passes before a route sees it: bounded bodies, released seq_ids.

1. Bodies are read in bounded memory, whatever the client declares. A body over
   `max_request_bytes` is refused with 413, by its Content-Length before anything is read, or
   while it streams in (chunked uploads declare no length). A caller without a live API key gets
   at most `UNAUTHENTICATED_BODY_BYTES` read: past that the key is checked (once, then cached
   briefly) and a missing or dead key is refused with 401, so a caller with no key cannot make
   the server hold a large body.
2. A JSON body passes the input policy (api/input_policy.py) before a route parses it: valid
   UTF-8 and Unicode, nested at most MAX_JSON_DEPTH levels; otherwise a 400 naming the field (in
   the OpenAI or Anthropic error shape on those routes).
3. A refused training request releases its seq_id at once (api/refusals.py): every 4xx except
   429 whose body names a (model_id, seq_id) is recorded before the answer goes out, so the
   client's next request finds it already passed.

A plain ASGI middleware: Starlette's BaseHTTPMiddleware costs a task group and a stream per request.
"""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from api import input_policy
from api.deps import tenant_of_key
from api.inference.errors import InferenceError, error_response
from api.public_errors import MAX_ERROR_CHARS
from api.refusals import prefix_bytes, read_seq_ref, record_refusal
from db.tenants import hash_key

UNAUTHENTICATED_BODY_BYTES = 64 * 1024  # more than any request that needs no key
_KEY_CACHE_SECONDS = 30.0  # only gates body reading; every route still authenticates for itself
_KEY_CACHE_SIZE = 10_000
_NO_KEY = "X-API-Key: missing, invalid, revoked or disabled (a body this large needs a live key)"
# Bodies a route never reads as JSON: forward_backward's protobuf (checked after decoding), forms.
_NOT_JSON = ("application/x-protobuf", "application/x-www-form-urlencoded", "multipart/form-data")
# Larger JSON bodies are checked on a worker thread, so the event loop keeps serving others meanwhile.
_CHECK_INLINE_BYTES = 64 * 1024


class Refused(Exception):
    def __init__(self, status: int, detail: str, prefix: bytes = b"") -> None:
        self.status, self.detail, self.prefix = status, detail, prefix


class RequestGuard:
    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes
        self._live_keys: dict[str, float] = {}  # key hash -> checked until (monotonic)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            body = await self._read_body(scope, receive, headers)
            await _check_json(scope, headers, body)
        except Refused as refused:
            await self._refuse(scope, send, headers, refused)
            return
        delivered = False

        async def replay() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect

        await self.app(scope, replay, _ReleasingSend(send, scope, headers, body))

    async def _read_body(self, scope, receive, headers: Headers) -> bytes:
        declared = headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_bytes:
            if not await self._live_key(scope, headers):
                raise Refused(401, _NO_KEY)
            raise Refused(413, f"body: {declared} bytes exceed the limit of {self.max_bytes}",
                          await _read_prefix(receive, _keep(headers)))
        chunks: list[bytes] = []
        size, key_checked = 0, False
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise Refused(400, "body: the client disconnected before sending all of it")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > UNAUTHENTICATED_BODY_BYTES and not key_checked:
                if not await self._live_key(scope, headers):
                    raise Refused(401, _NO_KEY)
                key_checked = True
            if size > self.max_bytes:
                raise Refused(413, f"body: over the limit of {self.max_bytes} bytes",
                              _prefix(chunks + [chunk], _keep(headers)))
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _live_key(self, scope, headers: Headers) -> bool:
        key = headers.get("x-api-key")
        if not key:
            return False
        digest, now = hash_key(key), time.monotonic()
        if self._live_keys.get(digest, 0.0) > now:
            return True
        state = scope["app"].state

        def lookup() -> bool:
            with state.sessions() as db:
                return tenant_of_key(db, key, state.tokens) is not None

        if not await run_in_threadpool(lookup):
            return False
        if len(self._live_keys) >= _KEY_CACHE_SIZE:
            self._live_keys.clear()
        self._live_keys[digest] = now + _KEY_CACHE_SECONDS
        return True

    async def _refuse(self, scope, send, headers: Headers, refused: Refused) -> None:
        """Answer a request refused here; the client may still be sending (the server closes the connection)."""
        if refused.status != 401:
            await release_seq_id(scope, headers, refused.prefix, refused.status, refused.detail)
        await _refusal(scope, refused)(scope, _no_receive, send)


async def _check_json(scope, headers: Headers, body: bytes) -> None:
    """The input policy on a body its route reads as JSON (Refused with 400 if it fails)."""
    content_type = headers.get("content-type", "").lower()
    if not body or content_type.startswith(_NOT_JSON):
        return
    if len(body) <= _CHECK_INLINE_BYTES:
        problem = input_policy.json_body_problem(body)
    else:
        problem = await run_in_threadpool(input_policy.json_body_problem, body)
    if problem is not None:
        raise Refused(400, problem, body[:_keep(headers)])


def _refusal(scope, refused: Refused) -> JSONResponse:
    """A refusal in the error shape of the route's API: OpenAI's, Anthropic's, or the Tinker routes' detail.
    (The 401 and 413 of reading a body keep the detail shape on every route.)"""
    path = scope["path"]
    if refused.status == 400 and path.startswith(("/oai/", "/anthropic/")):
        settings = scope["app"].state.settings
        if path.startswith("/anthropic/"):
            from api.inference.anthropic_api import anthropic_error  # the Anthropic routes' own module

            return anthropic_error(settings, InferenceError(400, refused.detail))
        return error_response(settings, InferenceError(400, refused.detail))
    return JSONResponse({"detail": refused.detail}, status_code=refused.status)


def _keep(headers: Headers) -> int:
    """How much of a refused body is kept to find its (model_id, seq_id) (api/refusals.py)."""
    return prefix_bytes(headers.get("content-encoding", ""))


def _prefix(chunks: list[bytes], keep: int) -> bytes:
    prefix = b""
    for chunk in chunks:
        if len(prefix) >= keep:
            break
        prefix += chunk[:keep - len(prefix)]
    return prefix


async def _read_prefix(receive, keep: int) -> bytes:
    prefix = b""
    while len(prefix) < keep:
        message = await receive()
        prefix += message.get("body", b"")
        if message["type"] != "http.request" or not message.get("more_body", False):
            break
    return prefix[:keep]


async def _no_receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}


async def release_seq_id(scope, headers: Headers, body: bytes, status: int, detail: str) -> None:
    """Record a refused request that names a (model_id, seq_id), so the model's next one does not wait."""
    if scope["method"] != "POST" or not body:
        return
    ref = read_seq_ref(body, headers.get("content-type", ""), headers.get("content-encoding", ""))
    if ref is None:
        return
    error = f"refused with HTTP {status} ({scope['path']}): {detail}"
    await run_in_threadpool(record_refusal, scope["app"].state, headers.get("x-api-key"), ref[0], ref[1], error)


class _ReleasingSend:
    """Passes the response through; a 4xx (but 429) is held until its refusal is recorded."""

    def __init__(self, send, scope, headers: Headers, body: bytes) -> None:
        self.send, self.scope, self.headers, self.body = send, scope, headers, body
        self.held: list[dict[str, Any]] = []

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status = message["status"]
            if 400 <= status < 500 and status not in (401, 429) and self.scope["method"] == "POST":
                self.held.append(message)
                return
        elif self.held:
            self.held.append(message)
            if message.get("more_body", False):
                return
            await release_seq_id(self.scope, self.headers, self.body, self.held[0]["status"], _detail(self.held))
            for held in self.held:
                await self.send(held)
            self.held = []
            return
        await self.send(message)


def _detail(messages: list[dict[str, Any]]) -> str:
    """The error text of a held JSON error response: its `detail`, or the raw text, shortened."""
    raw = b"".join(m.get("body", b"") for m in messages[1:])
    try:
        detail = json.loads(raw).get("detail", raw.decode(errors="replace"))
    except (ValueError, AttributeError):
        detail = raw.decode(errors="replace")
    return str(detail)[:MAX_ERROR_CHARS]
