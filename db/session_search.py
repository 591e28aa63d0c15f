"""search_sessions: a tenant's sessions that match a search, newest first, a page at a time.

A session's display name is kept in its user_metadata (api/routes/sessions.py), so the name and the
metadata filters read the same JSON column. Pages follow (created_at, id) downwards from a cursor:
a session created while a client pages is never answered twice or skipped.

Loraplex records that a client finished its session (`finished_at`), not the reason it gave, and it
never fails or cancels a session itself: a finished session's status is unknown (None), `active` is a
session neither finished nor silent for longer than the SDK's own heartbeat warning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.orm import Session

from db.models import Checkpoint, ClientSession, TrainingModel

# The SDK heartbeats every 10 s and warns after 120 s without a successful one: a session silent
# longer than that is not known to be running.
ACTIVE_HEARTBEAT_SECONDS = 120
DISPLAY_NAME = "display_name"  # the user_metadata key create_session keeps the display name under


@dataclass(frozen=True)
class SessionQuery:
    tenant_id: str
    now: datetime
    session_id: str | None = None
    display_name: str | None = None  # each word, case-insensitively, somewhere in the name
    project_ids: Sequence[str] | None = None
    user_metadata: dict[str, str] = field(default_factory=dict)
    statuses: Sequence[str] | None = None  # "active", "client_finished", "cancelled", "failed"; None: any
    limit: int = 50
    after: tuple[datetime, str] | None = None  # the cursor: the last (created_at, id) answered


@dataclass(frozen=True)
class SessionFound:
    session: ClientSession
    status: str | None  # "active" or None (unknown: finished, or silent)
    checkpoints: int
    checkpoint_bytes: int


def search(s: Session, q: SessionQuery) -> tuple[list[SessionFound], bool]:
    """One page of matches and whether more follow."""
    where = [ClientSession.tenant_id == q.tenant_id]
    named = []
    if q.session_id is not None:
        named.append(ClientSession.id == q.session_id)
    if q.display_name is not None:
        name = sa.func.lower(ClientSession.user_metadata[DISPLAY_NAME].as_string())
        named.append(sa.and_(sa.true(), *(name.contains(w.lower(), autoescape=True) for w in q.display_name.split())))
    if named:  # the SDK: with both, a session matching either one matches
        where.append(sa.or_(*named))
    if q.project_ids is not None:
        where.append(ClientSession.project_id.in_(q.project_ids))
    for key, value in q.user_metadata.items():
        where.append(ClientSession.user_metadata[key].as_string() == value)
    if q.statuses is not None:
        where.append(sa.or_(*(_status_is(status, q.now) for status in q.statuses)))
    if q.after is not None:
        created, session_id = q.after
        where.append(sa.or_(ClientSession.created_at < created,
                            sa.and_(ClientSession.created_at == created, ClientSession.id < session_id)))
    rows = list(s.scalars(sa.select(ClientSession).where(*where)
                          .order_by(ClientSession.created_at.desc(), ClientSession.id.desc()).limit(q.limit + 1)))
    more, rows = len(rows) > q.limit, rows[:q.limit]
    stored = _checkpoints(s, q.tenant_id, [row.id for row in rows])
    active = _active_since(q.now)
    return [SessionFound(row, "active" if row.finished_at is None and row.last_heartbeat_at >= active else None,
                         *stored.get(row.id, (0, 0))) for row in rows], more


def _active_since(now: datetime) -> datetime:
    return now - timedelta(seconds=ACTIVE_HEARTBEAT_SECONDS)


def _status_is(status: str, now: datetime) -> sa.ColumnElement[bool]:
    if status == "active":
        return sa.and_(ClientSession.finished_at.is_(None), ClientSession.last_heartbeat_at >= _active_since(now))
    if status == "client_finished":
        return ClientSession.finished_at.is_not(None)
    return sa.false()  # cancelled, failed: never given here


def _checkpoints(s: Session, tenant_id: str, session_ids: list[str]) -> dict[str, tuple[int, int]]:
    """session id -> (checkpoints of its runs, their bytes)."""
    if not session_ids:
        return {}
    rows = s.execute(sa.select(TrainingModel.session_id, sa.func.count(Checkpoint.id),
                               sa.func.coalesce(sa.func.sum(Checkpoint.size_bytes), 0))
                     .join(Checkpoint, Checkpoint.model_id == TrainingModel.id)
                     .where(TrainingModel.tenant_id == tenant_id, Checkpoint.tenant_id == tenant_id,
                            TrainingModel.session_id.in_(session_ids))
                     .group_by(TrainingModel.session_id))
    return {session_id: (int(count), int(size)) for session_id, count, size in rows}
