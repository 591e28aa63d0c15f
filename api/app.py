"""The FastAPI application: Tinker routes under /api/v1, state injected by whoever runs it."""

from __future__ import annotations

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.routes import futures, runs, sampling, service, sessions, training


def create_app(*, settings, sessions_factory, scheduler, notifier, model_info, sampling_dispatcher=None,
               sampling_unavailable: str = "") -> FastAPI:
    """`scheduler` needs only `.submit(QueuedRequest)`; `model_info` describes the served base model;
    `sampling_dispatcher` serves asample (None, with the reason, where this server cannot sample)."""
    app = FastAPI(title="Loraplex", version="0.1.0")
    app.state.settings = settings
    app.state.sessions = sessions_factory
    app.state.scheduler = scheduler
    app.state.notifier = notifier
    app.state.model_info = model_info
    app.state.sampling = sampling_dispatcher
    app.state.sampling_unavailable = sampling_unavailable
    app.state.served_names = served_names(model_info.name)
    for module in (service, sessions, training, futures, sampling, runs):
        app.include_router(module.router, prefix="/api/v1")

    @app.get("/metrics", include_in_schema=False)
    def prometheus_metrics() -> Response:
        """This process's Prometheus metrics (scheduler/metrics.py): cycles, batching, sampler steps."""
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.middleware("http")
    async def limit_body_size(request: Request, call_next):
        # Refuse oversized bodies from their declared length, before reading them.
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > settings.max_request_bytes:
            return JSONResponse(status_code=413, content={
                "detail": f"body: {length} bytes exceed the limit of {settings.max_request_bytes}"})
        return await call_next(request)

    return app


def served_names(name: str) -> set[str]:
    from workers.models.registry import ALIASES

    return {name} | {alias for alias, target in ALIASES.items() if target == name}
