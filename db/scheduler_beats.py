"""Reading the running schedulers' rows (scheduler/liveness.py writes them): whether a service runs, for
tools that must not act behind its back, and what the trainers it feeds hold in memory, for operators
(`loraplex-admin trainers`, the operator dashboard)."""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.orm import Session

from contract.residency import ResidencyStats
from db.models import SchedulerBeat, utcnow

STALE_SECONDS = 10.0  # several missed beats: the process is gone (or stalled past any use)


def live_schedulers(s: Session) -> list[SchedulerBeat]:
    """The schedulers that beat within STALE_SECONDS (stale rows are deleted on the way)."""
    cutoff = utcnow() - timedelta(seconds=STALE_SECONDS)
    s.execute(sa.delete(SchedulerBeat).where(SchedulerBeat.beat_at < cutoff))
    s.commit()
    return list(s.scalars(sa.select(SchedulerBeat).order_by(SchedulerBeat.started_at)))


def trainer_memory(s: Session) -> list[dict]:
    """One row per trainer of every live scheduler: its memory budget, the runs and bytes in memory and
    paged out to disk, and its page-ins (all, and in the last minute with their mean latency; those served
    from a state read ahead, and those read on the cycle's path)."""
    rows = []
    for beat in live_schedulers(s):
        for name, report in sorted((beat.trainers or {}).items()):
            stats = ResidencyStats.from_json(report)
            recent = stats.recent_page_ins
            rows.append({
                "scheduler": f"{beat.host}:{beat.pid}", "trainer": name, "budget_bytes": stats.budget_bytes,
                "resident_runs": stats.resident_runs, "resident_bytes": stats.resident_bytes,
                "paged_runs": stats.paged_runs, "paged_bytes": stats.paged_bytes,
                "page_ins_last_minute": recent,
                "mean_page_in_seconds": stats.recent_page_in_seconds / recent if recent else None,
                "page_ins": stats.page_ins, "page_outs": stats.page_outs,
                "prefetch_hits": stats.prefetch_hits, "prefetch_misses": stats.prefetch_misses, "as_of": beat.beat_at,
            })
    return rows
