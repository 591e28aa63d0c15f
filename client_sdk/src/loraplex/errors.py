"""Typed exceptions carrying the server's message."""

from __future__ import annotations


class LoraplexError(Exception):
    """Base of every error this SDK raises."""


class APIConnectionError(LoraplexError):
    """The server could not be reached (after the retries)."""


class APIStatusError(LoraplexError):
    """The server answered with an HTTP error status; `message` is its explanation."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(f"{status_code}: {message}")
        self.status_code = status_code
        self.message = message


class BadRequestError(APIStatusError):  # 400, 413, 422: fix the request
    pass


class AuthenticationError(APIStatusError):  # 401
    pass


class PermissionDeniedError(APIStatusError):  # 403: a hard limit (quota) or a disabled tenant
    pass


class NotFoundError(APIStatusError):  # 404
    pass


class RateLimitError(APIStatusError):  # 429 after the retries: the server is busy or a rate quota is hit
    pass


class InternalServerError(APIStatusError):  # 5xx after the retries
    pass


class RequestFailedError(LoraplexError):
    """An accepted request failed on the server; `category` is "user" (your input) or "server"."""

    def __init__(self, message: str, category: str, request_id: str) -> None:
        super().__init__(f"{message} (category {category}, request {request_id})")
        self.message = message
        self.category = category
        self.request_id = request_id


_BY_STATUS = {400: BadRequestError, 401: AuthenticationError, 403: PermissionDeniedError, 404: NotFoundError,
              413: BadRequestError, 422: BadRequestError, 429: RateLimitError}


def status_error(status_code: int, message: str) -> APIStatusError:
    cls = _BY_STATUS.get(status_code) or (InternalServerError if status_code >= 500 else APIStatusError)
    return cls(status_code, message)
