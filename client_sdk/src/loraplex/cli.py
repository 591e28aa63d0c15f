"""`loraplex`: the client's console script (the operators' one is loraplex-admin, on the server).

    loraplex tokenizer pull HuggingFaceTB/SmolLM2-135M-Instruct --base-url http://host:8000 --api-key tml-...
"""

from __future__ import annotations

from pathlib import Path

import typer

from loraplex.errors import LoraplexError
from loraplex.tokenizers import pull_tokenizer

app = typer.Typer(help="Loraplex client tools.", no_args_is_help=True, add_completion=False)
tokenizer_app = typer.Typer(help="Base-model tokenizers from the server.", no_args_is_help=True)
app.add_typer(tokenizer_app, name="tokenizer")


@tokenizer_app.command("pull")
def pull(
    model: str = typer.Argument(..., help="hub id or alias of a served base model, "
                                "e.g. HuggingFaceTB/SmolLM2-135M-Instruct"),
    base_url: str | None = typer.Option(None, help="default: LORAPLEX_BASE_URL, else the config file"),
    api_key: str | None = typer.Option(None, help="default: LORAPLEX_API_KEY, else the config file "
                                       "(~/.config/loraplex/config.toml)"),
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
