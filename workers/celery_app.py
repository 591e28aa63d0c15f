"""What the scheduler's CeleryExecutor and the Celery trainer workers share: the app, the task name,
the Redis keys."""

from __future__ import annotations

from celery import Celery

TASK = "loraplex.run_cycle"
HEARTBEAT_SECONDS = 1.0
HEARTBEAT_TTL_SECONDS = 5  # a worker silent this long is dead
RESULT_TTL_SECONDS = 3600  # cycles and outcomes left in Redis by a crash expire


def worker_key(worker_id: str) -> str:
    """The worker's registration: base model, queues, resident adapters; expires without heartbeats."""
    return f"loraplex:worker:{worker_id}"


def make_app(redis_url: str) -> Celery:
    app = Celery("loraplex", broker=redis_url, backend=redis_url)
    app.conf.update(
        task_acks_late=False,  # acked on receipt: a cycle is never redelivered after a crash
        worker_prefetch_multiplier=1,
        task_serializer="json", result_serializer="json", accept_content=["json"],
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    return app
