"""`loraplex-admin trainers`: what the trainers of the running service hold in memory and on disk."""

from __future__ import annotations

from admin.common import console, session
from admin.output import JSON_OPTION, human_bytes, show
from db.scheduler_beats import trainer_memory

COLUMNS = ["scheduler", "trainer", "budget_bytes", "resident_runs", "resident_bytes", "paged_runs", "paged_bytes",
           "page_ins_last_minute", "mean_page_in_seconds", "page_ins", "page_outs", "prefetch_hits", "prefetch_misses",
           "as_of"]


def trainers(as_json: bool = JSON_OPTION) -> None:
    """Each running trainer's memory budget, the runs it keeps resident and has paged out (and their
    bytes), and its page-ins: in the last minute, with their mean latency, and all, of which those served
    from a state read ahead (prefetch hits) and those read on the cycle's path (misses) (docs/memory.md)."""
    with session() as s:
        rows = trainer_memory(s)
    if not rows and not as_json:
        console.print("no service is running (no scheduler has beaten in the last 10 s)")
        return
    seconds = lambda v: "" if v is None else f"{v * 1000:.1f} ms"  # noqa: E731
    show("trainers", rows, COLUMNS, as_json, shown={"budget_bytes": lambda v: human_bytes(v) if v else "none",
                                                     "resident_bytes": human_bytes, "paged_bytes": human_bytes,
                                                     "mean_page_in_seconds": seconds})
