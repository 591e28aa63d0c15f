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
from api.served_models import ServedModel, ServedModels
from contract.executor import Executor
from db.models import Tenant
from db.session import make_engine, make_session_factory, upgrade_to_head
from db.tenants import create_tenant
from messaging.notify import Notifier
from models.architectures import sampling_refusal
from models.registry import ModelInfo, ModelUnavailable
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
class ModelStack:
    """One served base model's scheduler, trainer executor and sampler in this process."""

    info: ModelInfo
    scheduler: SchedulerService
    executor: Executor  # InProcessExecutor, ProcessExecutor or CeleryExecutor
    sampling: SamplingDispatcher | None = None
    sampling_unavailable: str = ""  # why `sampling` is None
    unpublish_residency: Callable[[], None] | None = None  # an engine here: its residency is at /metrics

    def served(self) -> ServedModel:
        return ServedModel(self.info, self.scheduler, self.sampling, self.sampling_unavailable)


@dataclass
class EmbeddedServer:
    app: FastAPI
    stacks: list[ModelStack]  # one per base model served, the default first
    sessions: sessionmaker[Session]
    compute: ComputeThread | None = None  # every trainer's and sampler's torch work, taking turns
    janitor: Janitor | None = None

    # the default base model's (the only one's, on most servers)
    @property
    def scheduler(self) -> SchedulerService:
        return self.stacks[0].scheduler

    @property
    def executor(self) -> Executor:
        return self.stacks[0].executor

    @property
    def sampling(self) -> SamplingDispatcher | None:
        return self.stacks[0].sampling

    def start(self) -> None:
        for stack in self.stacks:
            stack.scheduler.start()
        if self.janitor is not None:
            self.janitor.start()
        for stack in self.stacks:
            if stack.sampling is not None:
                stack.sampling.engine.start()  # in the background: the API answers while vLLM loads
                stack.sampling.recover()

    def close(self) -> None:
        if self.janitor is not None:
            self.janitor.stop()
        for stack in self.stacks:
            stack.scheduler.stop()
            if stack.sampling is not None:
                stack.sampling.close()
            stack.executor.close()  # (an in-process one finishes writing durable states)
            if stack.unpublish_residency is not None:
                stack.unpublish_residency()
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
    return SamplingDispatcher(sessions, engine, notifier, settings.sampler_max_pending, info.name), ""


def shared_by(settings: Settings, models: int) -> Settings:
    """`settings` for one of `models` base models served side by side: each trainer and sampler gets an
    even share of the memory budgets (docs/models.md#several-base-models)."""
    if models == 1:
        return settings

    def share(value):
        return None if value is None else int(value) // models

    return settings.model_copy(update={
        "trainer_memory_budget": share(settings.trainer_memory_budget),
        "trainer_memory_fraction": settings.trainer_memory_fraction / models,
        "trainer_prefetch_bytes": share(settings.trainer_prefetch_bytes),
        "sampler_memory_budget": share(settings.sampler_memory_budget),
        "sampler_memory_fraction": settings.sampler_memory_fraction / models,
    })


def build_executor(settings: Settings, info: ModelInfo, compute: ComputeThread | None) -> Executor:
    """Where `info`'s runs train: Celery workers, an engine process, or an engine in this process."""
    live_dir = settings.live_dir
    if settings.executor == "celery":  # trainer workers elsewhere; live_dir must be on a shared store
        from scheduler.celery_executor import CeleryExecutor

        return CeleryExecutor(settings.redis_url, info.name, live_dir)
    if settings.engine_process:
        return ProcessExecutor(info.path, settings.max_lora_rank, live_dir, max_resident=settings.max_resident_adapters,
                               memory_budget=(settings.trainer_memory_budget, settings.trainer_memory_fraction),
                               state_write_interval=settings.state_write_interval_seconds,
                               min_shared_prefix=settings.trainer_min_shared_prefix,
                               keep_glibc_malloc_defaults=settings.keep_glibc_malloc_defaults,
                               prefetch_bytes=settings.trainer_prefetch_bytes)
    engine = run_on(compute, lambda: TrainerEngine(info.path, max_rank=settings.max_lora_rank,
                                                   min_shared_prefix=settings.trainer_min_shared_prefix,
                                                   keep_glibc_malloc_defaults=settings.keep_glibc_malloc_defaults),
                    work="trainer")
    return InProcessExecutor(engine, live_dir, settings.max_resident_adapters,
                             settings.state_write_interval_seconds, compute,
                             memory_budget=residency.memory_budget(settings.trainer_memory_budget,
                                                                   settings.trainer_memory_fraction, engine.device),
                             prefetch_bytes=settings.trainer_prefetch_bytes)


def build(settings: Settings) -> EmbeddedServer:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    store.use_cache_dir(settings.store_cache)
    url = settings.resolved_database_url
    upgrade_to_head(url)
    sessions = make_session_factory(make_engine(url))
    # the in-process trainers and samplers share one compute thread (one OpenMP team); a model
    # built on first use (registry) is built there too. Several base models' vLLM engines must take
    # turns on it anyway: vLLM keeps the forward context of the step it runs in a process-wide global.
    several = len(settings.base_models) > 1
    if several and settings.compute_thread is False and settings.sampler_enabled:
        raise ModelUnavailable("compute_thread: several base models' samplers in one process take turns on one "
                               "compute thread (vLLM's forward context is process-wide); leave it on")
    one_thread = settings.compute_thread if settings.compute_thread is not None else \
        several or not torch.cuda.is_available()
    compute = ComputeThread() if one_thread else None
    infos = run_on(compute, settings.served_models)
    notifier = Notifier()
    stacks = []
    for info in infos:
        own = shared_by(settings, len(infos))
        executor = build_executor(own, info, compute)
        # each recovers only its own model's requests: the database may hold others' (served now or before)
        scheduler = SchedulerService(sessions, executor, own.cycle_token_budget, notifier,
                                     own.cycle_gather_seconds, own.seq_gap_seconds, own.tenant_max_tokens_in_flight,
                                     base_model=info.name)
        sampling, unavailable = build_sampling(own, info, sessions, notifier, compute)
        unpublish = None if own.executor == "celery" else residency.publish(executor.residency_stats)
        stacks.append(ModelStack(info, scheduler, executor, sampling, unavailable, unpublish))
    app = create_app(settings=settings, sessions_factory=sessions, notifier=notifier,
                     models=ServedModels([stack.served() for stack in stacks]))
    janitor = Janitor(sessions, settings.ephemeral_snapshot_grace_seconds)
    return EmbeddedServer(app, stacks, sessions, compute, janitor)


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
    names = ", ".join(stack.info.name for stack in server.stacks)
    print(f"Loraplex serving {names} at {base_url}")
    if key:
        print(f"API key of tenant 'default' (shown once): {key}")
    else:
        print("tenant 'default' exists; issue another key with: .venv/bin/loraplex-admin keys issue default")
    print(f"  import tinker; tinker.ServiceClient(base_url={base_url!r}, api_key=...)")
    try:
        uvicorn.run(server.app, host=settings.host, port=settings.port, log_level="warning")
    finally:
        server.close()
