"""Client sessions: create, heartbeat, finish, get, list."""

from __future__ import annotations

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field

from api.deps import DB, CurrentTenant, Limit, Offset
from api.input_policy import Id, Label, Metadata, Tags, metadata_problem, readable
from api.lookups import owned_session
from api.routes.projects import file_under_project
from db.models import ClientSession, Sampler, TrainingModel, utcnow

router = APIRouter()


class CreateSession(BaseModel):
    """Every stored field bounded (api/input_policy.py); display_name is kept in user_metadata."""

    tags: Tags = Field(default_factory=list)
    user_metadata: Metadata = Field(default_factory=dict)
    sdk_version: Label | None = None
    project_id: Label | None = None  # made on first use (api/routes/projects.py)
    display_name: Label | None = None


class SessionRef(BaseModel):
    session_id: Id


@router.post("/create_session")
def create_session(body: CreateSession, tenant: CurrentTenant, db: DB) -> dict:
    metadata = dict(body.user_metadata)
    if body.display_name:
        metadata.setdefault("display_name", body.display_name)
        if (problem := metadata_problem(metadata)) is not None:  # the name added to what was just in bounds
            raise HTTPException(422, f"display_name: with user_metadata, {problem}")
    row = ClientSession(tenant_id=tenant.id, tags=body.tags, user_metadata=metadata, sdk_version=body.sdk_version)
    db.add(row)
    if body.project_id:
        file_under_project(db, tenant, row, body.project_id)
    db.commit()
    return {"type": "create_session", "session_id": row.id}


@router.post("/session_heartbeat")
def heartbeat(body: SessionRef, tenant: CurrentTenant, db: DB) -> dict:
    row = owned_session(db, tenant.id, body.session_id)
    if row.finished_at is not None:
        raise HTTPException(410, "session finished")
    row.last_heartbeat_at = utcnow()
    db.commit()
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
def finish(session_id: str, tenant: CurrentTenant, db: DB) -> dict:
    row = owned_session(db, tenant.id, session_id)
    row.finished_at = row.finished_at or utcnow()
    db.commit()
    return {}


@router.get("/sessions/{session_id}")
def get_session(session_id: str, tenant: CurrentTenant, db: DB) -> dict:
    row = owned_session(db, tenant.id, session_id)
    runs = db.scalars(sa.select(TrainingModel.id).where(TrainingModel.session_id == row.id)).all()
    samplers = db.scalars(sa.select(Sampler.id).where(Sampler.session_id == row.id)).all()
    metadata = readable(row.user_metadata)  # stored before the input policy, it may be too deep to answer
    name = metadata.get("display_name") if isinstance(metadata, dict) else None
    name = name if isinstance(name, str) else None  # the SDK reads a string or null
    return {"training_run_ids": list(runs), "sampler_ids": list(samplers), "user_metadata": metadata,
            "display_name": name}


@router.get("/sessions")
def list_sessions(tenant: CurrentTenant, db: DB, limit: Limit = 20, offset: Offset = 0) -> dict:
    ids = db.scalars(
        sa.select(ClientSession.id).where(ClientSession.tenant_id == tenant.id)
        .order_by(ClientSession.created_at.desc()).limit(limit).offset(offset)
    ).all()
    return {"sessions": list(ids)}
