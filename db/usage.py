"""What a tenant uses: the numbers quotas are checked against and the admin CLI reports."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.orm import Session

from contract.kinds import RequestKind
from db.models import Checkpoint, Request, RequestState, TrainingModel, utcnow

TRAINING_KINDS = (RequestKind.FORWARD, RequestKind.FORWARD_BACKWARD)


def tokens_trained(s: Session, tenant_id: str, since: datetime) -> int:
    """Input tokens of the forward / forward_backward requests accepted since `since` (failed ones too:
    they were accepted, and most fail only after running)."""
    return int(s.scalar(sa.select(sa.func.coalesce(sa.func.sum(Request.num_tokens), 0)).where(
        Request.tenant_id == tenant_id, Request.kind.in_(TRAINING_KINDS), Request.created_at >= since)))


def tokens_sampled(s: Session, tenant_id: str, since: datetime) -> int:
    """Prompt plus generated tokens of the sample requests accepted since `since`."""
    total = sa.func.coalesce(sa.func.sum(Request.num_tokens + Request.output_tokens), 0)
    return int(s.scalar(sa.select(total).where(
        Request.tenant_id == tenant_id, Request.kind == RequestKind.SAMPLE, Request.created_at >= since)))


def storage_bytes(s: Session, tenant_id: str) -> int:
    return int(s.scalar(sa.select(sa.func.coalesce(sa.func.sum(Checkpoint.size_bytes), 0))
                        .where(Checkpoint.tenant_id == tenant_id)))


def live_models(s: Session, tenant_id: str) -> int:
    return int(s.scalar(sa.select(sa.func.count()).select_from(TrainingModel).where(
        TrainingModel.tenant_id == tenant_id, TrainingModel.deleted_at.is_(None),
        TrainingModel.copied_from.is_(None))))  # a run holding a copy is never trained: no live model


def requests_in_flight(s: Session, tenant_id: str) -> int:
    return int(s.scalar(sa.select(sa.func.count()).select_from(Request).where(
        Request.tenant_id == tenant_id, Request.state.in_([RequestState.PENDING, RequestState.RUNNING]))))


def day_start(now: datetime | None = None) -> datetime:
    """Daily quotas count from 00:00 UTC."""
    now = now or utcnow()
    return now.replace(hour=0, minute=0, second=0, microsecond=0)


@dataclass(frozen=True)
class Usage:
    tokens_trained: int
    tokens_sampled: int
    storage_bytes: int
    live_models: int
    requests_in_flight: int


def usage(s: Session, tenant_id: str, days: int = 1) -> Usage:
    """Tokens over the last `days` days (counted from today's 00:00 UTC), storage and models now."""
    since = day_start() - timedelta(days=days - 1)
    return Usage(tokens_trained(s, tenant_id, since), tokens_sampled(s, tenant_id, since),
                 storage_bytes(s, tenant_id), live_models(s, tenant_id), requests_in_flight(s, tenant_id))
