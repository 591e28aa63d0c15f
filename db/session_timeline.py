"""A session's requests as a timeline: when each was accepted, started and finished, and the trainer
cycle it ran in, for the session's Perfetto trace (api/perfetto_trace.py, docs/sessions.md).

A cycle is one batched engine call of the scheduler: every request it runs is stored with the same
`started_at` (scheduler/service.py stamps the call's start on all of them), so that timestamp is the
cycle's key, as on the dashboard's operator view. Of a cycle the timeline keeps what it cost and how
full it was (its requests, tokens and how many tenants shared it), never whose the other requests were.
A request run in parts over several cycles is stamped with its first part's cycle. Samples have no
cycle: the sampler batches continuously (scheduler/sampling.py), and a sample's wait inside it is not
recorded apart from its sampling.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.orm import Session

from db.models import ClientSession, Request, Sampler, TrainingModel

CYCLE_LOOKUP_CHUNK = 500  # cycle keys per IN (...) query: far below every database's bound-parameter limit


@dataclass(frozen=True)
class RequestSpan:
    request_id: str
    model_id: str  # a training run or a sampler of the session
    seq_id: int | None
    kind: str
    state: str
    num_tokens: int
    output_tokens: int
    created_at: datetime
    started_at: datetime | None  # None: not started yet, or a sample
    finished_at: datetime | None  # None: not finished yet
    error: str | None  # the request's own error, as its future answered it


@dataclass(frozen=True)
class Cycle:
    """One trainer cycle as every tenant's requests in it add up; `tenants` counts the caller too."""

    started_at: datetime
    finished_at: datetime | None  # when its first outcome was stored: a request run in parts finishes later
    requests: int
    tenants: int
    tokens: int


@dataclass(frozen=True)
class SessionTimeline:
    session_id: str
    created_at: datetime
    finished_at: datetime | None
    runs: list[str]
    samplers: list[str]
    requests: list[RequestSpan]  # in order of acceptance
    cycles: dict[datetime, Cycle]  # by started_at: the cycles the session's requests ran in


def timeline(s: Session, session: ClientSession) -> SessionTimeline:
    """The timeline of `session` (a row the caller owns): its own runs, samplers and requests only."""
    runs = list(s.scalars(sa.select(TrainingModel.id).where(TrainingModel.session_id == session.id)
                          .order_by(TrainingModel.created_at)))
    samplers = list(s.scalars(sa.select(Sampler.id).where(Sampler.session_id == session.id)
                              .order_by(Sampler.created_at)))
    columns = (Request.id, Request.model_id, Request.seq_id, Request.kind, Request.state, Request.num_tokens,
               Request.output_tokens, Request.created_at, Request.started_at, Request.finished_at, Request.error)
    # a subquery, not a list of ids: a long RL session may have thousands of samplers
    models = sa.union(sa.select(TrainingModel.id).where(TrainingModel.session_id == session.id),
                      sa.select(Sampler.id).where(Sampler.session_id == session.id))
    rows = s.execute(sa.select(*columns).where(Request.tenant_id == session.tenant_id, Request.model_id.in_(models))
                     .order_by(Request.created_at, Request.id))
    requests = [RequestSpan(r.id, r.model_id, r.seq_id, r.kind, r.state, r.num_tokens, r.output_tokens,
                            r.created_at, r.started_at, r.finished_at, (r.error or {}).get("error"))
                for r in rows]
    return SessionTimeline(session.id, session.created_at, session.finished_at, runs, samplers, requests,
                           cycles(s, {r.started_at for r in requests if r.started_at is not None}))


def cycles(s: Session, keys: Iterable[datetime]) -> dict[datetime, Cycle]:
    """The cycles that started at `keys`, with all their requests counted (every tenant's)."""
    keys, out = sorted(keys), {}
    for i in range(0, len(keys), CYCLE_LOOKUP_CHUNK):
        chunk = keys[i:i + CYCLE_LOOKUP_CHUNK]
        rows = s.execute(sa.select(Request.started_at, sa.func.min(Request.finished_at), sa.func.count(),
                                   sa.func.count(sa.distinct(Request.tenant_id)), sa.func.sum(Request.num_tokens))
                         .where(Request.started_at.in_(chunk)).group_by(Request.started_at))
        for started, finished, requests, tenants, tokens in rows:
            out[started] = Cycle(started, finished, requests, tenants, int(tokens or 0))
    return out
