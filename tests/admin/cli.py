"""`loraplex-admin` run in-process, as the admin tests drive it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from typer.testing import CliRunner

from admin.cli import app


def admin_cli(data_dir: Path) -> Callable[..., str]:
    """Run `loraplex-admin ARGS...` on the database under `data_dir`: its output, asserting that it
    succeeded (or, with `ok=False`, that it failed)."""
    runner = CliRunner()
    env = {"LORAPLEX_DATA_DIR": str(data_dir), "COLUMNS": "200"}

    def run(*args: str, ok: bool = True) -> str:
        result = runner.invoke(app, list(args), env=env)
        assert (result.exit_code == 0) == ok, result.output
        return result.output
    return run


def printed_key(output: str) -> str:
    """The API key in a command's output (other threads of the test process may print too)."""
    return re.findall(r"tml-[A-Za-z0-9_-]{43}", output)[-1]
