"""What the SDK's AdminClient reads (and RestClient's deprecated twins): the audit log, token usage by
kind, checkpoint storage. Each answers the caller's own tenant only (a tenant is the SDK's
organization); operators see every tenant with `loraplex-admin audit` and `loraplex-admin usage`."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Literal

from fastapi import APIRouter, HTTPException

from api.deps import DB, CurrentTenant
from api.input_policy import Label, readable
from db import audit, billing
from db.models import AuditEvent, utcnow

router = APIRouter()


def iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def audit_entry(row: AuditEvent) -> dict:
    """An AuditLogEntry (tinker's types/audit_log_entry.py): the details, who did it among them; the
    deprecated top-level fields filled on checkpoint events, as Tinker does."""
    details = {"actor": row.actor, **(readable(row.details) or {})}
    entry = {"timestamp": iso(row.created_at), "event": row.event, "event_details": details}
    if row.category == "checkpoints":
        entry |= {"model_id": details.get("model_id"), "tinker_path": details.get("tinker_path")}
    return entry


def usage_event(bucket: billing.Bucket, projects: dict[str, str | None]) -> dict:
    """A BillingUsageEvent (tinker's types/billing_usage_response.py); no prices, so no costs."""
    info: dict = {"type": bucket.kind}
    if bucket.kind == "checkpoint":
        info["count"] = bucket.quantity
    else:
        info["token_count"] = bucket.quantity
        if bucket.kind == "sampling_prefill":
            info["cached"] = False  # no prefill cache is billed apart here
    session_id = bucket.owner.session_id
    return {"bucket_start": iso(bucket.start), "bucket_end": iso(bucket.start + timedelta(hours=1)),
            "base_model": bucket.owner.base_model, "session_id": session_id,
            "project_id": projects.get(session_id) if session_id else None, "event_info": info}


def storage_item(group: billing.StorageGroup) -> dict:
    """A CurrentCheckpointStorageUsageItem (tinker's types/current_checkpoint_storage_usage_response.py)."""
    return {"project_id": group.project_id, "checkpoint_count": group.checkpoint_count, "size_bytes": group.size_bytes,
            "size_gigabytes": group.size_bytes / billing.BYTES_PER_GIGABYTE}


@router.get("/audit")
def audit_log(tenant: CurrentTenant, db: DB,
              event_type: Literal["all", "checkpoints", "projects", "teams", "organizations"] = "all",
              day: date | None = None) -> dict:
    """The tenant's events of one UTC day (today by default), oldest first."""
    start, end = audit.day_window(datetime.combine(day or utcnow().date(), datetime.min.time(), UTC))
    rows = audit.events(db, tenant_id=tenant.id, category=None if event_type == "all" else event_type,
                        since=start, until=end)
    return {"entries": [audit_entry(row) for row in rows]}


@router.get("/billing/usage/events")
def billing_usage(tenant: CurrentTenant, db: DB, starting_on: datetime, ending_before: datetime) -> dict:
    since, until = (moment if moment.tzinfo else moment.replace(tzinfo=UTC) for moment in (starting_on, ending_before))
    if problem := billing.window_problem(since, until, utcnow()):
        raise HTTPException(400, problem)
    report = billing.token_usage(db, tenant.id, since, until)
    return {"data": [usage_event(bucket, report.projects) for bucket in report.buckets],
            "sessions": {sid: {"user_metadata": metadata} for sid, metadata in report.session_metadata.items()},
            "cost_data_through": None}


@router.get("/billing/usage/checkpoints/current")
def checkpoint_storage(tenant: CurrentTenant, db: DB, project_id: Label | None = None) -> dict:
    groups = billing.checkpoint_storage(db, tenant.id, project_id)
    return {"effective_rate_usd_per_gigabyte_month": None, "data": [storage_item(group) for group in groups]}
