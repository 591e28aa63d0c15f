"""`loraplex-admin projects list | create`: tenants' projects (db/projects.py) and what is filed under them."""

from __future__ import annotations

import sqlalchemy as sa
import typer

from admin.common import console, session, tenant_named
from admin.output import JSON_OPTION, human_bytes, show
from db import audit, projects
from db.models import Tenant

projects_app = typer.Typer(no_args_is_help=True, help="list, create: tenants' projects (the SDK's project_id)")


@projects_app.command("list")
def projects_list(tenant: str | None = typer.Argument(None), as_json: bool = JSON_OPTION) -> None:
    """Every project (of TENANT, or of all), with its sessions, runs and checkpoints."""
    with session() as s:
        owner = tenant_named(s, tenant) if tenant else None
        names = {row.id: row.name for row in s.execute(sa.select(Tenant.id, Tenant.name))}
        rows = [{"tenant": names[p.tenant_id], "project": p.name, "created": p.created_at, "sessions": p.sessions,
                 "runs": p.runs, "checkpoints": p.checkpoints, "checkpoint_bytes": p.checkpoint_bytes}
                for p in projects.summaries(s, owner.id if owner else None)]
    show("projects", rows, ["tenant", "project", "created", "sessions", "runs", "checkpoints", "checkpoint_bytes"],
         as_json, shown={"checkpoint_bytes": human_bytes})


@projects_app.command("create")
def projects_create(tenant: str, name: str) -> None:
    """Make TENANT's project NAME ahead of use (the SDK makes one on first use too)."""
    with session() as s:
        owner = tenant_named(s, tenant)
        if problem := projects.name_problem(name):
            raise typer.BadParameter(problem, param_hint="NAME")
        made = projects.ensure(s, owner.id, name)
        if made:
            audit.record(s, owner.id, "projects", "project_create", audit.OPERATOR, project_id=name)
        s.commit()
    console.print(f"project {name!r} of tenant {tenant!r} {'created' if made else 'exists already'}", highlight=False)
