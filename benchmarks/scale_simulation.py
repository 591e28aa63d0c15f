"""Loraplex's distributed mode at 100 trainer workers and 100,000 runs, simulated: the real cycle
planner (scheduler/planner.py), reorder buffer (scheduler/ordering.py), placement
(scheduler/placement.py) and each worker's memory residency (workers/trainer/residency.py), driven
by a simulated executor whose clock charges compute by tokens and page-ins by bytes.

    .venv/bin/python -m benchmarks.scale_simulation [--workers 100] [--runs 100000] [--tenants 1000] \
        [--seconds 60] [--load 0.7] [--seed 0]   # from the repository root; about a minute

Runs belong to tenants round-robin. Each run's training steps (a forward_backward of
`tokens_per_step` tokens, its optim_step folded in) arrive as a Poisson process whose rate follows a
Zipf law over the runs (a few hot, most idle; no run above half a worker's speed, since a run's
steps follow each other), scaled so that the whole offered load is `load` of the workers' compute. A cycle is planned by the real planner from the real reorder buffer, placed by
the real placement code, and each worker's share costs its tokens / `tokens_per_second` plus a
page-in (`state_bytes` / `disk_bytes_per_second`) for each of its runs not resident in its
`budget_bytes`, as its real Residency decides; the cycle lasts as long as its busiest worker. A tenth
of the workers die a third of the way through (their runs go elsewhere and page in there) and come
back at two thirds. Two token budgets per cycle are compared: the deployment's one budget
(`LORAPLEX_CYCLE_TOKEN_BUDGET`, today's design: one budget for all workers together) and that
budget per worker. What it reports: requests served per second, worker utilisation, each tenant's
p99 wait against the median tenant's, page-ins per cycle, and placement stickiness (a step on the
worker of its run's previous step). The figures are the model's, not a machine's: what they compare
is the policy.
"""

from __future__ import annotations

import heapq
import json
import math
import random
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import typer

from contract.kinds import RequestKind
from contract.queue import QueuedRequest
from scheduler.ordering import ReorderBuffer
from scheduler.placement import place_models
from scheduler.planner import CyclePlanner
from workers.trainer.residency import Residency

RESULTS = Path(__file__).parent / "results" / "scale_simulation.md"
DEPLOYMENT_BUDGET = 8192  # LORAPLEX_CYCLE_TOKEN_BUDGET's default


@dataclass(frozen=True)
class Model:
    """What the simulated executor charges (illustrative GPU-worker figures; only ratios matter)."""

    tokens_per_step: int = 4096
    tokens_per_second: float = 20_000.0  # a worker's LoRA forward_backward throughput
    state_bytes: int = 45 * 2**20  # a stepped rank-8 run of a ~135M model (docs/memory.md): weights, grads, moments
    budget_bytes: int = 32 * 2**30  # a worker's memory budget (0.4 of an 80 GB GPU)
    disk_bytes_per_second: float = 2e9
    cycle_overhead_seconds: float = 0.01  # planning, dispatch and storing outcomes


@dataclass
class Worker:
    residency: Residency
    resident: dict[str, int] = field(default_factory=dict)  # run -> bytes in memory
    busy: float = 0.0
    page_ins: int = 0

    def run(self, runs: list[str], tokens: int, model: Model) -> float:
        """Load the runs of its share (paging the least recently used out, as the real trainer does) and
        compute them: the seconds it takes."""
        missing = [r for r in runs if r not in self.resident]
        for victim in self.residency.to_page_out(self.resident, keep=set(runs), incoming=set(missing)):
            self.residency.paged_out(victim, self.resident.pop(victim))
        for run in missing:
            self.resident[run] = model.state_bytes
            self.residency.paged_in(run, 0.0)
        for run in runs:
            self.residency.used(run)
        self.page_ins += len(missing)
        seconds = len(missing) * model.state_bytes / model.disk_bytes_per_second + tokens / model.tokens_per_second
        self.busy += seconds
        return seconds


def run_rates(runs: int, rate: float, most: float, rng: random.Random) -> list[float]:
    """Zipf(1.1) rates over shuffled runs summing to `rate`, none above `most` (a run's steps follow each
    other: one run cannot use more than a worker's share), what the cap takes off spread over the rest."""
    weights = [1.0 / (rank + 1) ** 1.1 for rank in range(runs)]
    rng.shuffle(weights)
    capped: set[int] = set()
    while True:
        free = rate - most * len(capped)
        total = sum(w for r, w in enumerate(weights) if r not in capped)
        over = {r for r, w in enumerate(weights) if r not in capped and free * w / total > most}
        if not over:
            return [most if r in capped else free * w / total for r, w in enumerate(weights)]
        capped |= over


def arrivals(runs: int, tenants: int, rate: float, most: float, seconds: float, rng: random.Random):
    """(time, run, tenant) of every step offered, in time order: Poisson at each run's rate."""
    events = []
    for run, run_rate in enumerate(run_rates(runs, rate, most, rng)):
        t = 0.0
        while run_rate > 0:
            t += rng.expovariate(run_rate)
            if t > seconds:
                break
            events.append((t, f"run{run}", f"tenant{run % tenants}"))
    return sorted(events)


