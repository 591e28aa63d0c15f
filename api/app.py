"""The FastAPI application: Tinker routes under /api/v1, state injected by whoever runs it."""

from __future__ import annotations

from fastapi import FastAPI

from api.routes import futures, runs, sampling, service, sessions, training


def create_app(*, settings, sessions_factory, scheduler, notifier, model_info) -> FastAPI:
    """`scheduler` needs only `.submit(QueuedRequest)`; `model_info` describes the served base model."""
    app = FastAPI(title="Loraplex", version="0.1.0")
    app.state.settings = settings
    app.state.sessions = sessions_factory
    app.state.scheduler = scheduler
    app.state.notifier = notifier
    app.state.model_info = model_info
    app.state.served_names = served_names(model_info.name)
    for module in (service, sessions, training, futures, sampling, runs):
        app.include_router(module.router, prefix="/api/v1")
    return app


def served_names(name: str) -> set[str]:
    from workers.models.registry import ALIASES

    return {name} | {alias for alias, target in ALIASES.items() if target == name}
