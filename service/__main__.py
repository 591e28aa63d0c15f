"""`python -m service serve|api|scheduler`. Tenants, keys and quotas: `loraplex-admin` (admin/cli.py).

Every option also reads from the environment (LORAPLEX_*: docs/settings.md lists them all); a flag wins.
"""

from __future__ import annotations

from pathlib import Path

import typer

from service.settings import Settings

app = typer.Typer(no_args_is_help=True, add_completion=False)

BASE_MODEL = typer.Option(None, help="registered model, hub id in the local Hugging Face cache, or HF folder (default: "
                          "tiny); repeat it to serve several side by side")
MODEL_NAME = typer.Option(None, help="the hub id a folder --base-model is advertised under (e.g. Qwen/Qwen3-0.6B); "
                          "with several --base-model, one each in the same order ('' for one that is no folder)")
DATA_DIR = typer.Option(None, help="SQLite database (unless LORAPLEX_DATABASE_URL), checkpoints, adapter state")


def settings(**flags) -> Settings:
    """Settings from the flags given (repeated ones joined by commas, as the environment spells them)."""
    flags = {name: ",".join(value) if isinstance(value, list) else value for name, value in flags.items()}
    return Settings(**{name: value for name, value in flags.items() if value})


def refusing_unservable_models(run):
    """Run `run`; a base model that cannot be served ends the process with its reason, not a traceback."""
    from models.registry import ModelUnavailable

    try:
        run()
    except ModelUnavailable as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


@app.callback()
def main() -> None:
    """Loraplex service."""


@app.command()
def serve(base_model: list[str] = BASE_MODEL, model_name: list[str] = MODEL_NAME, host: str = typer.Option(None),
          port: int = typer.Option(None), data_dir: Path = DATA_DIR) -> None:
    """Run the embedded server: API + scheduler + trainer (+ sampler) in one process."""
    from service.openmp import spin_between_parallel_regions

    server_settings = settings(base_model=base_model, model_name=model_name, host=host, port=port, data_dir=data_dir)
    # before torch loads (Settings does not import it): trainer and sampler share the CPUs
    spin_between_parallel_regions(server_settings.keep_openmp_defaults)
    from service.embedded import serve as run

    refusing_unservable_models(lambda: run(server_settings))


@app.command()
def api(base_model: list[str] = BASE_MODEL, model_name: list[str] = MODEL_NAME, host: str = typer.Option(None),
        port: int = typer.Option(None), data_dir: Path = DATA_DIR) -> None:
    """Run one API replica (distributed mode: needs Redis, a scheduler and Celery workers)."""
    from service.distributed import run_api

    api_settings = settings(base_model=base_model, model_name=model_name, host=host, port=port, data_dir=data_dir)
    refusing_unservable_models(lambda: run_api(api_settings))


@app.command()
def scheduler(base_model: str = BASE_MODEL, model_name: str = MODEL_NAME, data_dir: Path = DATA_DIR) -> None:
    """Run the scheduler (distributed mode: exactly one per base model)."""
    from service.distributed import run_scheduler

    scheduler_settings = settings(base_model=base_model, model_name=model_name, data_dir=data_dir)
    refusing_unservable_models(lambda: run_scheduler(scheduler_settings))


if __name__ == "__main__":
    app()
