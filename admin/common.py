"""What every `loraplex-admin` command group shares: the settings, the database, the console."""

from __future__ import annotations

import sqlalchemy as sa
import typer
from rich.console import Console
from sqlalchemy.orm import Session

from db.models import Tenant
from service.settings import Settings

console = Console(emoji=False)  # else ":train:" in model ids prints as an emoji
state: dict = {}  # "settings": set by the app's callback (admin/cli.py)


def settings() -> Settings:
    return state["settings"]


def sessions():
    from db.session import make_engine, make_session_factory, upgrade_to_head

    current = settings()
    current.data_dir.mkdir(parents=True, exist_ok=True)
    url = current.resolved_database_url
    upgrade_to_head(url)
    return make_session_factory(make_engine(url))


def session() -> Session:
    return sessions()()


def tenant_named(s: Session, name: str) -> Tenant:
    tenant = s.scalar(sa.select(Tenant).where(Tenant.name == name))
    if tenant is None:
        raise typer.BadParameter(f"no tenant {name!r}", param_hint="TENANT")
    return tenant


def fail(message: str) -> None:
    console.print(f"[red]{message}[/red]", highlight=False)
    raise typer.Exit(1)
