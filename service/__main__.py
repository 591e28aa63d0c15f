"""`python -m service serve`: the embedded server. Tenants, keys and quotas: `loraplex-admin` (admin/cli.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from service.settings import Settings

app = typer.Typer(no_args_is_help=True, add_completion=False)


@app.callback()
def main() -> None:
    """Loraplex service."""


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


if __name__ == "__main__":
    app()
