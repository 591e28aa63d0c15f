"""An executor that runs cycles on Celery trainer workers (service/celery_worker.py).

Placement (scheduler/placement.py decides): a model sticks to one worker (its gradients and Adam
state live there); a model seen for the first time, or whose worker is gone, goes to the live worker
with the fewest models; a model about to run on a worker holding at least two models more than the
least loaded one moves there first (e.g. when a worker joins): the old worker writes its full state,
gradients included, to the shared store and drops it; the new one loads it on use, so the numbers
are those of staying put. The placement is kept in Redis, so it survives a scheduler restart. A
cycle is split per worker; the parts run at the same time, one Celery task each.

Each part and its payloads go to Redis under a fresh key; the task carries only that key to the
worker's own queue; the outcomes come back the same way. While waiting, the executor watches each
worker's heartbeat: if one stops (the process died, e.g. SIGKILL), every request of its part
fails with category "server" and none of them is retried behind the client's back. The gradients
the dead worker held for finished forward_backward requests died with it: when one of its models
is next used, `place` moves it to a live worker and reports it, and the scheduler replays those
requests there first; the new worker loads the adapter's durable state (written after every
optim_step) before, so acknowledged work is neither lost nor applied twice.

A request run in parts (scheduler/planner.py) keeps its model on one worker until its last part:
the worker holds the parts run so far (gradients and results), and answers a part it already ran
from there when a restarted scheduler sends it again (workers/trainer/executor.py), so a scheduler
restart neither repeats nor loses a part. If that worker dies, the scheduler runs the request
from its first datum again on the model's new worker, after replaying what came before.

Whole requests likewise: a scheduler killed after a worker ran a cycle but before it committed the
outcomes sends the cycle again after its restart; the worker keeps each model's last cycle's outcomes
and answers the requests found there from them (`answer_resent`, workers/trainer/executor.py), so no
gradient or step is applied twice.
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path

from contract.queue import Cycle, Job, Outcome
from contract.redis_keys import EVICT_TASK, PLACEMENT, RESULT_TTL_SECONDS, TASK, cycle_done_key, cycle_key, worker_key
from contract.residency import ResidencyStats
from messaging.celery_app import live_registrations, make_app
from scheduler.placement import place_models
from storage.live_slots import newest_verified, read_slots


class WorkerLost(RuntimeError):
    pass


class CeleryExecutor:
    def __init__(self, redis_url: str, base_model: str, live_dir: str | Path, wait_for_worker_seconds: float = 120) -> None:
        import redis

        self.redis = redis.Redis.from_url(redis_url, decode_responses=False)
        self.app = make_app(redis_url)
        self.base_model = base_model
        self.live_dir = str(live_dir)
        self.wait_for_worker_seconds = wait_for_worker_seconds
        self._splitting: set[str] = set()  # models halfway through a request run in parts, as the outcomes said

    # (contract.executor.Executor)
    engines_restart_with_scheduler = False  # workers keep their state when the scheduler restarts

    # --- workers and placement -------------------------------------------------------------------

    def live_workers(self) -> dict[str, dict]:
        return live_registrations(self.redis, worker_key, self.base_model)

    def _wait_for_workers(self) -> dict[str, dict]:
        deadline = time.monotonic() + self.wait_for_worker_seconds
        while not (workers := self.live_workers()):
            if time.monotonic() > deadline:
                raise WorkerLost(f"no live trainer worker serves {self.base_model!r}")
            time.sleep(0.2)
        return workers

    def trainer_memory(self) -> dict[str, ResidencyStats]:
        """As each live worker's last heartbeat said (service/celery_worker.py)."""
        return {worker: ResidencyStats.from_json(record["residency"])
                for worker, record in self.live_workers().items() if "residency" in record}

    def placement(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.redis.hgetall(PLACEMENT).items()}

    def place(self, model_ids: set[str]) -> set[str]:
        """Give every model a live worker; the models that had one which died (their work since their durable
        state must be replayed)."""
        try:
            workers = self._wait_for_workers()
        except WorkerLost:
            return set()  # run_cycle fails the cycle clearly
        # Halfway through a request run in parts, a model stays: its worker holds those parts' gradients
        # and results, which a move would not carry. The workers' own word covers a restarted scheduler.
        splitting = self._splitting | {m for w in workers.values() for m in w.get("splitting", ())}
        lost = set()
        for change in place_models(model_ids, self.placement(), set(workers), splitting):
            if change.lost:
                lost.add(change.model_id)
            elif change.moved:
                try:
                    self.move(change.model_id, change.worker, workers)
                    if not self._newest_state_verifies(change.model_id):  # the new worker would load an older one
                        lost.add(change.model_id)
                except WorkerLost:
                    lost.add(change.model_id)  # it died while writing the state out: replay, as for any lost worker
            self.redis.hset(PLACEMENT, change.model_id, change.worker)
        return lost

    def move(self, model_id: str, target: str, workers: dict[str, dict] | None = None) -> None:
        """Move a model's full state (weights, gradients, Adam moments, step) to `target` through
        the shared store. Call it between the model's cycles (the scheduler's thread does)."""
        workers = workers or self._wait_for_workers()
        source = self.placement().get(model_id)
        if source == target:
            return
        if source in workers:
            key, result = self._send(workers[source], EVICT_TASK, [model_id])
            self._collect(source, key, result)
        self.redis.hset(PLACEMENT, model_id, target)

    # --- the executor interface ------------------------------------------------------------------

    def durable_seq(self, model_id: str, at_most: int | None = None) -> int | None:
        """The seq_id of the model's newest stored state that verifies (the shared store: no worker needed),
        which is the one a worker loads. (`at_most` is not applied here: a worker restores its newest state;
        see the limits in docs/operations.md.)"""
        slot, _ = newest_verified(self.live_dir, model_id)
        return None if slot is None else slot.seq

    def _newest_state_verifies(self, model_id: str) -> bool:
        """Whether the model's newest stored state is intact (else a worker restores an older one and the
        requests after it must be replayed: workers/trainer/live_state.py)."""
        slot, _ = newest_verified(self.live_dir, model_id)
        stored = [s for s in read_slots(self.live_dir, model_id) if s.manifest is not None]
        return slot is None or not stored or slot.path == stored[0].path

    def run_cycle(self, cycle: Cycle, jobs: dict[str, Job]) -> dict[str, Outcome]:
        try:
            workers = self._wait_for_workers()
        except WorkerLost as e:
            return {q.id: Outcome.failed(str(e), "server") for q in cycle.all()}
        placed = self.placement()  # the scheduler placed them (`place`) just before
        gone = [q for q in cycle.all() if placed.get(q.model_id) not in workers]
        outcomes = {q.id: Outcome.failed("trainer worker lost before the cycle", "server") for q in gone}
        where = {q.model_id: placed[q.model_id] for q in cycle.all() if q not in gone}
        parts = {worker: cycle.keeping(lambda q, worker=worker: where.get(q.model_id) == worker)
                 for worker in sorted(set(where.values()))}
        sent = {worker: self._send(workers[worker], TASK, (part, {q.id: jobs[q.id] for q in part.all()}))
                for worker, part in parts.items()}
        for worker, (key, result) in sent.items():
            try:
                outcomes.update(self._collect(worker, key, result))
            except WorkerLost as e:  # its models move (and replay) when next used
                outcomes.update({q.id: Outcome.failed(f"trainer worker lost: {e}", "server") for q in parts[worker].all()})
        for q in cycle.forward_backward:
            if (outcome := outcomes.get(q.id)) is not None and outcome.progress is not None:
                self._splitting.add(q.model_id)
            else:
                self._splitting.discard(q.model_id)
        return outcomes

    def prefetch(self, model_ids: list[str]) -> None:
        """Ignored: a worker pages its runs in on its cycle's path (sending hints to workers is not built)."""

    def close(self) -> None:
        """Let go of the connections (the workers keep their engines, and write their own states)."""
        self.app.close()
        self.redis.close()

    def _send(self, worker: dict, task: str, data):
        key = cycle_key()
        self.redis.set(key, pickle.dumps(data), ex=RESULT_TTL_SECONDS)
        return key, self.app.send_task(task, args=[key], queue=worker["queues"][0])

    def _collect(self, worker_id: str, key: str, result) -> dict[str, Outcome]:
        """Block on the worker's "done" list (no polling delay); between waits, check its heartbeat."""
        try:
            while True:
                done = self.redis.blpop([cycle_done_key(key)], timeout=0.5)
                if done is not None:
                    out_key = done[1]
                    break
                if result.failed():
                    result.get(propagate=True)  # the task raised: re-raise it here
                if self.redis.get(worker_key(worker_id)) is None:
                    raise WorkerLost(f"{worker_id} stopped beating during the cycle")
            outcomes = pickle.loads(self.redis.get(out_key))
            self.redis.delete(out_key)
            return outcomes
        finally:
            self.redis.delete(key, cycle_done_key(key))
