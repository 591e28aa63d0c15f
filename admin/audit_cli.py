"""`loraplex-admin audit`: the audit log (db/audit.py) of every tenant, or one's."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import sqlalchemy as sa
import typer

from admin.common import session, tenant_named
from admin.output import JSON_OPTION, show
from db import audit
from db.models import Tenant


def audit_log(
    tenant: str | None = typer.Option(None, help="one tenant's events (default: every tenant's, and operators' own)"),
    category: str | None = typer.Option(None, help=f"one of {', '.join(audit.CATEGORIES)}"),
    day: datetime | None = typer.Option(None, formats=["%Y-%m-%d"], help="one UTC day (default: the newest events)"),
    limit: int = typer.Option(100, min=1, help="the newest this many events"),
    as_json: bool = JSON_OPTION,
) -> None:
    """Who did what to what is stored: projects, copies, checkpoint deletions and publications, tenants,
    keys and quotas. Oldest first."""
    if category is not None and category not in audit.CATEGORIES:
        raise typer.BadParameter(f"one of {', '.join(audit.CATEGORIES)}, got {category!r}", param_hint="--category")
    since, until = audit.day_window(day.replace(tzinfo=UTC)) if day else (None, None)
    with session() as s:
        owner = tenant_named(s, tenant) if tenant else None
        names = {row.id: row.name for row in s.execute(sa.select(Tenant.id, Tenant.name))}
        rows = [{"time": e.created_at, "tenant": names.get(e.tenant_id, ""), "event": e.event, "actor": e.actor,
                 "details": e.details}
                for e in audit.events(s, tenant_id=owner.id if owner else None, all_tenants=owner is None,
                                      category=category, since=since, until=until, limit=limit)]
    show("audit log", rows, ["time", "tenant", "event", "actor", "details"], as_json,
         shown={"details": lambda d: json.dumps(d, sort_keys=True)})
