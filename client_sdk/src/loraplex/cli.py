"""`loraplex`: the client's console script (the operators' one is loraplex-admin, on the server).

    loraplex tokenizer pull HuggingFaceTB/SmolLM2-135M-Instruct --base-url http://host:8000 --api-key tml-...
    loraplex metrics follow /tmp/math_rl        # a tinker-cookbook run's metrics.jsonl into its dashboard
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

from loraplex import metrics_follow
from loraplex.errors import LoraplexError
from loraplex.tokenizers import pull_tokenizer

app = typer.Typer(help="Loraplex client tools.", no_args_is_help=True, add_completion=False)
tokenizer_app = typer.Typer(help="Base-model tokenizers from the server.", no_args_is_help=True)
app.add_typer(tokenizer_app, name="tokenizer")
metrics_app = typer.Typer(help="A recipe's own metrics, into its run's dashboard.", no_args_is_help=True)
app.add_typer(metrics_app, name="metrics")
BASE_URL = typer.Option(None, help="default: LORAPLEX_BASE_URL, else the config file")
API_KEY = typer.Option(None, help="default: LORAPLEX_API_KEY, else the config file (~/.config/loraplex/config.toml)")


@tokenizer_app.command("pull")
def pull(
    model: str = typer.Argument(..., help="hub id or alias of a served base model, "
                                "e.g. HuggingFaceTB/SmolLM2-135M-Instruct"),
    base_url: str | None = BASE_URL,
    api_key: str | None = API_KEY,
    cache_dir: Path | None = typer.Option(None, help="Hugging Face hub cache (default: HF_HUB_CACHE, else HF_HOME/hub)"),
) -> None:
    """Put MODEL's tokenizer into the local Hugging Face cache, so that with HF_HUB_OFFLINE=1
    AutoTokenizer.from_pretrained(hub id), tinker's get_tokenizer() and tinker-cookbook load it."""
    try:
        pulled = pull_tokenizer(base_url, api_key, model, hub_cache=cache_dir)
    except (LoraplexError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{pulled.model} (revision {pulled.revision}): {len(pulled.downloaded)} files downloaded, "
               f"{len(pulled.reused)} already cached")
    typer.echo(f"  {pulled.path}")
    typer.echo(f"  load it offline: HF_HUB_OFFLINE=1, AutoTokenizer.from_pretrained({pulled.model!r})")


@metrics_app.command("follow")
def follow(
    log_dir: Path = typer.Argument(..., help="the recipe's log_path (its metrics.jsonl and checkpoints.jsonl)"),
    run: str | None = typer.Option(None, help="the training run (default: the one LOG_DIR/checkpoints.jsonl names)"),
    step_offset: int = typer.Option(1, help="added to each row's step: tinker-cookbook's iteration i feeds the "
                                    "run's (i + 1)-th optim_step"),
    once: bool = typer.Option(False, help="send the rows there now, then stop"),
    idle_seconds: float = typer.Option(600.0, help="stop after this long with no new row (0: never)"),
    base_url: str | None = BASE_URL,
    api_key: str | None = API_KEY,
) -> None:
    """Send a recipe's metrics.jsonl rows (rewards, evals, whatever it logs) to its run as client metrics,
    as they are written: tinker-cookbook's recipes show on the dashboard beside the service's own
    numbers, with no change to the recipe."""
    from loraplex.service_client import ServiceClient

    last_row = [time.monotonic()]

    def idle() -> bool:
        return bool(idle_seconds) and time.monotonic() - last_row[0] > idle_seconds

    while run is None and (run := metrics_follow.run_of(log_dir)) is None:
        if once or idle():
            typer.echo(f"error: {log_dir / metrics_follow.CHECKPOINTS} names no run yet: give --run", err=True)
            raise typer.Exit(1)
        time.sleep(1.0)
    try:
        service = ServiceClient(base_url=base_url, api_key=api_key, user_metadata={"loraplex": "metrics follow"})
        sent = rows_sent = 0
        for row in metrics_follow.rows(log_dir / metrics_follow.METRICS, follow=not once, idle=idle):
            sent += metrics_follow.send(service, run, row, step_offset)
            rows_sent += 1
            last_row[0] = time.monotonic()
    except (LoraplexError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{rows_sent} rows, {sent} numbers sent to run {run}")