def simulate(budget_per_cycle: int, workers: int, runs: int, tenants: int, seconds: float, load: float, seed: int,
             model: Model) -> dict:
    rng = random.Random(seed)
    one_worker = model.tokens_per_second / model.tokens_per_step  # steps per second
    rate = load * workers * one_worker  # offered
    offered = arrivals(runs, tenants, rate, 0.5 * one_worker, seconds, rng)
    pool = {f"w{i}": Worker(Residency(model.budget_bytes)) for i in range(workers)}
    dead = set(rng.sample(sorted(pool), max(1, workers // 10)))
    planner, buffer = CyclePlanner(budget_per_cycle, split_requests=False), ReorderBuffer()
    placed: dict[str, str] = {}
    next_seq: dict[str, int] = defaultdict(int)
    accepted_at: dict[str, float] = {}
    waits: dict[str, list[float]] = defaultdict(list)
    last_worker: dict[str, str] = {}
    same_worker = moved_or_new = cycles = page_ins_before = 0
    clock, i, served = 0.0, 0, 0
    horizon = seconds * 3  # the backlog may outlast the arrivals; a saturated policy is cut here
    while clock < horizon and (i < len(offered) or len(buffer)):
        while i < len(offered) and offered[i][0] <= clock:
            t, run, tenant = offered[i]
            request = QueuedRequest(f"{run}-{next_seq[run]}", tenant, run, next_seq[run], RequestKind.FORWARD_BACKWARD,
                                    model.tokens_per_step)
            next_seq[run] += 1
            accepted_at[request.id] = t
            buffer.add(request, next_seq=0)
            i += 1
        live = set(pool) - (dead if seconds / 3 <= clock < 2 * seconds / 3 else set())
        for name in set(pool) - live:  # dead: it comes back empty
            pool[name].resident.clear()
            pool[name].residency = Residency(model.budget_bytes)
        cycle = planner.plan(buffer.runnable())
        if not cycle:
            clock = offered[i][0] if i < len(offered) else horizon
            continue
        buffer.start(cycle.forward_backward)
        place_models({q.model_id for q in cycle.forward_backward}, placed, live)
        shares: dict[str, list[QueuedRequest]] = defaultdict(list)
        for q in cycle.forward_backward:
            shares[placed[q.model_id]].append(q)
        duration = max(pool[w].run(sorted({q.model_id for q in qs}), sum(q.num_tokens for q in qs), model)
                       for w, qs in shares.items()) + model.cycle_overhead_seconds
        clock += duration
        buffer.finish(cycle.forward_backward)
        cycles += 1
        for q in cycle.forward_backward:
            waits[q.tenant_id].append(clock - accepted_at.pop(q.id))
            worker = placed[q.model_id]
            if q.model_id in last_worker:
                same_worker += last_worker[q.model_id] == worker
                moved_or_new += last_worker[q.model_id] != worker
            last_worker[q.model_id] = worker
            served += 1
    p99 = {tenant: nearest_rank(w, 0.99) for tenant, w in waits.items()}
    busy = [w.busy for w in pool.values()]
    return {
        "offered_per_second": rate, "served_per_second": served / clock if clock else 0.0,
        "left_waiting": len(buffer) + len(offered) - i, "cycles": cycles,
        "utilisation": sum(busy) / (clock * workers) if clock else 0.0,
        "p99_wait_median_tenant": statistics.median(p99.values()) if p99 else math.nan,
        "p99_wait_worst_tenant": max(p99.values(), default=math.nan),
        "page_ins_per_cycle": sum(w.page_ins for w in pool.values()) / max(cycles, 1),
        "page_ins_per_step": sum(w.page_ins for w in pool.values()) / max(served, 1),
        "stickiness": same_worker / max(same_worker + moved_or_new, 1),
        "runs_that_ran": len(last_worker), "tenants_served": len(waits), "simulated_seconds": clock,
    }


def nearest_rank(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(workers: int = 100, runs: int = 100_000, tenants: int = 1000, seconds: float = 60.0, load: float = 0.7,
         seed: int = 0, write: bool = True) -> None:
    model = Model()
    results = {name: simulate(budget, workers, runs, tenants, seconds, load, seed, model)
               for name, budget in (("one budget per deployment", DEPLOYMENT_BUDGET),
                                    ("one budget per worker", DEPLOYMENT_BUDGET * workers))}
    names = list(results)
    rows = [("steps offered per second", "offered_per_second", "{:.0f}"),
            ("**steps served per second**", "served_per_second", "{:.1f}"),
            ("steps still waiting at the end", "left_waiting", "{:,}"),
            ("**worker utilisation**", "utilisation", "{:.1%}"),
            ("p99 wait, median tenant", "p99_wait_median_tenant", "{:.2f} s"),
            ("**p99 wait, worst tenant**", "p99_wait_worst_tenant", "{:.2f} s"),
            ("page-ins per cycle / per step served", None, None),
            ("placement stickiness (a step on its run's last worker)", "stickiness", "{:.1%}"),
            ("runs that trained / tenants served", None, None),
            ("cycles / simulated seconds", None, None)]
    lines = ["| measure | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, key, fmt in rows:
        if key is None:
            a, b = {"runs": ("runs_that_ran", "tenants_served"), "cycl": ("cycles", "simulated_seconds"),
                    "page": ("page_ins_per_cycle", "page_ins_per_step")}[label[:4]]
            cells = [f"{results[n][a]:,.2f} / {results[n][b]:,.2f}" if label.startswith("page")
                     else f"{results[n][a]:,} / {results[n][b]:,.0f}" for n in names]
        else:
            cells = [fmt.format(results[n][key]) for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    print(json.dumps({"model": model.__dict__}))
    if write:
        RESULTS.write_text(
            f"Command: `.venv/bin/python -m benchmarks.scale_simulation --workers {workers} --runs {runs} "
            f"--tenants {tenants} --seconds {seconds:g} --load {load:g} --seed {seed}` (simulated: the real planner, "
            f"reorder buffer, placement and residency; executor model {json.dumps(model.__dict__)})\n\n"
            + "\n".join(lines) + "\n")


if __name__ == "__main__":
    typer.run(main)
