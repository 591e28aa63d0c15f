"""What the scheduler needs of an executor: the one door between deciding and computing.

Three executors have it: `InProcessExecutor` (an engine in this process) and `ProcessExecutor` (an
engine in a child process), both in workers/trainer/, and `CeleryExecutor` (engines on Celery
trainer workers, scheduler/celery_executor.py). What else a concrete executor offers (eviction,
the models it is running in parts) is for whoever hosts that engine, not for the scheduler.
"""

from __future__ import annotations

from typing import Protocol

from contract.queue import Cycle, Job, Outcome
from contract.residency import ResidencyStats


class Executor(Protocol):
    # True when the engines die with the scheduler's process (and their in-memory gradients with them):
    # the scheduler then replays, on start, what each model finished after its durable state.
    engines_restart_with_scheduler: bool

    def place(self, model_ids: set[str]) -> set[str]:
        """Make these models ready to run; those whose engine lost work since their durable state (a dead
        worker, or a stored state found corrupt): the scheduler replays their requests after `durable_seq`."""
        ...

    def run_cycle(self, cycle: Cycle, jobs: dict[str, Job]) -> dict[str, Outcome]:
        """Run one cycle; one outcome per request (failures included: it does not raise)."""
        ...

    def prefetch(self, model_ids: list[str]) -> None:
        """A hint, never waited for: requests of these models are queued for the next cycles, so an engine
        may start reading those it paged out back in (workers/trainer/prefetch.py). Honoured or ignored:
        nothing else changes. Called from any thread."""
        ...

    def durable_seq(self, model_id: str, at_most: int | None = None) -> int | None:
        """The seq_id the model's stored state reflects (None: none stored); `at_most`: the seq_id the
        database holds as applied (a newer stored state is never used)."""
        ...

    def trainer_memory(self) -> dict[str, ResidencyStats]:
        """What each trainer engine it feeds holds in memory and has paged out, by a name an operator
        recognises (contract/residency.py). Cheap: called with every beat of the scheduler."""
        ...

    def close(self) -> None:
        """Finish what is under way (durable states being written) and let the engines go."""
        ...
