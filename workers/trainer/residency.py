"""Which training runs a trainer keeps in memory: a byte budget, the least recently used paged out.

A run in memory costs its adapter's weights, their gradients and, once it has stepped, AdamW's two
moments (`Adapter.resident_bytes`: 4x the weights in float32). A run paged out costs disk only: the
executor writes its full state, gradients included, to its live slot in the store and drops it; on
its next use it is read back and verified (workers/trainer/live_state.py), and continues bitwise as
if it had never left. The executor pages out before a cycle loads its runs, using what each
incoming run held when it left (a run never resident in this process counts as 0 until loaded:
after a restart the first cycles can pass the budget by their own runs, and the budget is checked
again once they are in). A cycle's own runs, and runs halfway through a request in parts, are never
paged out. A cycle whose runs together exceed the budget runs in groups that fit (`groups`), one
after another; a lone run larger than the budget still runs, over it, and create_model refuses a
run whose stepped state could never fit (docs/memory.md). Page-ins of runs the scheduler said were
coming are read ahead (workers/trainer/prefetch.py): `prefetch_hits` and `prefetch_misses` count them.

The budget: `budget_bytes` given, else a fraction of the memory the adapters live in (the GPU's on
CUDA, the machine's RAM on CPU); 0 keeps every run resident. Operators read the numbers at /metrics
(`ResidencyMetrics`: the embedded server's, a Celery trainer worker's `metrics_port`) and in
`stats()`. What a run costs in each tier, and how the budget meets the quota on live runs:
docs/memory.md.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable

import torch
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import REGISTRY, Collector

from contract.residency import WINDOW_SECONDS, ResidencyStats


def memory_budget(budget_bytes: int | None, fraction: float, device: torch.device) -> int:
    """The bytes of adapter state a trainer keeps resident (0: no limit)."""
    if budget_bytes is not None:
        return int(budget_bytes)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total * fraction)


class Residency:
    """The least-recently-used order of the resident runs, and what to page out to stay in budget."""

    def __init__(self, budget_bytes: int = 0, max_runs: int = 0) -> None:
        self.budget_bytes = budget_bytes  # 0: no limit
        self.max_runs = max_runs  # a count limit besides (0: none)
        self._used: OrderedDict[str, None] = OrderedDict()  # resident runs, least recently used first
        self._paged: dict[str, int] = {}  # run -> the bytes it held when paged out
        self.page_ins = 0
        self.page_in_seconds = 0.0
        self.page_outs = 0
        self.prefetch_hits = 0  # page-ins served from a state read ahead (workers/trainer/prefetch.py)
        self.prefetch_misses = 0  # page-ins that read the store on the cycle's path
        self._recent: deque[tuple[float, float]] = deque()  # (monotonic time, seconds) of recent page-ins

    @property
    def limited(self) -> bool:
        return bool(self.budget_bytes or self.max_runs)

    def used(self, model_id: str) -> None:
        self._used[model_id] = None
        self._used.move_to_end(model_id)

    def to_page_out(self, resident: dict[str, int], keep: set[str], incoming: set[str]) -> list[str]:
        """The runs to page out, least recently used first, so that `resident` (run -> bytes) and the
        `incoming` runs fit the budget; never one in `keep`."""
        total = sum(resident.values()) + sum(self._paged.get(m, 0) for m in incoming - resident.keys())
        count = len(resident.keys() | incoming)
        order = [m for m in self._used if m in resident] + [m for m in resident if m not in self._used]
        victims = []
        for model_id in order:
            over_bytes = self.budget_bytes and total > self.budget_bytes
            over_count = self.max_runs and count > self.max_runs
            if not (over_bytes or over_count):
                break
            if model_id in keep:
                continue
            victims.append(model_id)
            total -= resident[model_id]
            count -= 1
        return victims

    def groups(self, model_ids: list[str], resident: dict[str, int]) -> list[list[str]]:
        """A cycle's runs, in order, cut into groups whose state (and count) fits the budget together: the executor runs
        them one group after another, so a cycle of more runs than memory holds queues instead of running
        over (a run alone larger than the budget is a group of its own). One group without a budget, or
        while sizes are unknown (a run never resident here counts 0)."""
        if not self.limited:
            return [model_ids]
        groups: list[list[str]] = [[]]
        total = 0
        for model_id in model_ids:
            size = resident.get(model_id, self._paged.get(model_id, 0))
            over_bytes = self.budget_bytes and total + size > self.budget_bytes
            if groups[-1] and (over_bytes or (self.max_runs and len(groups[-1]) >= self.max_runs)):
                groups.append([])
                total = 0
            groups[-1].append(model_id)
            total += size
        return groups

    def is_paged(self, model_id: str) -> bool:
        """Paged out by this trainer, and not used since."""
        return model_id in self._paged

    def paged_out(self, model_id: str, nbytes: int) -> None:
        self._used.pop(model_id, None)
        self._paged[model_id] = nbytes
        self.page_outs += 1

    def paged_in(self, model_id: str, seconds: float, prefetched: bool = False) -> None:
        if self._paged.pop(model_id, None) is not None:
            self.page_ins += 1
            self.page_in_seconds += seconds
            if prefetched:
                self.prefetch_hits += 1
            else:
                self.prefetch_misses += 1
            self._recent.append((time.monotonic(), seconds))
        self.used(model_id)

    def forget(self, model_id: str) -> None:
        """The run left memory for good (deleted, or moved to another trainer)."""
        self._used.pop(model_id, None)
        self._paged.pop(model_id, None)

    def stats(self, resident: dict[str, int], prefetched_bytes: int = 0) -> ResidencyStats:
        while self._recent and self._recent[0][0] < time.monotonic() - WINDOW_SECONDS:
            self._recent.popleft()
        recent = list(self._recent)  # (a copy: another thread may page in meanwhile)
        return ResidencyStats(self.budget_bytes, len(resident), sum(resident.values()), len(self._paged),
                              sum(self._paged.values()), self.page_ins, self.page_in_seconds, self.page_outs,
                              len(recent), sum(seconds for _, seconds in recent), self.prefetch_hits,
                              self.prefetch_misses, prefetched_bytes)


class ResidencyMetrics(Collector):
    """The residency of every trainer this process hosts, read at each scrape of /metrics (summed: one
    process normally hosts one). A collector, not gauges set along the way: the numbers live in the
    executor, which may be in a child process (workers/trainer/process_executor.py)."""

    def __init__(self) -> None:
        self.sources: list[Callable[[], ResidencyStats]] = []

    def collect(self):
        stats = [source() for source in self.sources]
        for name, doc, field in (
            ("loraplex_trainer_budget_bytes", "The trainers' memory budget for training state (0: none)", "budget_bytes"),
            ("loraplex_trainer_resident_runs", "Training runs whose state is in a trainer's memory", "resident_runs"),
            ("loraplex_trainer_resident_bytes", "Bytes of training state (weights, gradients, AdamW moments) "
             + "in the trainers' memory", "resident_bytes"),
            ("loraplex_trainer_paged_runs", "Training runs paged out to the store and not used since", "paged_runs"),
            ("loraplex_trainer_paged_bytes", "Bytes of those runs' state, as it left memory", "paged_bytes"),
            ("loraplex_trainer_prefetched_bytes", "Bytes of paged-out runs' state read ahead of their cycle, "
             + "held beside the budget", "prefetched_bytes"),
        ):
            yield GaugeMetricFamily(name, doc, value=sum(getattr(s, field) for s in stats))
        yield SummaryMetricFamily("loraplex_trainer_page_in_seconds", "Reading a paged-out run's state back in",
                                  count_value=sum(s.page_ins for s in stats),
                                  sum_value=sum(s.page_in_seconds for s in stats))
        yield CounterMetricFamily("loraplex_trainer_page_outs", "Runs paged out of a trainer's memory to the store",
                                  value=sum(s.page_outs for s in stats))
        yield CounterMetricFamily("loraplex_trainer_prefetch_hits", "Page-ins served from a state read ahead",
                                  value=sum(s.prefetch_hits for s in stats))
        yield CounterMetricFamily("loraplex_trainer_prefetch_misses", "Page-ins that read the store on the cycle's path",
                                  value=sum(s.prefetch_misses for s in stats))


METRICS = ResidencyMetrics()
REGISTRY.register(METRICS)


def publish(source: Callable[[], ResidencyStats]) -> Callable[[], None]:
    """Serve `source`'s numbers at /metrics; the function to call to stop."""
    METRICS.sources.append(source)
    return lambda: METRICS.sources.remove(source)

