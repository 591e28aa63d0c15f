"""The FastAPI application: Tinker routes under /api/v1, the OpenAI-compatible inference API under
/oai/api/v1 (api/inference/), state injected by whoever runs it."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.inference import anthropic_api, openai_api, responses_api
from api.inference.keys import BearerAsApiKey
from api.public_errors import MAX_ERROR_CHARS, public_error
from api.request_guard import RequestGuard
from api.dashboard import json_routers as dashboard_routers
from api.dashboard.pages import install as install_dashboard_pages
from api.auth_tokens import issuer_from
from api.routes import (
    auth, copies, external_weights, futures, projects, reports, rollouts, run_metrics, runs, sampling, service,
    sessions, tokenizers, training, unsupported,
)
from api.routes import session_search, session_trace
from api.served_models import ServedModels

log = logging.getLogger(__name__)


def create_app(*, settings, sessions_factory, notifier, models: ServedModels) -> FastAPI:
    """`models`: the base models served, each with its scheduler (anything with `.submit(QueuedRequest)`)
    and sampler (api/served_models.py)."""
    app = FastAPI(title="Loraplex", version="0.1.0")
    app.state.settings = settings
    app.state.sessions = sessions_factory
    app.state.notifier = notifier
    app.state.models = models
    app.state.tokens = issuer_from(settings)  # None: plain API keys only (jwt_auth off)
    for module in (service, auth, sessions, projects, training, copies, futures, sampling, runs, external_weights,
                   reports, run_metrics, unsupported, tokenizers, rollouts):
        app.include_router(module.router, prefix="/api/v1")
    for module in (session_search, session_trace):  # sessions looked back at: search, Perfetto traces
        app.include_router(module.router, prefix="/api/v1")
    app.include_router(responses_api.router)  # before openai_api's catch-all under the same prefix
    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    for router in dashboard_routers():  # /dashboard: login and the JSON API (docs/dashboard.md)
        app.include_router(router)
    install_dashboard_pages(app)  # the pages on that API, and their static files

    @app.get("/metrics", include_in_schema=False)
    def prometheus_metrics() -> Response:
        """This process's Prometheus metrics (scheduler/metrics.py): cycles, batching, sampler steps."""
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
    app.add_middleware(RequestGuard, max_bytes=settings.max_request_bytes)
    app.add_middleware(BearerAsApiKey)  # outside the guard: it reads the key a bearer token carries
    return app


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 naming each invalid field and what is wrong with it. FastAPI's own answer echoes the
    input, which made a 60 MB body a 377 MB answer and a NaN in it a 500 (JSON cannot hold NaN)."""
    problems = []
    for error in exc.errors():
        if error.get("type") == "json_invalid":  # its loc is (body, character position)
            problems.append(f"body: not valid JSON at character {error['loc'][-1]}")
            continue
        where = [str(part)[:64] for part in error.get("loc", ()) if part != "body"]
        problems.append(f"{'.'.join(where) or 'body'}: {error.get('msg', 'invalid')}")
    return JSONResponse(status_code=422, content={"detail": "; ".join(problems)[:MAX_ERROR_CHARS]})


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """A refusal raised by a route (or 404/405 from routing): shortened (a detail may quote an id) and
    with store locations shown as tinker:// paths (api/public_errors.py)."""
    headers = getattr(exc, "headers", None)
    settings = request.app.state.settings
    detail = public_error(str(exc.detail), settings.checkpoint_dir, settings.store_root)
    return JSONResponse(status_code=exc.status_code, content={"detail": detail[:MAX_ERROR_CHARS]}, headers=headers)


async def server_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug, not the caller's fault: logged here in full, answered without internals."""
    log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(status_code=500, content={"detail": "internal server error"})
