"""Projects: a tenant's names for groups of sessions (the SDK's `project_id`).

A project exists once it is named: by a session created with it, a session moved into it, a
copy_weights into it, or `loraplex-admin projects create`. A session's runs, samplers and
checkpoints are in its session's project. Names are the tenant's own: the (tenant, name) key and
the sessions' foreign key on it keep one tenant's sessions out of another's projects.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from db.models import Checkpoint, ClientSession, Project, TrainingModel, utcnow

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,255}$")
NAME_RULE = "1-256 letters, digits, '.', '_', ':' and '-', starting with a letter or digit"


def name_problem(name: str) -> str | None:
    """Why `name` cannot name a project, or None."""
    return None if _NAME.match(name) else f"a project name is {NAME_RULE}, got {name[:64]!r}"


def ensure(s: Session, tenant_id: str, name: str) -> bool:
    """Make the tenant's project `name` unless it exists; True when this call made it. Safe against a
    concurrent first use of the same name (the insert does nothing when the key exists)."""
    if problem := name_problem(name):
        raise ValueError(problem)
    dialect = postgresql if s.get_bind().dialect.name == "postgresql" else sqlite
    insert = dialect.insert(Project).values(tenant_id=tenant_id, id=name, created_at=utcnow())
    return bool(s.execute(insert.on_conflict_do_nothing(index_elements=["tenant_id", "id"])).rowcount)


def in_project(tenant_id: str, name: str) -> sa.ColumnElement[bool]:
    """A filter for TrainingModel rows: the runs whose session is in the tenant's project `name`."""
    return TrainingModel.session_id.in_(
        sa.select(ClientSession.id).where(ClientSession.tenant_id == tenant_id, ClientSession.project_id == name))


def checkpoints_in_project(tenant_id: str, name: str) -> sa.ColumnElement[bool]:
    """A filter for Checkpoint rows: the checkpoints of runs in the tenant's project `name`."""
    return Checkpoint.model_id.in_(sa.select(TrainingModel.id).where(in_project(tenant_id, name)))


@dataclass(frozen=True)
class ProjectSummary:
    tenant_id: str
    name: str
    created_at: datetime
    sessions: int
    runs: int
    checkpoints: int
    checkpoint_bytes: int


def summaries(s: Session, tenant_id: str | None = None) -> list[ProjectSummary]:
    """Every project (of one tenant, or of all), oldest first, with what is filed under it."""
    query = sa.select(Project).order_by(Project.created_at, Project.id)
    if tenant_id is not None:
        query = query.where(Project.tenant_id == tenant_id)
    out = []
    for project in s.scalars(query):
        sessions = sa.select(ClientSession.id).where(ClientSession.tenant_id == project.tenant_id,
                                                     ClientSession.project_id == project.id)
        runs = sa.select(TrainingModel.id).where(TrainingModel.session_id.in_(sessions))
        checkpoints = sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(Checkpoint.size_bytes), 0)) \
            .where(Checkpoint.model_id.in_(runs))
        count, size = s.execute(checkpoints).one()
        out.append(ProjectSummary(
            project.tenant_id, project.id, project.created_at,
            s.scalar(sa.select(sa.func.count()).select_from(sessions.subquery())),
            s.scalar(sa.select(sa.func.count()).select_from(runs.subquery())), int(count), int(size)))
    return out
