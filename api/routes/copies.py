"""copy_weights: a checkpoint filed again under another project, sharing its files.

As the SDK documents it: the copy belongs to a new training run (in a new session of the destination
project, or in a session the caller names with a model_seq_id), keeps the source's kind and name,
cannot be trained on, and does not inherit the source's expiry. No bytes are copied; the files are
deleted with the last checkpoint that uses them (db/checkpoints.py). Only the caller's own
checkpoints are copied: another tenant's, published or not, answers 404 as one of nobody's.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Annotated

import sqlalchemy as sa
from fastapi import APIRouter, Header, HTTPException
from pydantic import BaseModel, Field

from api import quotas
from api.deps import DB, CurrentTenant, TenantRef
from api.input_policy import Id, Label, SessionSeq
from api.lookups import owned_session
from api.paths import TinkerPath, model_id
from api.routes.projects import file_under_project
from db import audit
from db.models import Checkpoint, ClientSession, TrainingModel, utcnow

router = APIRouter()
TEN_YEARS = 10 * 365 * 86400
# A retried copy (the SDK sends one X-Idempotency-Key across its retries) finds the session the first made.
_RETRY_NAMESPACE = uuid.UUID("6f1d0c52-3b1e-4d36-9a57-5e0c0e6f7a41")


class CopyWeights(BaseModel):
    source_path: Id
    session_id: Id | None = None
    model_seq_id: SessionSeq | None = None
    destination_project_id: Label | None = None
    ttl_seconds: int | None = Field(None, ge=3600, le=TEN_YEARS)
    weights_access_token: Id | None = None


@router.post("/copy_weights")
def copy_weights(body: CopyWeights, tenant: CurrentTenant, db: DB,
                 x_idempotency_key: Annotated[str | None, Header(max_length=256)] = None,
                 x_tinker_weights_access_token: Annotated[str | None, Header(max_length=256)] = None) -> dict:
    if body.weights_access_token or x_tinker_weights_access_token:
        raise HTTPException(400, "weights_access_token: not supported: copy a checkpoint of your own tenant")
    path = TinkerPath.parse(body.source_path, "source_path")
    source = db.scalar(sa.select(Checkpoint).where(Checkpoint.tinker_path == str(path)))
    if source is None or source.tenant_id != tenant.id:
        raise HTTPException(404, f"source_path: no checkpoint {body.source_path!r}")
    source_run = db.get(TrainingModel, source.model_id)
    if source_run is None:
        raise HTTPException(404, f"source_path: the run of {body.source_path!r} is gone")

    session, seq = _destination(db, tenant, body, x_idempotency_key)
    run_id = model_id(session.id, seq)
    copy_path = TinkerPath(run_id, path.kind, path.name)
    existing = db.get(TrainingModel, run_id)
    if existing is not None:
        if existing.copied_from == str(path):  # the same copy, asked again: the first one's answer
            return {"tinker_path": str(copy_path)}
        raise HTTPException(400, f"model_seq_id: {seq} is already used by run {run_id!r} of that session")
    quotas.check_storage(db, tenant.id)

    db.add(TrainingModel(id=run_id, tenant_id=tenant.id, session_id=session.id, base_model=source_run.base_model,
                         lora_config=source_run.lora_config, user_metadata={}, last_applied_seq_id=-1,
                         copied_from=str(path)))
    db.flush()  # the run first: the checkpoint names it
    now = utcnow()
    db.add(Checkpoint(tenant_id=tenant.id, model_id=run_id, kind=source.kind, name=source.name,
                      tinker_path=str(copy_path), storage_path=source.storage_path, size_bytes=source.size_bytes,
                      user_metadata=source.user_metadata, created_at=now,
                      expires_at=now + timedelta(seconds=body.ttl_seconds) if body.ttl_seconds else None))
    audit.record(db, tenant.id, "checkpoints", "checkpoint_copy", audit.api_key_actor(tenant.key_prefix),
                 model_id=run_id, tinker_path=str(copy_path), source_path=str(path), project_id=session.project_id)
    db.commit()
    return {"tinker_path": str(copy_path)}


def _destination(db: DB, tenant: TenantRef, body: CopyWeights, retry_key: str | None) -> tuple[ClientSession, int]:
    """The session that will own the copy, and the copy's run's seq in it."""
    if body.session_id is not None:
        if body.model_seq_id is None:
            raise HTTPException(400, "model_seq_id: required with session_id")
        return owned_session(db, tenant.id, body.session_id), body.model_seq_id
    if body.destination_project_id is None:
        raise HTTPException(400, "destination_project_id: required (or session_id and model_seq_id)")
    session_id = str(uuid.uuid5(_RETRY_NAMESPACE, f"{tenant.id}/{retry_key}")) if retry_key else None
    session = db.get(ClientSession, session_id) if session_id else None
    if session is not None and session.tenant_id == tenant.id:
        return session, 0
    session = ClientSession(id=session_id or str(uuid.uuid4()), tenant_id=tenant.id, tags=["copy_weights"],
                            user_metadata={}, finished_at=utcnow())
    db.add(session)
    file_under_project(db, tenant, session, body.destination_project_id, "destination_project_id")
    db.flush()
    return session, 0
