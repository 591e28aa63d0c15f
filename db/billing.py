"""Usage as the SDK's billing reports shape it: tokens by kind in hourly buckets, and the checkpoint
storage held now, each attributed to a session and its project. Counts only: a self-hosted service
has no prices, so every cost and rate is left empty."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.orm import Session

from contract.kinds import RequestKind
from db.models import Checkpoint, ClientSession, Request, Sampler, TrainingModel

TRAINING_KINDS = (RequestKind.FORWARD, RequestKind.FORWARD_BACKWARD)
SAVE_KINDS = ("save_weights", "save_weights_for_sampler", "save_weights_external")  # RequestKind values
BYTES_PER_GIGABYTE = 10**9  # storage is billed in decimal gigabytes


@dataclass(frozen=True)
class Owner:
    """Whom usage is attributed to: the session of the run or sampler that used it."""

    session_id: str | None
    base_model: str | None


@dataclass
class Bucket:
    start: datetime
    owner: Owner
    kind: str  # "training" | "sampling_prefill" | "sampling_sample" | "checkpoint"
    quantity: int = 0


@dataclass
class UsageReport:
    buckets: list[Bucket]
    projects: dict[str, str | None] = field(default_factory=dict)  # session id -> its project
    session_metadata: dict[str, dict[str, str] | None] = field(default_factory=dict)


def hour(moment: datetime) -> datetime:
    return moment.replace(minute=0, second=0, microsecond=0)


def token_usage(s: Session, tenant_id: str, since: datetime, until: datetime) -> UsageReport:
    """The tenant's usage in [since, until): tokens trained (forward and forward_backward inputs),
    prompt tokens sampled, tokens generated, and checkpoints saved, per hour and session."""
    rows = s.execute(sa.select(Request.created_at, Request.kind, Request.model_id, Request.num_tokens,
                               Request.output_tokens).where(
        Request.tenant_id == tenant_id, Request.created_at >= since, Request.created_at < until,
        Request.kind.in_([*TRAINING_KINDS, RequestKind.SAMPLE, *SAVE_KINDS]))).all()
    owners = _owners(s, {row.model_id for row in rows if row.model_id})
    buckets: dict[tuple, Bucket] = {}

    def add(row, kind: str, quantity: int) -> None:
        owner = owners.get(row.model_id, Owner(None, None))
        key = (hour(row.created_at), owner, kind)
        bucket = buckets.setdefault(key, Bucket(key[0], owner, kind))
        bucket.quantity += quantity

    for row in rows:
        if row.kind in TRAINING_KINDS:
            add(row, "training", row.num_tokens)
        elif row.kind == RequestKind.SAMPLE:
            add(row, "sampling_prefill", row.num_tokens)
            add(row, "sampling_sample", row.output_tokens)
        else:
            add(row, "checkpoint", 1)
    ordered = sorted(buckets.values(), key=lambda b: (b.start, -b.quantity, b.kind, b.owner.session_id or ""))
    sessions = {b.owner.session_id for b in ordered if b.owner.session_id}
    report = UsageReport(ordered)
    for row in s.execute(sa.select(ClientSession.id, ClientSession.project_id, ClientSession.user_metadata)
                         .where(ClientSession.id.in_(sessions))):
        report.projects[row.id] = row.project_id
        report.session_metadata[row.id] = _strings(row.user_metadata)
    return report


def _owners(s: Session, model_ids: set[str]) -> dict[str, Owner]:
    """Runs' and samplers' sessions and base models, by their ids (sample requests name a sampler)."""
    owners = {}
    for table in (TrainingModel, Sampler):
        for row in s.execute(sa.select(table.id, table.session_id, table.base_model).where(table.id.in_(model_ids))):
            owners[row.id] = Owner(row.session_id, row.base_model)
    return owners


def _strings(metadata: dict | None) -> dict[str, str] | None:
    """Session metadata as the report types it (string values): other values in their JSON form."""
    if not metadata:
        return None
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}


@dataclass(frozen=True)
class StorageGroup:
    project_id: str | None
    checkpoint_count: int
    size_bytes: int


def checkpoint_storage(s: Session, tenant_id: str, project_id: str | None = None) -> list[StorageGroup]:
    """The tenant's checkpoints now, counted and summed per project of their run's session (a copy
    counts in its own project, though it shares the source's files)."""
    query = (sa.select(ClientSession.project_id, sa.func.count(Checkpoint.id), sa.func.sum(Checkpoint.size_bytes))
             .select_from(Checkpoint)
             .join(TrainingModel, TrainingModel.id == Checkpoint.model_id)
             .join(ClientSession, ClientSession.id == TrainingModel.session_id)
             .where(Checkpoint.tenant_id == tenant_id).group_by(ClientSession.project_id)
             .order_by(ClientSession.project_id))
    if project_id is not None:
        query = query.where(ClientSession.project_id == project_id)
    return [StorageGroup(project, int(count), int(size or 0)) for project, count, size in s.execute(query)]


def window_problem(since: datetime, until: datetime, now: datetime) -> str | None:
    """Why [since, until) is not a window the report answers (the SDK's documented rules), or None."""
    for name, moment in (("starting_on", since), ("ending_before", until)):
        if moment != hour(moment):
            return f"{name}: must be on a UTC hour boundary, got {moment.isoformat()}"
    if since > now:
        return "starting_on: must not be in the future"
    if until <= since:
        return "ending_before: must be after starting_on"
    if until - since > timedelta(days=14):
        return "ending_before: at most 14 days after starting_on"
    return None
