"""Distributed mode: API replicas and one scheduler as separate processes, Celery workers beside them.

    python -m service api         # any number of replicas: HTTP, validation, the database, no engines
    python -m service scheduler   # exactly one per base model: orders and plans cycles, runs them on the workers
    celery -A service.celery_worker worker ...    # trainer workers (one per device)
    celery -A service.sampler_worker worker ...   # sampler workers (one per device)

All of them share one database (Postgres), one Redis and one data dir (checkpoints and adapter
state). The API stores each request and pushes it to the scheduler through Redis; the scheduler
stores every outcome and publishes it; each API replica wakes its long-polls (messaging/bus.py).
"""

from __future__ import annotations

import logging
import signal
import threading

import prometheus_client
import redis

from api.app import create_app
from api.served_models import ServedModel, ServedModels
from contract.redis_keys import scheduler_key
from db.session import make_engine, make_session_factory, upgrade_to_head
from messaging.bus import FinishedListener, FinishedPublisher, InboxConsumer, RedisInbox, RemoteSampling
from messaging.celery_app import start_heartbeat
from models.architectures import sampling_refusal
from messaging.notify import Notifier
from messaging.remote_streams import RemoteStreams
from scheduler.celery_executor import CeleryExecutor
from scheduler.janitor import Janitor
from scheduler.sampling import SamplingDispatcher
from scheduler.service import SchedulerService
from service.settings import Settings
from storage import store

log = logging.getLogger(__name__)


def _database(settings: Settings):
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    store.use_cache_dir(settings.store_cache)  # an API replica and the scheduler both start here
    upgrade_to_head(settings.resolved_database_url)
    return make_session_factory(make_engine(settings.resolved_database_url))


def build_api(settings: Settings):
    """The FastAPI app of one API replica, and the listener that wakes its long-polls."""
    sessions = _database(settings)
    client = redis.Redis.from_url(settings.redis_url)
    notifier = Notifier()
    models, channel = [], None
    for info in settings.served_models():  # each base model's requests go to its own scheduler's inbox
        inbox = RedisInbox(client, info.name)
        refusal = sampling_refusal(info.arch)
        sampling = (RemoteSampling(inbox, sessions, info.name, settings.sampler_max_pending)
                    if settings.sampler_enabled and not refusal else None)
        # `stream: true`: tokens straight from the sampler workers, on one channel of this replica, read with
        # the finishes (messaging/remote_streams.py)
        streams = RemoteStreams(client, notifier, info.name, channel) if sampling is not None else None
        channel = channel or (streams.channel if streams else None)
        models.append(ServedModel(info, inbox, sampling, refusal or "the sampler is disabled "
                                  "(LORAPLEX_SAMPLER_ENABLED=false)", streams))
    app = create_app(settings=settings, sessions_factory=sessions, notifier=notifier, models=ServedModels(models))
    streams = next((model.streams for model in models if model.streams is not None), None)
    return app, FinishedListener(client, notifier, streams)


class SchedulerProcess:
    """The scheduler: cycles to Celery trainer workers, samples to Celery sampler workers."""

    def __init__(self, settings: Settings) -> None:
        self.sessions = _database(settings)
        client = redis.Redis.from_url(settings.redis_url)
        info = settings.served_model()
        publisher = FinishedPublisher(client)
        self.executor = CeleryExecutor(settings.redis_url, info.name, settings.live_dir)
        # the database may hold other base models' runs and samples, which their own schedulers take
        self.scheduler = SchedulerService(self.sessions, self.executor, settings.cycle_token_budget, publisher,
                                          settings.cycle_gather_seconds, settings.seq_gap_seconds,
                                          settings.tenant_max_tokens_in_flight, base_model=info.name)
        self.sampling = None
        if settings.sampler_enabled and not sampling_refusal(info.arch):
            from scheduler.remote_sampler import RemoteSamplerEngine

            self.sampling = SamplingDispatcher(self.sessions, RemoteSamplerEngine(settings.redis_url, info.name),
                                               publisher, settings.sampler_max_pending, info.name)
        self.inbox = InboxConsumer(client, info.name, self.scheduler, self.sampling, self.sessions)
        self.redis, self.base_model = client, info.name
        self.janitor = Janitor(self.sessions, settings.ephemeral_snapshot_grace_seconds)

    def start(self) -> None:
        # Unfinished requests come back from the database first; copies of them still in the
        # inbox are then dropped as duplicates.
        self.scheduler.start()
        if self.sampling is not None:
            self.sampling.engine.start()
            self.sampling.recover()
        self.inbox.start()
        self.janitor.start()
        start_heartbeat(self.redis, scheduler_key(self.base_model), lambda: {"base_model": self.base_model})

    def close(self) -> None:
        self.janitor.stop()
        self.inbox.stop()
        self.scheduler.stop()
        if self.sampling is not None:
            self.sampling.close()
        self.executor.close()  # as the embedded server does: the Executor protocol's last call


def run_scheduler(settings: Settings) -> None:
    process = SchedulerProcess(settings)
    process.start()
    if settings.metrics_port:
        prometheus_client.start_http_server(settings.metrics_port)
    print(f"Loraplex scheduler for {settings.base_model} on {settings.redis_url}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    process.close()


def run_api(settings: Settings) -> None:
    import uvicorn

    app, listener = build_api(settings)
    listener.start()
    names = ", ".join(model.name for model in app.state.models.all)
    print(f"Loraplex API for {names} at http://{settings.host}:{settings.port}", flush=True)
    try:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")
    finally:
        listener.stop()
