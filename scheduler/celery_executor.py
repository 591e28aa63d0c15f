"""An executor that runs cycles on Celery trainer workers (workers/celery_worker.py).

The cycle and its payloads go to Redis under a fresh key; the Celery task carries only that key
to the worker's own queue; the outcomes come back the same way. While waiting, the executor
watches the worker's heartbeat: if it stops (the process died, e.g. SIGKILL), every request of
the cycle fails with category "server" and none of them is retried behind the client's back.
The gradients the dead worker held for finished forward_backward requests died with it: the
scheduler then replays those requests on a live worker, which loads each adapter's durable state
(written after every optim_step) first, so acknowledged work is neither lost nor applied twice.

Placement today: every model goes to the first live worker serving this base model, and stays
there while it lives. Spreading models over several workers is the next step.
"""

from __future__ import annotations

import json
import pickle
import time
import uuid
from pathlib import Path

from scheduler.executor import Job, Outcome
from scheduler.planner import Cycle
from workers.celery_app import RESULT_TTL_SECONDS, TASK, make_app, worker_key
from workers.trainer.checkpoints import read_manifest


class WorkerLost(RuntimeError):
    pass


class CeleryExecutor:
    def __init__(self, redis_url: str, base_model: str, live_dir: Path, wait_for_worker_seconds: float = 120) -> None:
        import redis

        self.redis = redis.Redis.from_url(redis_url)
        self.app = make_app(redis_url)
        self.base_model = base_model
        self.live_dir = Path(live_dir)
        self.wait_for_worker_seconds = wait_for_worker_seconds
        self._lost_worker = False

    def live_workers(self) -> list[dict]:
        records = [self.redis.get(key) for key in self.redis.scan_iter(worker_key("*"))]
        workers = [json.loads(r) for r in records if r]
        return sorted((w for w in workers if w["base_model"] == self.base_model and w["queues"]),
                      key=lambda w: w["worker_id"])

    def _worker(self) -> dict:
        deadline = time.monotonic() + self.wait_for_worker_seconds
        while True:
            workers = self.live_workers()
            if workers:
                return workers[0]
            if time.monotonic() > deadline:
                raise WorkerLost(f"no live trainer worker serves {self.base_model!r}")
            time.sleep(0.2)

    def durable_seq(self, model_id: str) -> int | None:
        manifest = read_manifest(self.live_dir / model_id)  # the shared store: no worker needed
        return None if manifest is None else int(manifest.get("extra", {}).get("seq_id", -1))

    def run_cycle(self, cycle: Cycle, jobs: dict[str, Job]) -> dict[str, Outcome]:
        try:
            return self._run(cycle, jobs)
        except WorkerLost as e:
            self._lost_worker = True
            return {q.id: Outcome.failed(f"trainer worker lost: {e}", "server") for q in cycle.all()}

    def take_lost_worker(self) -> bool:
        """True once after a worker died: gradients it held must be replayed elsewhere."""
        lost, self._lost_worker = self._lost_worker, False
        return lost

    def _run(self, cycle: Cycle, jobs: dict[str, Job]) -> dict[str, Outcome]:
        worker = self._worker()
        key = f"loraplex:cycle:{uuid.uuid4().hex}"
        self.redis.set(key, pickle.dumps((cycle, jobs)), ex=RESULT_TTL_SECONDS)
        try:
            result = self.app.send_task(TASK, args=[key], queue=worker["queues"][0])
            while not result.ready():
                if self.redis.get(worker_key(worker["worker_id"])) is None:
                    raise WorkerLost(f"{worker['worker_id']} stopped beating during the cycle")
                time.sleep(0.005)
            out_key = result.get(propagate=True)
            outcomes = pickle.loads(self.redis.get(out_key))
            self.redis.delete(out_key)
            return outcomes
        finally:
            self.redis.delete(key)
