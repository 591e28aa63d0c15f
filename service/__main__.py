"""`python -m service serve|api|scheduler`. Tenants, keys and quotas: `loraplex-admin` (admin/cli.py).

Every option also reads from the environment (LORAPLEX_*: docs/settings.md lists them all); a flag wins.
"""

from __future__ import annotations

from pathlib import Path

import typer

from service.settings import Settings

app = typer.Typer(no_args_is_help=True, add_completion=False)

BASE_MODEL = typer.Option(None, help="registry name or local HF folder (default: tiny)")
DATA_DIR = typer.Option(None, help="SQLite database (unless LORAPLEX_DATABASE_URL), checkpoints, adapter state")


def settings(**flags) -> Settings:
    return Settings(**{name: value for name, value in flags.items() if value})


@app.callback()
def main() -> None:
    """Loraplex service."""


@app.command()
def serve(base_model: str = BASE_MODEL, host: str = typer.Option(None), port: int = typer.Option(None),
          data_dir: Path = DATA_DIR) -> None:
    """Run the embedded server: API + scheduler + trainer (+ sampler) in one process."""
    from service.openmp import spin_between_parallel_regions

    server_settings = settings(base_model=base_model, host=host, port=port, data_dir=data_dir)
    # before torch loads (Settings does not import it): trainer and sampler share the CPUs
    spin_between_parallel_regions(server_settings.keep_openmp_defaults)
    from service.embedded import serve as run

    run(server_settings)


@app.command()
def api(base_model: str = BASE_MODEL, host: str = typer.Option(None), port: int = typer.Option(None),
        data_dir: Path = DATA_DIR) -> None:
    """Run one API replica (distributed mode: needs Redis, a scheduler and Celery workers)."""
    from service.distributed import run_api

    run_api(settings(base_model=base_model, host=host, port=port, data_dir=data_dir))


@app.command()
def scheduler(base_model: str = BASE_MODEL, data_dir: Path = DATA_DIR) -> None:
    """Run the scheduler (distributed mode: exactly one per base model)."""
    from service.distributed import run_scheduler

    run_scheduler(settings(base_model=base_model, data_dir=data_dir))


if __name__ == "__main__":
    app()
