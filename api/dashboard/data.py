"""The dashboard's JSON API under /dashboard/api (docs/dashboard.md): runs, their metric series and
requests, usage, and the operator's overview. A tenant sees only its own runs (another tenant's run
is a 404, as one that does not exist); the operator sees every tenant's, read-only."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Literal

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException, Query
from sqlalchemy.orm import Session

from api.dashboard.auth import AdminViewer, CurrentViewer, Viewer
from api.deps import DB
from api.input_policy import readable
from api.optimizers import run_optimizer
from api.routes.runs import iso
from contract.kinds import RequestKind
from db import run_metrics, usage
from db.models import QUOTA_FIELDS, Checkpoint, CheckpointKind, ClientSession, Quota, Request, RequestState, Sampler, Tenant
from db.models import TrainingModel
from db.models import utcnow
from db.scheduler_beats import trainer_memory
from db.usage import TRAINING_KINDS, day_start

router = APIRouter(prefix="/dashboard/api")

Step = Annotated[int, Query(ge=-1, le=2**31 - 1)]


def visible_run(db: Session, viewer: Viewer, run_id: str) -> TrainingModel:
    """The run if the viewer may see it (its tenant, or the operator); 404 otherwise."""
    row = db.get(TrainingModel, run_id)
    if row is None or not (viewer.is_admin or row.tenant_id == viewer.tenant_id):
        raise HTTPException(404, f"run_id: no run {run_id[:200]!r}")
    return row


def sampler_ids_of(run_id: str):
    """The samplers made from the run's sampler snapshots (a subquery)."""
    snapshots = sa.select(Checkpoint.storage_path).where(Checkpoint.model_id == run_id,
                                                         Checkpoint.kind == CheckpointKind.SAMPLER)
    return sa.select(Sampler.id).where(Sampler.adapter_path.in_(snapshots))


def checkpoint_json(row: Checkpoint) -> dict:
    return {"tinker_path": row.tinker_path, "checkpoint_id": row.tinker_path.split("/", 3)[-1], "kind": row.kind,
            "name": row.name, "size_bytes": row.size_bytes, "public": row.public, "ephemeral": row.ephemeral,
            "created_at": iso(row.created_at), "expires_at": iso(row.expires_at)}


NAME_KEYS = ("name", "display_name", "run_name")  # where SDKs and recipes put a run's name


def run_name(run: TrainingModel, session: ClientSession | None) -> str | None:
    """A run's human name: its own user_metadata's, else its session's display_name (the tinker SDK's
    `display_name`, tinker-cookbook's session name); None if neither says one."""
    for metadata in (run.user_metadata, session.user_metadata if session is not None else None):
        for key in NAME_KEYS:
            value = (metadata or {}).get(key) if isinstance(metadata, dict) else None
            if isinstance(value, str) and value.strip():
                return readable(value)
    return None


def run_json(db: Session, run: TrainingModel, tenant_name: str) -> dict:
    session = db.get(ClientSession, run.session_id)
    counts = dict(db.execute(sa.select(Request.state, sa.func.count()).where(Request.model_id == run.id)
                             .group_by(Request.state)).all())
    last = db.execute(sa.select(sa.func.max(Request.created_at), sa.func.max(Request.finished_at))
                      .where(Request.model_id == run.id)).one()
    active = counts.get(RequestState.PENDING, 0) + counts.get(RequestState.RUNNING, 0)
    checkpoints = db.scalars(sa.select(Checkpoint).where(Checkpoint.model_id == run.id)
                             .order_by(Checkpoint.created_at.desc())).all()
    config = run.lora_config or {}
    return {
        "run_id": run.id, "name": run_name(run, session), "tenant_id": run.tenant_id, "tenant_name": tenant_name,
        "base_model": run.base_model, "lora_rank": config.get("rank"),
        "lora_config": {k: config.get(k) for k in ("rank", "alpha", "train_attn", "train_mlp", "train_unembed")},
        "learning_rate": run_metrics.last_learning_rate(db, run.id), "optimizer": run_optimizer(db, run.id),
        "user_metadata": readable(run.user_metadata) or {},
        "tags": readable(session.tags) if session is not None and isinstance(session.tags, list) else [],
        "status": "deleted" if run.deleted_at else ("running" if active else "idle"),
        "steps": run_metrics.current_step(db, run.id), "created_at": iso(run.created_at),
        "last_activity": iso(max([t for t in last if t is not None], default=run.created_at)),
        "requests": {"pending": active, "failed": counts.get(RequestState.FAILED, 0)},
        "checkpoints": [checkpoint_json(c) for c in checkpoints],
    }


