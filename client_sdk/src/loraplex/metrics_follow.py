"""A recipe's metrics.jsonl into a run's client metrics, with no change to the recipe: what
`loraplex metrics follow LOG_DIR` runs beside a tinker-cookbook run (or any loop that writes one JSON
object per line with a "step").

tinker-cookbook numbers its iterations from 0, and iteration i's rollouts train the run's (i + 1)-th
optim_step: with the default `step_offset` of 1 a row lands on the dashboard's optimizer-step axis
at the step it fed (docs/dashboard.md). The run is the one the recipe's checkpoints.jsonl names (its
first tinker:// path), unless given. Numbers whose names the server takes (1..128 characters of
`A-Za-z0-9_./:-`) are sent, 64 to a call; anything else (strings, lists, NaN) is left out.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

NAME = re.compile(r"^[A-Za-z0-9_./:-]{1,128}$")
PER_CALL = 64
METRICS, CHECKPOINTS = "metrics.jsonl", "checkpoints.jsonl"


def numbers(row: dict) -> dict[str, float]:
    """A row's metrics the server stores: finite numbers under names it takes ("step" is the axis)."""
    return {name: float(value) for name, value in row.items()
            if name != "step" and NAME.match(name) and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


def run_of(log_dir: Path) -> str | None:
    """The training run a recipe's checkpoints.jsonl names (its first tinker:// path), if it names one yet."""
    path = log_dir / CHECKPOINTS
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line still being written
        for value in entry.values():
            if isinstance(value, str) and value.startswith("tinker://"):
                return value.removeprefix("tinker://").split("/", 1)[0]
    return None


def rows(path: Path, follow: bool, idle: Callable[[], bool], poll_seconds: float = 1.0) -> Iterator[dict]:
    """The file's complete lines as JSON objects, in order; with `follow`, then each new one as it is
    written, until `idle()` says to stop (checked while nothing new comes)."""
    while not path.is_file():
        if not follow or idle():
            return
        time.sleep(poll_seconds)
    with path.open() as file:
        pending = ""
        while True:
            chunk = file.readline()
            if chunk:
                pending += chunk
                if pending.endswith("\n"):
                    line, pending = pending.strip(), ""
                    if line:
                        yield json.loads(line)
                continue
            if not follow or idle():
                return
            time.sleep(poll_seconds)


def send(service, run_id: str, row: dict, step_offset: int) -> int:
    """Store one row's numbers with the run at its step (+ step_offset); how many numbers were sent."""
    values = numbers(row)
    step = row.get("step")
    step = step + step_offset if isinstance(step, int) and not isinstance(step, bool) else None
    names = sorted(values)
    for i in range(0, len(names), PER_CALL):
        batch = {name: values[name] for name in names[i:i + PER_CALL]}
        service.call("POST", f"/training_runs/{quote(run_id, safe=':')}/metrics", {"metrics": batch, "step": step})
    return len(values)
