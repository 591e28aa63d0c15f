"""What the scheduler and the Celery workers share: the Celery app, and the registration each worker
keeps alive with heartbeats (the task names and Redis keys are contract/redis_keys.py's)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Callable

from celery import Celery

from contract.redis_keys import REGISTRY
from storage import store

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 1.0
HEARTBEAT_TTL_SECONDS = 5  # a worker silent this long is dead


def live_registrations(client, key: Callable[[str], str], base_model: str) -> dict[str, dict]:
    """The live registrations under `key` (worker_key or sampler_key) of workers serving `base_model`.
    Expired ones leave REGISTRY here (a worker that beats again re-adds its key)."""
    prefix = key("").encode()
    names = [name for name in client.smembers(REGISTRY) if name.startswith(prefix)]
    records = client.mget(names) if names else []
    expired = [name for name, record in zip(names, records) if record is None]
    if expired:
        client.srem(REGISTRY, *expired)
    workers = [json.loads(r) for r in records if r]
    return {w["worker_id"]: w for w in workers if w["base_model"] == base_model and w["queues"]}


def heartbeat(client, key: str, record: dict) -> None:
    """Write a registration for HEARTBEAT_TTL_SECONDS, its key listed in REGISTRY."""
    client.pipeline().set(key, json.dumps(record), ex=HEARTBEAT_TTL_SECONDS).sadd(REGISTRY, key).execute()


def start_heartbeat(client, key: str, record: Callable[[], dict]) -> None:
    """Refresh `key` with `record()` every HEARTBEAT_SECONDS from a daemon thread; it expires
    HEARTBEAT_TTL_SECONDS after the process dies."""

    def beat() -> None:
        while True:
            try:
                heartbeat(client, key, record() | {"pid": os.getpid(), "time": time.time()})
            except Exception:  # Redis away for a moment: the next beat tries again
                log.exception("heartbeat failed")
            time.sleep(HEARTBEAT_SECONDS)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()


def register_worker(client, sender, key: Callable[[str], str], base_model: str, status: Callable[[], dict],
                    worker_id: str = "") -> str:
    """Register the Celery worker that sent worker_ready under `key(worker id)` (its id, base model,
    queues and `status()`), kept alive by heartbeats; its worker id (`worker_id`, Settings.worker_id;
    empty: the Celery node name, else the host name)."""
    import socket

    worker_id = worker_id or getattr(sender, "hostname", None) or socket.gethostname()
    consumer = getattr(sender, "task_consumer", None)
    queues = [q.name for q in consumer.queues] if consumer else []
    start_heartbeat(client, key(worker_id), lambda: {"worker_id": worker_id, "base_model": base_model, "queues": queues,
                                                     **status()})
    return worker_id


def redis_client(redis_url: str):
    import redis

    return redis.Redis.from_url(redis_url)


def make_app(redis_url: str | None = None) -> Celery:
    """The Celery app on `redis_url` (broker and result backend; None: set before Celery first
    reads the configuration, as make_worker_app does)."""
    app = Celery("loraplex", broker=redis_url, backend=redis_url)
    app.conf.update(
        task_acks_late=False,  # acked on receipt: a cycle is never redelivered after a crash
        worker_prefetch_multiplier=1,
        task_serializer="json", result_serializer="json", accept_content=["json"],
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    return app


def make_worker_app(read_settings: Callable[[], Any], state: dict) -> Celery:
    """A Celery worker's app. `read_settings()` (service.settings.Settings) runs once, when Celery
    first reads the app's configuration as the worker starts, not when `celery -A` imports the
    worker's module; the app then uses its Redis, and `state` gets the settings and a Redis client
    (one client and connection pool for the process)."""
    app = make_app()

    def configure(sender: Celery, **_) -> None:
        settings = read_settings()
        store.use_cache_dir(settings.store_cache)
        sender.conf.update(broker_url=settings.redis_url, result_backend=settings.redis_url)
        state.update(settings=settings, client=redis_client(settings.redis_url))

    app.on_configure.connect(configure, weak=False)
    return app
