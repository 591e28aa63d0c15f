"""The inference routes' keys: a tenant's `tml-` key as `Authorization: Bearer` (the openai SDK) or
`x-api-key` (the anthropic SDK; the Tinker routes' header).

The request guard (api/request_guard.py) reads X-API-Key before any route runs, to let a body over
64 KiB in only from a live key; an agent's conversation passes that soon. `BearerAsApiKey` sits in
front of it and, on these routes only, hands a bearer key over as X-API-Key.
"""

from __future__ import annotations

from starlette.datastructures import Headers

PREFIXES = ("/oai/", "/anthropic/")


def api_key(headers: Headers) -> str | None:
    key = headers.get("x-api-key")
    if key:
        return key
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


class BearerAsApiKey:
    """A plain ASGI middleware (as the guard is)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PREFIXES):
            headers = Headers(scope=scope)
            key = api_key(headers)
            if key and "x-api-key" not in headers:
                scope = dict(scope, headers=[*scope["headers"], (b"x-api-key", key.encode("latin-1"))])
        await self.app(scope, receive, send)
