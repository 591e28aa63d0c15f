"""A trainer worker as a Celery worker: one process per device, its own queue, one cycle at a time.

    LORAPLEX_BASE_MODEL=tiny LORAPLEX_DATA_DIR=/shared/loraplex LORAPLEX_REDIS_URL=redis://host:6379/0 \\
        celery -A workers.celery_worker worker --pool solo -Q trainer.w1 -n w1@%h

The scheduler's CeleryExecutor sends each cycle as one task naming a Redis key; the cycle (its
requests and payloads) and the outcomes travel through Redis, never inside broker messages. The
worker keeps its engine (base model, adapters, gradients, Adam state) in memory for its lifetime
and writes each adapter's durable state to the shared data dir as the in-process executor does.
It registers itself in Redis (base model, queue, resident adapters) and refreshes a heartbeat
every HEARTBEAT_SECONDS; the key expires if the process dies, which is how the scheduler notices.
Tasks are acknowledged on receipt: a cycle whose worker died is never redelivered (it would apply
gradients twice); the scheduler fails it instead.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import threading
import time

from celery import signals

from service.settings import Settings
from workers.celery_app import HEARTBEAT_SECONDS, HEARTBEAT_TTL_SECONDS, RESULT_TTL_SECONDS, TASK, make_app, worker_key

settings = Settings()
app = make_app(settings.redis_url)
_state: dict = {}


def _redis():
    import redis

    return redis.Redis.from_url(settings.redis_url)


@signals.worker_ready.connect
def _start(sender=None, **_) -> None:
    """Load the engine once, register, and start the heartbeat."""
    from scheduler.executor import InProcessExecutor
    from workers.models.registry import model_info
    from workers.trainer.engine import TrainerEngine

    info = model_info(settings.base_model)
    _state["executor"] = InProcessExecutor(TrainerEngine(info.path, max_rank=settings.max_lora_rank),
                                           settings.data_dir / "live")
    worker_id = os.environ.get("LORAPLEX_WORKER_ID") or getattr(sender, "hostname", None) or socket.gethostname()
    consumer = getattr(sender, "task_consumer", None)
    queues = [q.name for q in consumer.queues] if consumer else []
    _state["worker_id"] = worker_id
    threading.Thread(target=_heartbeat, args=(worker_id, info.name, queues), daemon=True).start()


def _heartbeat(worker_id: str, base_model: str, queues: list[str]) -> None:
    client = _redis()
    while True:
        executor = _state.get("executor")
        adapters = sorted(executor.engine.adapters) if executor else []
        record = {"worker_id": worker_id, "base_model": base_model, "queues": queues, "adapters": adapters,
                  "pid": os.getpid(), "time": time.time()}
        client.set(worker_key(worker_id), json.dumps(record), ex=HEARTBEAT_TTL_SECONDS)
        time.sleep(HEARTBEAT_SECONDS)


@app.task(name=TASK)
def run_cycle(cycle_key: str) -> str:
    """Run the cycle stored at `cycle_key`; the outcomes go to `<cycle_key>:outcomes`."""
    client = _redis()
    cycle, jobs = pickle.loads(client.get(cycle_key))
    outcomes = _state["executor"].run_cycle(cycle, jobs)
    out_key = f"{cycle_key}:outcomes"
    client.set(out_key, pickle.dumps(outcomes), ex=RESULT_TTL_SECONDS)
    client.rpush(f"{cycle_key}:done", out_key)  # wakes the executor's blocking wait at once
    client.expire(f"{cycle_key}:done", RESULT_TTL_SECONDS)
    return out_key
