"""The audit log: what tenants and operators did to what is stored, one row per event.

Each event belongs to the tenant whose data it touched (None: an operator's own, e.g. operator
keys). A tenant's keys read its own events (GET /api/v1/audit, the SDK's get_audit_log); operators
read everyone's (`loraplex-admin audit`). Reads of a public checkpoint by another tenant are that
reader's events only: the owner is not told who read it.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from db.models import AuditEvent

# The SDK's event_type filter names these categories; "teams" exist in Tinker, not here (always empty).
CATEGORIES = ("checkpoints", "projects", "organizations", "teams")
OPERATOR = "operator"


def api_key_actor(key_prefix: str | None) -> str:
    return f"api_key:{key_prefix}" if key_prefix else "api_key"


def record(s: Session, tenant_id: str | None, category: str, event: str, actor: str, **details: Any) -> None:
    """Add the event to the session (the caller commits it with the change it describes)."""
    assert category in CATEGORIES, category
    s.add(AuditEvent(tenant_id=tenant_id, category=category, event=event, actor=actor,
                     details={k: v for k, v in details.items() if v is not None}))


def events(s: Session, *, tenant_id: str | None = None, all_tenants: bool = False, category: str | None = None,
           since: datetime | None = None, until: datetime | None = None, limit: int | None = None) -> list[AuditEvent]:
    """Events oldest first: the tenant's (or, with all_tenants, everyone's), of one category, in [since, until)."""
    query = sa.select(AuditEvent).order_by(AuditEvent.created_at, AuditEvent.id)
    if not all_tenants:
        query = query.where(AuditEvent.tenant_id == tenant_id)
    if category is not None:
        query = query.where(AuditEvent.category == category)
    if since is not None:
        query = query.where(AuditEvent.created_at >= since)
    if until is not None:
        query = query.where(AuditEvent.created_at < until)
    if limit is not None:  # the newest `limit`, still answered oldest first
        query = query.order_by(None).order_by(AuditEvent.created_at.desc(), AuditEvent.id.desc()).limit(limit)
        return list(reversed(s.scalars(query).all()))
    return list(s.scalars(query))


def day_window(day: datetime) -> tuple[datetime, datetime]:
    start = day.replace(hour=0, minute=0, second=0, microsecond=0)
    return start, start + timedelta(days=1)
