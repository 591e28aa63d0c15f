"""What a trainer reports of its memory (workers/trainer/residency.py keeps it; docs/memory.md says what
each number means): plain data, so the scheduler and the admin CLI read it without torch, from the
engine's process, an engine process's answers, or a Celery worker's heartbeat."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

WINDOW_SECONDS = 60.0  # the span of the "recent" page-in figures


@dataclass(frozen=True)
class ResidencyStats:
    budget_bytes: int  # 0: no budget
    resident_runs: int
    resident_bytes: int  # weights, gradients and AdamW moments of the runs in memory
    paged_runs: int  # paged out by this trainer and not used since: on disk only, one copy each
    paged_bytes: int  # their state as it left memory
    page_ins: int
    page_in_seconds: float  # all page-ins together
    page_outs: int
    recent_page_ins: int  # within the last WINDOW_SECONDS
    recent_page_in_seconds: float
    prefetch_hits: int = 0  # page-ins served from a state read ahead of the cycle
    prefetch_misses: int = 0  # page-ins that read the store on the cycle's path
    prefetched_bytes: int = 0  # states read ahead and not yet used, held beside the budget

    @classmethod
    def empty(cls) -> ResidencyStats:
        return cls(0, 0, 0, 0, 0, 0, 0.0, 0, 0, 0.0)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> ResidencyStats:
        """From a report of this or an older version (fields it lacks read 0)."""
        return cls(**{f.name: d.get(f.name, 0) for f in fields(cls)})
