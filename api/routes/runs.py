"""REST for training runs and their checkpoints (RestClient / CLI), scoped to the caller's tenant."""

from __future__ import annotations

import shutil
import tarfile
import tempfile
from datetime import timedelta
from pathlib import Path

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse
from loraplex.types import Checkpoint as CheckpointJson
from loraplex.types import TrainingRun as TrainingRunJson
from pydantic import BaseModel
from starlette.background import BackgroundTask

from api.deps import DB, CurrentTenant, Limit, Offset
from api.input_policy import Int64, Label, readable
from api.lookups import owned_model
from api.paths import TinkerPath
from api.served_models import served
from db import audit, projects
from db import checkpoints as stored_checkpoints
from db.models import Checkpoint, TrainingModel, utcnow
from db.models import Request as RequestRow
from storage.checkpoint_files import CheckpointError

router = APIRouter()
CHECKPOINT_TYPES = {"training_state": "training", "sampler": "sampler", "external": "external"}


def iso(dt) -> str | None:
    return dt.isoformat().replace("+00:00", "Z") if dt else None


def checkpoint_of(row: Checkpoint) -> CheckpointJson:
    return CheckpointJson(
        checkpoint_id=TinkerPath.parse(row.tinker_path).checkpoint_id,
        checkpoint_type=CHECKPOINT_TYPES.get(row.kind, row.kind), time=iso(row.created_at),
        tinker_path=row.tinker_path, size_bytes=row.size_bytes, public=row.public,
        user_metadata=readable(row.user_metadata), expires_at=iso(row.expires_at),
    )


def checkpoint_json(row: Checkpoint) -> dict:
    return checkpoint_of(row).to_json()


def run_json(db: DB, run: TrainingModel) -> dict:
    def latest(kind: str) -> CheckpointJson | None:
        row = db.scalar(sa.select(Checkpoint).where(Checkpoint.model_id == run.id, Checkpoint.kind == kind)
                        .order_by(Checkpoint.created_at.desc()).limit(1))
        return checkpoint_of(row) if row else None

    last = db.scalar(sa.select(sa.func.max(RequestRow.created_at)).where(RequestRow.model_id == run.id))
    return TrainingRunJson(
        training_run_id=run.id, base_model=run.base_model, model_owner=run.tenant_id, is_lora=True,
        corrupted=False, lora_rank=run.lora_config["rank"], last_request_time=iso(last or run.created_at),
        last_checkpoint=latest("training_state"), last_sampler_checkpoint=latest("sampler"),
        user_metadata=readable(run.user_metadata) or None,  # stored before the input policy: maybe too deep
    ).to_json()


@router.get("/training_runs")
def list_runs(tenant: CurrentTenant, db: DB, limit: Limit = 20, offset: Offset = 0, project_id: Label | None = None) -> dict:
    where = (TrainingModel.tenant_id == tenant.id, TrainingModel.deleted_at.is_(None),
             *([projects.in_project(tenant.id, project_id)] if project_id is not None else []))
    total = db.scalar(sa.select(sa.func.count()).select_from(TrainingModel).where(*where))
    runs = db.scalars(sa.select(TrainingModel).where(*where).order_by(TrainingModel.created_at.desc())
                      .limit(limit).offset(offset)).all()
    return {"training_runs": [run_json(db, r) for r in runs],
            "cursor": {"offset": offset, "limit": limit, "total_count": total}}


@router.get("/training_runs/{run_id}")
def get_run(run_id: str, tenant: CurrentTenant, db: DB) -> dict:
    return run_json(db, owned_model(db, tenant.id, run_id))


