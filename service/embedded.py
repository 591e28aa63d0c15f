"""Embedded mode: API + scheduler + trainer engine in one process, SQLite and local checkpoints.

    .venv/bin/python -m service serve [--base-model tiny] [--port 8000] [--data-dir data]

The same scheduler and engine code as the distributed mode; only the transport differs (an
in-process executor instead of Celery workers).
"""

from __future__ import annotations

import importlib.util
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa
import torch
from fastapi import FastAPI
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from contract.executor import Executor
from db.models import Tenant
from db.session import make_engine, make_session_factory, upgrade_to_head
from db.tenants import create_tenant
from messaging.notify import Notifier
from models.architectures import sampling_refusal
from scheduler.janitor import Janitor
from scheduler.sampling import SamplingDispatcher
from scheduler.service import SchedulerService
from service.settings import Settings
from storage import store
from workers.compute_thread import ComputeThread, run_on
from workers.sampler.engine import SamplerConfig, SamplerEngine
from workers.trainer import residency
from workers.trainer.engine import TrainerEngine
from workers.trainer.executor import InProcessExecutor
from workers.trainer.process_executor import ProcessExecutor


@dataclass
class EmbeddedServer:
    app: FastAPI
    scheduler: SchedulerService
    executor: Executor  # InProcessExecutor, ProcessExecutor or CeleryExecutor
    sessions: sessionmaker[Session]
    sampling: SamplingDispatcher | None = None
    compute: ComputeThread | None = None  # the trainer's and the sampler's torch work, taking turns
    janitor: Janitor | None = None
    unpublish_residency: Callable[[], None] | None = None  # an engine here: its residency is at /metrics

    def start(self) -> None:
        self.scheduler.start()
        if self.janitor is not None:
            self.janitor.start()
        if self.sampling is not None:
            self.sampling.engine.start()  # in the background: the API answers while vLLM loads
            self.sampling.recover()

    def close(self) -> None:
        if self.janitor is not None:
            self.janitor.stop()
        self.scheduler.stop()
        if self.sampling is not None:
            self.sampling.close()
        self.executor.close()  # (an in-process one finishes writing durable states)
        if self.unpublish_residency is not None:
            self.unpublish_residency()
        if self.compute is not None:
            self.compute.close()


def build_sampling(settings: Settings, info, sessions, notifier: Notifier,
                   compute: ComputeThread | None = None) -> tuple[SamplingDispatcher | None, str]:
    """The sampling dispatcher and its (not yet started) vLLM engine, or None and why not."""
    if not settings.sampler_enabled:
        return None, "the sampler is disabled (LORAPLEX_SAMPLER_ENABLED=false)"
    if refusal := sampling_refusal(info.arch):
        return None, refusal
    if importlib.util.find_spec("vllm") is None:
        return None, "vLLM is not installed (pip install -e '.[sampler-cpu]', or '.[sampler-gpu]' on a GPU machine)"
    engine = SamplerEngine(SamplerConfig.from_settings(settings, info), compute)
    return SamplingDispatcher(sessions, engine, notifier, settings.sampler_max_pending), ""


def build(settings: Settings) -> EmbeddedServer:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    store.use_cache_dir(settings.store_cache)
    url = settings.resolved_database_url
    upgrade_to_head(url)
    sessions = make_session_factory(make_engine(url))
    # the in-process trainer and the sampler share one compute thread (one OpenMP team); a model
    # built on first use (registry) is built there too
    one_thread = settings.compute_thread if settings.compute_thread is not None else not torch.cuda.is_available()
    compute = ComputeThread() if one_thread else None
    info = run_on(compute, settings.served_model)
    live_dir = settings.live_dir
    if settings.executor == "celery":  # trainer workers elsewhere; live_dir must be on a shared store
        from scheduler.celery_executor import CeleryExecutor

        executor = CeleryExecutor(settings.redis_url, info.name, live_dir)
    elif settings.engine_process:
        executor = ProcessExecutor(info.path, settings.max_lora_rank, live_dir, max_resident=settings.max_resident_adapters,
                                   memory_budget=(settings.trainer_memory_budget, settings.trainer_memory_fraction),
                                   state_write_interval=settings.state_write_interval_seconds,
                                   min_shared_prefix=settings.trainer_min_shared_prefix,
                                   keep_glibc_malloc_defaults=settings.keep_glibc_malloc_defaults,
                                   prefetch_bytes=settings.trainer_prefetch_bytes)
    else:
        engine = run_on(compute, lambda: TrainerEngine(info.path, max_rank=settings.max_lora_rank,
                                                       min_shared_prefix=settings.trainer_min_shared_prefix,
                                                       keep_glibc_malloc_defaults=settings.keep_glibc_malloc_defaults),
                        work="trainer")
        executor = InProcessExecutor(engine, live_dir, settings.max_resident_adapters,
                                     settings.state_write_interval_seconds, compute,
                                     memory_budget=residency.memory_budget(settings.trainer_memory_budget,
                                                                           settings.trainer_memory_fraction,
                                                                           engine.device),
                                     prefetch_bytes=settings.trainer_prefetch_bytes)
    notifier = Notifier()
    scheduler = SchedulerService(sessions, executor, settings.cycle_token_budget, notifier,
                                 settings.cycle_gather_seconds, settings.seq_gap_seconds,
                                 settings.tenant_max_tokens_in_flight)
    sampling, unavailable = build_sampling(settings, info, sessions, notifier, compute)
    app = create_app(settings=settings, sessions_factory=sessions, scheduler=scheduler, notifier=notifier,
                     model_info=info, sampling_dispatcher=sampling, sampling_unavailable=unavailable)
    janitor = Janitor(sessions, settings.ephemeral_snapshot_grace_seconds)
    unpublish = None if settings.executor == "celery" else residency.publish(executor.residency_stats)
    return EmbeddedServer(app, scheduler, executor, sessions, sampling, compute, janitor, unpublish)


def ensure_default_tenant(sessions) -> str | None:
    """Create the tenant "default" on first start; return its new key (None if it existed)."""
    with sessions() as s:
        if s.scalar(sa.select(Tenant).where(Tenant.name == "default")) is not None:
            return None
        _, key = create_tenant(s, "default")
        return key


def free_port() -> int:
    """A free TCP port on loopback (for tests and benchmarks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """An embedded server on a background thread (tests, benchmarks, notebooks)."""

    def __init__(self, settings: Settings) -> None:
        import uvicorn

        self.settings = settings
        self.embedded = build(settings)
        self.embedded.start()
        config = uvicorn.Config(self.embedded.app, host=settings.host, port=settings.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.base_url = f"http://{settings.host}:{settings.port}"

    def new_tenant(self, name: str | None = None) -> str:
        """Create a tenant and return its API key."""
        with self.embedded.sessions() as s:
            _, key = create_tenant(s, name or f"tenant-{uuid.uuid4().hex[:8]}")
        return key

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self.embedded.close()


def serve(settings: Settings) -> None:
    import uvicorn

    server = build(settings)
    key = ensure_default_tenant(server.sessions)
    server.start()
    base_url = f"http://{settings.host}:{settings.port}"
    print(f"Loraplex serving {settings.base_model} at {base_url}")
    if key:
        print(f"API key of tenant 'default' (shown once): {key}")
    else:
        print("tenant 'default' exists; issue another key with: .venv/bin/loraplex-admin keys issue default")
    print(f"  import tinker; tinker.ServiceClient(base_url={base_url!r}, api_key=...)")
    try:
        uvicorn.run(server.app, host=settings.host, port=settings.port, log_level="warning")
    finally:
        server.close()
