"""How `loraplex-admin` shows what it lists: a table as wide as its cells (ids and `tinker://` paths
are copied from it, so nothing is cut, on a narrow terminal or in a pipe alike), or with `--json`
one JSON array of objects, raw values (byte counts as integers, times in ISO 8601) for scripts."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from admin.common import console

JSON_OPTION = typer.Option(False, "--json", help="one JSON array of objects instead of a table")
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(size: int | None) -> str:
    """1536 -> '1.5 KiB' (binary units, as the settings' limits are stated)."""
    if size is None:
        return ""
    value, unit = float(size), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{size} B" if unit == 0 else f"{value:.1f} {_UNITS[unit]}"


def show(title: str, rows: list[dict[str, Any]], columns: list[str], as_json: bool = False,
         shown: dict[str, Callable[[Any], str]] | None = None) -> None:
    """`rows` keyed by `columns` (snake_case: the JSON keys; the table's headers with spaces). `shown`
    formats a column's cells in the table only (e.g. human_bytes); JSON keeps the raw values."""
    if as_json:
        print(json.dumps([{c: _plain(row.get(c)) for c in columns} for row in rows]))
        return
    shown = shown or {}
    table = Table(title=title)
    for column in columns:
        table.add_column(column.replace("_", " "), no_wrap=True)
    for row in rows:
        table.add_row(*[_cell(row.get(c), shown.get(c)) for c in columns])
    unbounded = console.options.update(width=10**6, max_width=10**6)
    width = Measurement.get(console, unbounded, table).maximum
    Console(emoji=False, width=max(width, len(title)), highlight=False).print(table)


def _cell(value: Any, fmt: Callable[[Any], str] | None) -> str:
    if fmt is not None:
        return fmt(value)
    plain = _plain(value)
    return "" if plain is None else str(plain)


def _plain(value: Any) -> Any:
    return value.isoformat(timespec="seconds") if hasattr(value, "isoformat") else value
