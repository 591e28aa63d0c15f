"""A sampler worker as a Celery worker: one process per device, one multi-LoRA vLLM engine, its own queue.

    LORAPLEX_BASE_MODEL=tiny LORAPLEX_DATA_DIR=/shared/loraplex LORAPLEX_REDIS_URL=redis://host:6379/0 \\
        celery -A service.sampler_worker worker --pool solo -Q sampler.s1 -n s1@%h

The scheduler's RemoteSamplerEngine sends each sample job as a task naming a Redis key. The task
only hands the job to the engine and returns, so the solo pool takes the next one at once and the
engine batches every job in flight. Each outcome goes back through Redis: stored under the
request's outcome key, its request id pushed onto the base model's done list. Snapshot folders are read from
the shared data dir. The worker registers itself (base model, queue, samples in flight) and
beats like a trainer worker; a dead one's jobs are sent to another sampler by the scheduler.
A streaming job's new tokens are published as the engine makes them, straight to the API replica that follows it,
and a job an API replica aborts (its caller went away) is stopped (messaging/stream_channels.py).
"""

from __future__ import annotations

import json
import pickle

import prometheus_client
from celery import signals

from contract.redis_keys import (
    RESULT_TTL_SECONDS,
    SAMPLE_TASK,
    abort_channel,
    sample_done_key,
    sample_outcome_key,
    sampler_key,
)
from messaging.celery_app import make_worker_app, register_worker
from messaging.stream_channels import encode_deltas, keep_listening
from service.settings import Settings

_state: dict = {}  # settings, client (make_worker_app), engine, ...
app = make_worker_app(Settings, _state)  # reads the settings when the worker starts, not on import


@signals.worker_ready.connect
def _start(sender=None, **_) -> None:
    """Start the engine (it loads in the background and queues jobs meanwhile), register, beat."""
    from workers.sampler.engine import SamplerConfig, SamplerEngine

    settings: Settings = _state["settings"]
    info = settings.served_model()
    engine = SamplerEngine(SamplerConfig.from_settings(settings, info)).start()
    if settings.metrics_port:
        prometheus_client.start_http_server(settings.metrics_port)
    worker_id = register_worker(_state["client"], sender, sampler_key, info.name, lambda: {
        "pending": engine.pending, "ready": engine.ready.is_set(),
        "failed": None if engine.failed is None else str(engine.failed)}, settings.worker_id)
    _state.update(engine=engine, worker_id=worker_id, done_key=sample_done_key(info.name))
    aborts = _state["client"].pubsub(ignore_subscribe_messages=True)
    aborts.subscribe(**{abort_channel(info.name): lambda message: engine.abort(message["data"].decode())})
    _state["aborts"] = aborts.run_in_thread(sleep_time=0.5, daemon=True, exception_handler=keep_listening)


@signals.worker_shutdown.connect
def _stop(**_) -> None:
    if "aborts" in _state:
        _state["aborts"].stop()
    if "engine" in _state:
        _state["engine"].close()


def _done(request_id: str, outcome) -> None:
    """Engine thread: the outcome (SampleResult or EngineError) back to the scheduler."""
    client = _state["client"]
    client.set(sample_outcome_key(request_id), pickle.dumps(outcome), ex=RESULT_TTL_SECONDS)
    client.rpush(_state["done_key"], json.dumps({"request_id": request_id, "worker_id": _state["worker_id"]}))


def _progress_to(channel: str):
    def progress(request_id: str, deltas) -> None:
        """Engine thread: a streaming job's new tokens to the API replica that follows it."""
        _state["client"].publish(channel, encode_deltas(request_id, deltas))

    return progress


@app.task(name=SAMPLE_TASK)
def sample(job_key: str) -> None:
    from contract.errors import EngineError
    from contract.sampling import SampleJob

    raw = _state["client"].get(job_key)
    if raw is None:
        return  # expired: the scheduler gave up on it long ago
    job = SampleJob.from_json(raw)
    engine = _state["engine"]
    if engine.failed is not None:
        _done(job.request_id, EngineError(f"the sampler engine failed to start: {engine.failed}"))
        return
    # a streaming job names the replica that follows it (one submitted in embedded mode and recovered
    # here would not: its caller is gone, so only its outcome is kept)
    engine.submit(job, _done, on_progress=_progress_to(job.stream_to) if job.stream and job.stream_to else None)