def _checkpoints(db: DB, tenant_id: str, run_id: str | None, limit: int, offset: int,
                 project_id: str | None = None) -> dict:
    where = [Checkpoint.tenant_id == tenant_id] + ([Checkpoint.model_id == run_id] if run_id else [])
    if project_id is not None:
        where.append(projects.checkpoints_in_project(tenant_id, project_id))
    total = db.scalar(sa.select(sa.func.count()).select_from(Checkpoint).where(*where))
    rows = db.scalars(sa.select(Checkpoint).where(*where).order_by(Checkpoint.created_at.desc())
                      .limit(limit).offset(offset)).all()
    return {"checkpoints": [checkpoint_json(r) for r in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": total}}


@router.get("/training_runs/{run_id}/checkpoints")
def list_run_checkpoints(run_id: str, tenant: CurrentTenant, db: DB, limit: Limit = 100, offset: Offset = 0) -> dict:
    owned_model(db, tenant.id, run_id)
    return _checkpoints(db, tenant.id, run_id, limit, offset)


@router.get("/checkpoints")
def list_checkpoints(tenant: CurrentTenant, db: DB, limit: Limit = 100, offset: Offset = 0,
                     project_id: Label | None = None) -> dict:
    return _checkpoints(db, tenant.id, None, limit, offset, project_id)


def owned_checkpoint(db: DB, tenant_id: str, run_id: str, checkpoint_id: str) -> Checkpoint:
    path = f"tinker://{run_id}/{checkpoint_id}"
    TinkerPath.parse(path, "checkpoint_id")
    row = db.scalar(sa.select(Checkpoint).where(Checkpoint.tinker_path == path))
    if row is None or row.tenant_id != tenant_id:
        raise HTTPException(404, f"checkpoint_id: no checkpoint {checkpoint_id!r} in run {run_id!r}")
    return row


def _audit(db: DB, tenant, event: str, row: Checkpoint, **details) -> None:
    audit.record(db, tenant.id, "checkpoints", event, audit.api_key_actor(tenant.key_prefix), model_id=row.model_id,
                 tinker_path=row.tinker_path, **details)


@router.post("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
def publish(run_id: str, checkpoint_id: str, tenant: CurrentTenant, db: DB) -> dict:
    """Idempotent: publishing a public checkpoint again succeeds. The SDK retries a 409 (which
    Tinker's docs list for it) for five minutes before it raises."""
    row = owned_checkpoint(db, tenant.id, run_id, checkpoint_id)
    row.public = True
    _audit(db, tenant, "checkpoint_publish", row)
    db.commit()
    return {}


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
def unpublish(run_id: str, checkpoint_id: str, tenant: CurrentTenant, db: DB) -> dict:
    """Idempotent, as publish is."""
    row = owned_checkpoint(db, tenant.id, run_id, checkpoint_id)
    row.public = False
    _audit(db, tenant, "checkpoint_unpublish", row)
    db.commit()
    return {}


class Ttl(BaseModel):
    ttl_seconds: Int64 | None


@router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl")
def set_ttl(run_id: str, checkpoint_id: str, body: Ttl, tenant: CurrentTenant, db: DB) -> dict:
    row = owned_checkpoint(db, tenant.id, run_id, checkpoint_id)
    if body.ttl_seconds is not None and not 3600 <= body.ttl_seconds <= 10 * 365 * 86400:
        raise HTTPException(400, "ttl_seconds: must be between 3600 s and 10 years, or null")
    row.expires_at = utcnow() + timedelta(seconds=body.ttl_seconds) if body.ttl_seconds else None
    _audit(db, tenant, "checkpoint_ttl_set", row, ttl_seconds=body.ttl_seconds)
    db.commit()
    return {}


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/archive")
def archive(run_id: str, checkpoint_id: str, request: Request, tenant: CurrentTenant, db: DB) -> FileResponse:
    """The checkpoint's adapter as a PEFT folder named `adapter`, in a .tar.gz (training states
    are exported to PEFT; the Adam moments stay on the server)."""
    # Converting a training state reads its tensors (torch, peft): loaded on the first download only,
    # so an API replica that serves none stays without torch.
    from storage.peft_export import export_peft

    row = owned_checkpoint(db, tenant.id, run_id, checkpoint_id)
    base = served(request).of_checkpoint(db, row, "run_id")
    work = Path(tempfile.mkdtemp(prefix="loraplex-archive-"))
    adapter = work / "adapter"
    try:
        export_peft(row.storage_path, adapter, base.info.path)
    except (FileNotFoundError, CheckpointError) as e:
        shutil.rmtree(work, ignore_errors=True)
        raise HTTPException(404, f"checkpoint_id: the files of {row.tinker_path!r} are not readable: {e}") from None
    with tarfile.open(work / "adapter.tar.gz", "w:gz") as tar:
        tar.add(adapter, arcname="adapter")
    return FileResponse(work / "adapter.tar.gz", media_type="application/gzip", filename=f"{row.name}.tar.gz",
                        background=BackgroundTask(shutil.rmtree, work, ignore_errors=True))


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
def delete_checkpoint(run_id: str, checkpoint_id: str, tenant: CurrentTenant, db: DB) -> dict:
    row = owned_checkpoint(db, tenant.id, run_id, checkpoint_id)
    stored_checkpoints.delete_checkpoint(db, row)
    _audit(db, tenant, "checkpoint_delete", row)
    db.commit()
    return {}