def _tenant_names(db: Session) -> dict[str, str]:
    return dict(db.execute(sa.select(Tenant.id, Tenant.name)).all())


@router.get("/me")
def me(viewer: CurrentViewer) -> dict:
    return {"viewer": viewer.to_json()}


@router.get("/runs")
def list_runs(viewer: CurrentViewer, db: DB, include_deleted: bool = False,
              tenant: Annotated[str | None, Query(max_length=200)] = None) -> dict:
    query = sa.select(TrainingModel).order_by(TrainingModel.created_at.desc()).limit(500)
    if not viewer.is_admin:
        query = query.where(TrainingModel.tenant_id == viewer.tenant_id)
    elif tenant:
        query = query.where(TrainingModel.tenant_id == tenant)
    if not include_deleted:
        query = query.where(TrainingModel.deleted_at.is_(None))
    names = _tenant_names(db)
    return {"runs": [run_json(db, run, names.get(run.tenant_id, "")) for run in db.scalars(query)]}


@router.get("/runs/{run_id}")
def get_run(run_id: str, viewer: CurrentViewer, db: DB) -> dict:
    run = visible_run(db, viewer, run_id)
    return run_json(db, run, _tenant_names(db).get(run.tenant_id, ""))


@router.get("/runs/{run_id}/metrics")
def run_series(run_id: str, viewer: CurrentViewer, db: DB, since: Step = -1) -> dict:
    visible_run(db, viewer, run_id)
    return {"run_id": run_id, **run_metrics.series(db, run_id, since)}


def _request_json(row: Request) -> dict:
    sample = row.kind == RequestKind.SAMPLE
    queue = None if sample else run_metrics.seconds_between(row.started_at, row.created_at)
    compute = run_metrics.seconds_between(row.finished_at, row.created_at if sample else row.started_at)
    error = row.error or {}
    return {"request_id": row.id, "kind": row.kind, "seq_id": row.seq_id, "state": row.state,
            "num_tokens": row.num_tokens, "output_tokens": row.output_tokens, "created_at": iso(row.created_at),
            "started_at": iso(row.started_at), "finished_at": iso(row.finished_at), "queue_seconds": queue,
            "compute_seconds": compute, "error": error.get("error"), "error_category": error.get("category")}


@router.get("/runs/{run_id}/requests")
def run_requests(run_id: str, viewer: CurrentViewer, db: DB,
                 state: Literal["pending", "running", "done", "failed"] | None = None,
                 limit: Annotated[int, Query(ge=1, le=500)] = 50) -> dict:
    run = visible_run(db, viewer, run_id)
    columns = [c for c in Request.__table__.c if c.name not in ("payload", "result")]  # not the bodies
    query = (sa.select(*columns).where(Request.tenant_id == run.tenant_id,
                                       sa.or_(Request.model_id == run_id, Request.model_id.in_(sampler_ids_of(run_id))))
             .order_by(Request.created_at.desc()).limit(limit))
    if state:
        query = query.where(Request.state == state)
    return {"requests": [_request_json(row) for row in db.execute(query)]}


