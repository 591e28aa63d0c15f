"""Projects (db/projects.py): moving a session into one. A session is filed under a project when it
is created with the SDK's project_id; `assign_session_project` moves it (and so its runs, samplers and
checkpoints) into another. Out of every project is not a place a session can be moved back to."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel

from api.deps import DB, CurrentTenant
from api.input_policy import Label
from api.lookups import owned_session
from db import audit, projects
from db.models import ClientSession

router = APIRouter()


class SessionProject(BaseModel):
    project_id: Label


def file_under_project(db: DB, tenant, session: ClientSession, name: str, field: str = "project_id") -> None:
    """Put `session` in the tenant's project `name`, making the project on first use (audited)."""
    if problem := projects.name_problem(name):
        raise HTTPException(400, f"{field}: {problem}")
    actor = audit.api_key_actor(tenant.key_prefix)
    if projects.ensure(db, tenant.id, name):
        audit.record(db, tenant.id, "projects", "project_create", actor, project_id=name)
    if session.project_id != name:
        previous, session.project_id = session.project_id, name
        audit.record(db, tenant.id, "projects", "session_project_set", actor, session_id=session.id,
                     project_id=name, previous_project_id=previous)


@router.put("/sessions/{session_id}/project")
def assign_session_project(session_id: str, body: SessionProject, tenant: CurrentTenant, db: DB) -> dict:
    session = owned_session(db, tenant.id, session_id)
    file_under_project(db, tenant, session, body.project_id)
    db.commit()
    return {}
