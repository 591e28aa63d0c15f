"""Errors the engine reports per request, in the Tinker categories ("user" = the caller's fault).

An executor answers each as `Outcome.failed(str(error), error.category)` (contract/queue.py); the
API raises InvalidInputError's checks at the door too, so a bad request fails there with the same
message the engine would give.
"""

from __future__ import annotations


class EngineError(Exception):
    category = "server"


class InvalidInputError(EngineError, ValueError):
    """Bad input, raised before any state changes. `field` names where it is, e.g. data[3].loss_fn_inputs['weights']."""

    category = "user"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class UnknownAdapterError(InvalidInputError):
    def __init__(self, adapter_id: str) -> None:
        super().__init__("adapter_id", f"no adapter {adapter_id!r}")


class SamplerBusy(Exception):
    """Too many samples in flight: the API answers 429 and the client backs off and retries."""


class SamplerUnavailable(Exception):
    """The engine is down: the API answers 503."""
