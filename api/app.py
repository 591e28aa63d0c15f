"""The FastAPI application: Tinker routes under /api/v1, state injected by whoever runs it."""

from __future__ import annotations

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import Headers

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

    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    return app


class BodySizeLimit:
    """Refuses a body larger than `max_bytes` from its declared length, before reading it (HTTP 413).
    A plain ASGI middleware: Starlette's BaseHTTPMiddleware (`@app.middleware`) costs a task
    group and a stream per request."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            length = Headers(scope=scope).get("content-length")
            if length and length.isdigit() and int(length) > self.max_bytes:
                response = JSONResponse(status_code=413, content={
                    "detail": f"body: {length} bytes exceed the limit of {self.max_bytes}"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def served_names(name: str) -> set[str]:
    from workers.models.registry import ALIASES

    return {name} | {alias for alias, target in ALIASES.items() if target == name}