@router.get("/usage")
def tokens_per_day(viewer: CurrentViewer, db: DB, days: Annotated[int, Query(ge=1, le=366)] = 14,
                   tenant: Annotated[str | None, Query(max_length=200)] = None) -> dict:
    """Tokens per UTC day and base model (the day of acceptance)."""
    since = day_start() - timedelta(days=days - 1)
    scope = [Request.created_at >= since]
    if not viewer.is_admin:
        scope.append(Request.tenant_id == viewer.tenant_id)
    elif tenant:
        scope.append(Request.tenant_id == tenant)
    day = sa.func.date(Request.created_at)
    trained = db.execute(sa.select(day, TrainingModel.base_model, sa.func.sum(Request.num_tokens))
                         .join(TrainingModel, TrainingModel.id == Request.model_id)
                         .where(*scope, Request.kind.in_(TRAINING_KINDS)).group_by(day, TrainingModel.base_model))
    sampled = db.execute(sa.select(day, Sampler.base_model, sa.func.sum(Request.num_tokens + Request.output_tokens))
                         .outerjoin(Sampler, Sampler.id == Request.model_id)
                         .where(*scope, Request.kind == RequestKind.SAMPLE).group_by(day, Sampler.base_model))
    rows: dict[tuple[str, str], dict] = {}
    for key, rows_of in (("tokens_trained", trained), ("tokens_sampled", sampled)):
        for date, base_model, tokens in rows_of:
            entry = rows.setdefault((str(date), base_model or "(unknown)"), {
                "date": str(date), "base_model": base_model or "(unknown)", "tokens_trained": 0, "tokens_sampled": 0})
            entry[key] += int(tokens or 0)
    return {"days": [rows[k] for k in sorted(rows)]}


def _share(used: int, limit: int | None) -> float | None:
    return used / limit if limit else None


@router.get("/admin/overview")
def admin_overview(viewer: AdminViewer, db: DB) -> dict:
    quotas = {q.tenant_id: q for q in db.scalars(sa.select(Quota))}
    states = {(t, s): n for t, s, n in db.execute(sa.select(Request.tenant_id, Request.state, sa.func.count())
                                                  .where(Request.state.in_([RequestState.PENDING, RequestState.RUNNING]))
                                                  .group_by(Request.tenant_id, Request.state))}
    tenants = []
    for tenant in db.scalars(sa.select(Tenant).order_by(Tenant.name)):
        used = usage.usage(db, tenant.id)
        quota = quotas.get(tenant.id)
        limits = {f: getattr(quota, f) if quota else None for f in QUOTA_FIELDS}
        tenants.append({
            "tenant_id": tenant.id, "name": tenant.name, "disabled": tenant.disabled, "live_models": used.live_models,
            "requests": {"pending": states.get((tenant.id, RequestState.PENDING), 0),
                         "running": states.get((tenant.id, RequestState.RUNNING), 0)},
            "tokens_trained_today": used.tokens_trained, "tokens_sampled_today": used.tokens_sampled,
            "storage_bytes": used.storage_bytes, "quota": limits,
            "quota_use": {"live_models": _share(used.live_models, limits["max_live_models"]),
                          "train_tokens_per_day": _share(used.tokens_trained, limits["train_tokens_per_day"]),
                          "sample_tokens_per_day": _share(used.tokens_sampled, limits["sample_tokens_per_day"]),
                          "checkpoint_bytes": _share(used.storage_bytes, limits["max_checkpoint_bytes"])},
        })
    # a cycle: the forward/forward_backward requests the scheduler started together (one started_at)
    cycles = db.execute(sa.select(Request.started_at, sa.func.count(), sa.func.count(sa.distinct(Request.tenant_id)),
                                  sa.func.sum(Request.num_tokens))
                        .where(Request.kind.in_(TRAINING_KINDS), Request.started_at.is_not(None))
                        .group_by(Request.started_at).order_by(Request.started_at.desc()).limit(100))
    pending = db.execute(sa.select(sa.func.count(), sa.func.min(Request.created_at)).where(
        Request.kind == RequestKind.SAMPLE, Request.state == RequestState.PENDING)).one()
    trainers = [dict(row, as_of=iso(row["as_of"])) for row in trainer_memory(db)]
    return {
        "tenants": tenants,
        "trainers": trainers,
        "cycles": [{"started_at": iso(at), "requests": n, "tenants": t, "tokens": int(tokens or 0)}
                   for at, n, t, tokens in cycles],
        "sampler": {"pending": pending[0],
                    "oldest_pending_seconds": run_metrics.seconds_between(utcnow(), pending[1]) if pending[1] else None},
    }
