"""POST sessions/search (the SDK's experimental `RestClient.search_sessions`): the caller's own sessions
that match, newest first, with a cursor to the next page. The matching is db/session_search.py's."""

from __future__ import annotations

import json
from typing import Literal

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException
from pydantic import AwareDatetime, BaseModel, Field, model_validator

from api.deps import DB, CurrentTenant
from api.input_policy import Id, Label, readable
from api.routes.runs import iso
from db import session_search
from db.models import Project, utcnow

router = APIRouter()


class StatusQuery(BaseModel):
    type: Literal["active", "cancelled", "failed", "client_finished"]
    reasons: list[Literal["success", "errored", "interrupted"]] | None = Field(None, min_length=1, max_length=3)


class OwnerQuery(BaseModel):
    type: Literal["own", "accessible", "user"] = "own"
    owner_urns: list[Label] | None = Field(None, min_length=1, max_length=10)

    @model_validator(mode="after")
    def _urns_name_users(self) -> "OwnerQuery":
        if (self.type == "user") != (self.owner_urns is not None):
            raise ValueError("owner_urns: given exactly when type is 'user'")
        return self


class Cursor(BaseModel):
    last_created_at: AwareDatetime
    last_session_id: Id


class SessionSearch(BaseModel):
    session_id: Id | None = None
    project_ids: list[Label] | None = Field(None, max_length=100)
    user_metadata: dict[Label, Label] = Field(default_factory=dict, max_length=64)
    display_name: Label | None = Field(None, min_length=1)
    owner: OwnerQuery = Field(default_factory=OwnerQuery)
    statuses: list[StatusQuery] | None = Field(None, min_length=1, max_length=8)
    limit: int = Field(50, ge=1, le=200)
    cursor: Cursor | None = None


@router.post("/sessions/search")
def search_sessions(body: SessionSearch, tenant: CurrentTenant, db: DB) -> dict:
    for i, status in enumerate(body.statuses or []):
        if status.reasons is not None:
            raise HTTPException(400, f"statuses[{i}].reasons: this server records that a client finished its "
                                     "session, not the reason it gave; ask for client_finished without reasons")
    for key in body.user_metadata:
        if '"' in key or "\\" in key:  # SQLite's JSON paths cannot name such a key: refused on every database
            raise HTTPException(400, f"user_metadata: a key with '\"' or '\\' cannot be searched, got {key[:64]!r}")
    if body.project_ids:
        known = set(db.scalars(sa.select(Project.id).where(Project.tenant_id == tenant.id,
                                                           Project.id.in_(body.project_ids))))
        if missing := [p for p in body.project_ids if p not in known]:
            raise HTTPException(404, f"project_ids: no project {missing[0]!r}")
    # The caller sees its own tenant's sessions only: "accessible" is those, and a user owner matches
    # only when it names the caller (any other name reads as an owner with no sessions).
    if body.owner.type == "user" and tenant.id not in (body.owner.owner_urns or []):
        return {"sessions": [], "next_cursor": None}
    query = session_search.SessionQuery(
        tenant_id=tenant.id, now=utcnow(), session_id=body.session_id, display_name=body.display_name,
        project_ids=body.project_ids, user_metadata=body.user_metadata,
        statuses=[s.type for s in body.statuses] if body.statuses else None, limit=body.limit,
        after=(body.cursor.last_created_at, body.cursor.last_session_id) if body.cursor else None)
    found, more = session_search.search(db, query)
    last = found[-1].session if found and more else None
    return {"sessions": [_summary(f) for f in found],
            "next_cursor": {"last_created_at": iso(last.created_at), "last_session_id": last.id} if last else None}


def _summary(found: session_search.SessionFound) -> dict:
    session = found.session
    metadata = readable(session.user_metadata)
    metadata = metadata if isinstance(metadata, dict) else {}
    name = metadata.get(session_search.DISPLAY_NAME)
    return {
        "session_id": session.id, "created_at": iso(session.created_at), "owner": session.tenant_id,
        "project_id": session.project_id or "",  # empty: in no project
        "status": {"type": found.status} if found.status else None,
        "checkpoints_count": found.checkpoints, "checkpoint_storage_bytes": found.checkpoint_bytes,
        "display_name": name if isinstance(name, str) else None,
        # the SDK reads string values: others as their JSON text
        "user_metadata": {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()},
    }
