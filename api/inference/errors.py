"""Errors in OpenAI's shape, so the `openai` SDK raises its own typed errors with their `param`.

    {"error": {"message": "temperature: ...", "type": "invalid_request_error", "param": "temperature", "code": null}}

Every message starts with the field (or route) it is about, like the Tinker routes' `detail`; shared
lookups raise FastAPI's HTTPException in that form, and it is turned into this shape at the route.
"""

from __future__ import annotations

import re

from fastapi import HTTPException
from fastapi.responses import JSONResponse

from api.public_errors import MAX_ERROR_CHARS, public_error

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error",
          504: "server_error"}
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]'\-]*): ")


class InferenceError(HTTPException):
    """A refusal of the inference API; `code` is OpenAI's (e.g. "model_not_found")."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(status, message, headers)
        self.code = code


def error_response(settings, exc: HTTPException) -> JSONResponse:
    message = public_error(str(exc.detail), settings.checkpoint_dir, settings.store_root)[:MAX_ERROR_CHARS]
    field = _FIELD.match(message)
    body = {"message": message, "type": _TYPES.get(exc.status_code, "server_error" if exc.status_code >= 500
                                                   else "invalid_request_error"),
            "param": field[1] if field else None, "code": getattr(exc, "code", None)}
    return JSONResponse({"error": body}, status_code=exc.status_code, headers=getattr(exc, "headers", None))
