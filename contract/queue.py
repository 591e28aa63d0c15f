"""What travels from the scheduler to an executor and back: queued requests, cycles, jobs, outcomes.

The scheduler plans a `Cycle` of `QueuedRequest`s (scheduler/planner.py) and hands it to an
executor with one `Job` per request (the request and its stored payload); the executor answers one
`Outcome` per request. Celery workers get them pickled through Redis (scheduler/celery_executor.py),
an engine process through a pipe (workers/trainer/process_executor.py): plain dataclasses, no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

from contract.kinds import RequestKind

JSON = "application/json"  # the Content-Type of JSON payloads and results


@dataclass(frozen=True)
class QueuedRequest:
    id: str
    tenant_id: str
    model_id: str
    seq_id: int
    kind: RequestKind
    num_tokens: int = 0

    def __post_init__(self) -> None:
        # Rows and Redis messages hold the kind as a plain string: one type from here on.
        object.__setattr__(self, "kind", RequestKind(self.kind))


@dataclass(frozen=True)
class Part:
    """One part of a request run in parts: go on from datum `start`, taking datums of at most
    `max_tokens` input tokens (at least one engine pass; the executor cuts after whole passes)."""

    start: int
    max_tokens: int


@dataclass(frozen=True)
class PartProgress:
    """How far a request run in parts has got: datums and their input tokens done."""

    datums: int
    tokens: int


@dataclass
class Cycle:
    forward_backward: list[QueuedRequest] = field(default_factory=list)
    optim_steps: list[QueuedRequest] = field(default_factory=list)
    others: list[QueuedRequest] = field(default_factory=list)
    # request id -> the part this cycle runs of a request run in parts (its forward_backward entry
    # carries the part's token cap); `continuing`: those whose model started in an earlier cycle
    parts: dict[str, Part] = field(default_factory=dict)
    continuing: set[str] = field(default_factory=set)

    def all(self) -> list[QueuedRequest]:
        return self.forward_backward + self.optim_steps + self.others

    def keeping(self, keep: Callable[[QueuedRequest], bool]) -> "Cycle":
        """The cycle's requests that `keep` accepts, each in its place (without `parts`/`continuing`,
        which only the scheduler reads)."""
        return Cycle(*([q for q in requests if keep(q)]
                       for requests in (self.forward_backward, self.optim_steps, self.others)))

    def __bool__(self) -> bool:
        return bool(self.forward_backward or self.optim_steps or self.others)


@dataclass(frozen=True)
class Job:
    """A request and its payload: the protobuf body of a forward/forward_backward, else a JSON model of
    contract/payloads.py."""

    request: QueuedRequest
    payload: bytes
    part: Part | None = None  # a forward/forward_backward run in parts: which part (workers/trainer/parts.py)


@dataclass(frozen=True)
class Outcome:
    result: bytes | None = None
    content_type: str | None = None
    error: dict[str, str] | None = None  # {"error": message, "category": "user" | "server"}
    checkpoint: dict[str, Any] | None = field(default=None)  # a checkpoint written, for the scheduler to record
    # a part of a request run in parts went well and more remain: how far it has got (no result yet)
    progress: PartProgress | None = None
    # what the dashboard charts of this request (workers/trainer/run_metrics.py), stored with the outcome
    metrics: dict[str, float] | None = None

    @classmethod
    def json(cls, value: dict[str, Any], checkpoint: dict[str, Any] | None = None) -> "Outcome":
        return cls(json.dumps(value).encode(), JSON, checkpoint=checkpoint)

    @classmethod
    def failed(cls, message: str, category: str) -> "Outcome":
        return cls(error={"error": message, "category": category})
