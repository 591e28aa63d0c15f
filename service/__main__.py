"""Command line: `python -m service serve | create-tenant NAME | issue-key NAME`."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
import typer

from service.settings import Settings

app = typer.Typer(no_args_is_help=True, add_completion=False)


@app.command()
def serve(
    base_model: str = typer.Option(None, help="registry name or local HF folder (default: tiny)"),
    host: str = typer.Option(None), port: int = typer.Option(None),
    data_dir: Path = typer.Option(None, help="SQLite database, checkpoints and adapter state"),
) -> None:
    """Run the embedded server: API + scheduler + trainer in one process."""
    from service.embedded import serve as run

    overrides = {k: v for k, v in dict(base_model=base_model, host=host, port=port, data_dir=data_dir).items() if v}
    run(Settings(**overrides))


def _sessions():
    from db.session import make_engine, make_session_factory, upgrade_to_head

    url = Settings().resolved_database_url
    Settings().data_dir.mkdir(parents=True, exist_ok=True)
    upgrade_to_head(url)
    return make_session_factory(make_engine(url))


@app.command("create-tenant")
def create_tenant_cmd(name: str) -> None:
    """Create a tenant and print its first API key (shown once)."""
    from service.tenants import create_tenant

    with _sessions()() as s:
        _, key = create_tenant(s, name)
    print(key)


@app.command("issue-key")
def issue_key_cmd(name: str) -> None:
    """Issue another API key for an existing tenant (shown once)."""
    from db.models import Tenant
    from service.tenants import issue_key

    with _sessions()() as s:
        tenant = s.scalar(sa.select(Tenant).where(Tenant.name == name))
        if tenant is None:
            raise typer.BadParameter(f"no tenant {name!r}")
        print(issue_key(s, tenant))


if __name__ == "__main__":
    app()
