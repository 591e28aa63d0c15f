"""A trainer worker as a Celery worker: one process per device, its own queue, one cycle at a time.

    LORAPLEX_BASE_MODEL=tiny LORAPLEX_DATA_DIR=/shared/loraplex LORAPLEX_REDIS_URL=redis://host:6379/0 \\
        celery -A service.celery_worker worker --pool solo -Q trainer.w1 -n w1@%h

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

import pickle

import prometheus_client
from celery import signals

from contract.redis_keys import EVICT_TASK, RESULT_TTL_SECONDS, TASK, cycle_done_key, cycle_outcomes_key, worker_key
from messaging.celery_app import make_worker_app, register_worker
from service.settings import Settings

_state: dict = {}  # settings, client (make_worker_app), executor
app = make_worker_app(Settings, _state)  # reads the settings when the worker starts, not on import


@signals.worker_ready.connect
def _start(sender=None, **_) -> None:
    """Load the engine once, register, and start the heartbeat."""
    from workers.trainer.engine import TrainerEngine
    from workers.trainer.executor import InProcessExecutor
    from workers.trainer.residency import memory_budget, publish

    settings: Settings = _state["settings"]
    info = settings.served_model()
    engine = TrainerEngine(info.path, max_rank=settings.max_lora_rank, min_shared_prefix=settings.trainer_min_shared_prefix,
                           keep_glibc_malloc_defaults=settings.keep_glibc_malloc_defaults)
    executor = InProcessExecutor(engine, settings.live_dir,
                                 settings.max_resident_adapters, settings.state_write_interval_seconds,
                                 # this worker outlives the scheduler: a cycle it ran whose outcomes the scheduler
                                 # died before committing comes again, and must not apply gradients or a step twice
                                 answer_resent=True,
                                 memory_budget=memory_budget(settings.trainer_memory_budget,
                                                             settings.trainer_memory_fraction, engine.device))
    _state["executor"] = executor
    # "splitting": models halfway through a request run in parts here, which must not move away
    register_worker(_state["client"], sender, worker_key, info.name,
                    lambda: {"adapters": sorted(executor.engine.adapters), "splitting": sorted(executor.splitting()),
                             "residency": executor.residency_stats().to_json()},
                    settings.worker_id)
    if settings.metrics_port:  # its residency (workers/trainer/residency.py); also in the heartbeat above
        publish(executor.residency_stats)
        prometheus_client.start_http_server(settings.metrics_port)


@signals.worker_shutdown.connect
def _finish_writes(**_) -> None:
    if "executor" in _state:
        _state["executor"].close()  # the durable states still queued


def _reply(key: str, outcomes) -> str:
    out_key = cycle_outcomes_key(key)
    client = _state["client"]
    client.set(out_key, pickle.dumps(outcomes), ex=RESULT_TTL_SECONDS)
    client.rpush(cycle_done_key(key), out_key)  # wakes the executor's blocking wait at once
    client.expire(cycle_done_key(key), RESULT_TTL_SECONDS)
    return out_key


@app.task(name=TASK)
def run_cycle(cycle_key: str) -> str:
    """Run the cycle stored at `cycle_key`; the outcomes go to `<cycle_key>:outcomes`."""
    cycle, jobs = pickle.loads(_state["client"].get(cycle_key))
    return _reply(cycle_key, _state["executor"].run_cycle(cycle, jobs))


@app.task(name=EVICT_TASK)
def evict(key: str) -> str:
    """Write the full state of the models listed at `key` to the shared store and drop them (they move)."""
    for model_id in pickle.loads(_state["client"].get(key)):
        _state["executor"].evict(model_id)
    return _reply(key, {})
