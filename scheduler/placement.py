"""Where each model runs when trainers are Celery workers: the decision alone, on plain data, so the
executor (scheduler/celery_executor.py) and the scale simulation (benchmarks/placement_simulation.py)
run the same code.

A model sticks to its worker: its gradients and Adam state live there. A model seen for the first
time, or whose worker is gone, goes to the live worker with the fewest models. A model about to run
on a worker holding at least two models more than the least loaded one moves there (rebalancing,
e.g. when a worker joins), unless it is halfway through a request run in parts, whose results its
worker holds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

REBALANCE_GAP = 2  # models more than the least loaded worker holds, before a model moves off


@dataclass(frozen=True)
class Placement:
    model_id: str
    worker: str
    previous: str | None  # None: placed for the first time
    moved: bool = False  # a rebalancing move: the previous worker writes its state out first

    @property
    def lost(self) -> bool:
        """Its previous worker is gone: the work since its durable state must be replayed."""
        return self.previous is not None and not self.moved


def place_models(model_ids: set[str], placed: dict[str, str], workers: set[str],
                 splitting: set[str] = frozenset()) -> list[Placement]:
    """The changes the models about to run need, given the placement so far (model -> worker, updated in
    place) and the live workers (non-empty). Models that stay where they are need none."""
    load = Counter(w for w in placed.values() if w in workers)  # models per live worker
    changes = []
    for model_id in sorted(model_ids):
        current = placed.get(model_id)
        least = min(workers, key=lambda w: (load[w], w))
        if current not in workers:
            changes.append(Placement(model_id, least, current))
        elif load[current] - load[least] >= REBALANCE_GAP and model_id not in splitting:
            changes.append(Placement(model_id, least, current, moved=True))
        else:
            continue
        placed[model_id] = least
        load[least] += 1
        if current in workers:
            load[current] -= 1
    return changes
