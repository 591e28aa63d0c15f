"""The dashboard's HTML pages: server-rendered shells (Jinja2) whose scripts read the JSON API
(/dashboard/api/..., docs/dashboard.md) and poll it for live updates. The data never passes
through a template: the scripts put it on the page as text, so nothing a tenant wrote (a run's
metadata, an error text, a sampled token) can become markup."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.concurrency import run_in_threadpool

from api.dashboard.auth import Viewer, viewer_or_none
from api.dashboard.data import visible_run

HERE = Path(__file__).parent
STATIC_PATH = "/dashboard/static"
templates = Jinja2Templates(directory=HERE / "templates")  # autoescape is on for .html
router = APIRouter(prefix="/dashboard", include_in_schema=False, default_response_class=HTMLResponse)


def install(app: FastAPI) -> None:
    """The pages and their static files (styles, scripts, the vendored uPlot) on `app`."""
    app.include_router(router)
    app.mount(STATIC_PATH, StaticFiles(directory=HERE / "static"), name="dashboard-static")


async def _viewer(request: Request) -> Viewer | None:
    return await run_in_threadpool(viewer_or_none, request)  # a database lookup


def _run_status(request: Request, viewer: Viewer, run_id: str) -> int:
    """404 for a run the viewer may not see, as the JSON API answers (the page's script says why)."""
    with request.app.state.sessions() as db:
        try:
            visible_run(db, viewer, run_id)
        except HTTPException as refusal:
            return refusal.status_code
    return 200


def _page(request: Request, template: str, viewer: Viewer | None, status_code: int = 200, **context) -> Response:
    # Pages show live data: a browser's back button must not show a stale copy (or one of a logged-out session).
    response = templates.TemplateResponse(request, template, {"viewer": viewer, "static": STATIC_PATH, **context},
                                          status_code=status_code)
    response.headers["Cache-Control"] = "no-store"
    return response


def _login(request: Request, status_code: int = 200) -> Response:
    wanted = request.url.path + (f"?{request.url.query}" if request.url.query else "")  # back here after login
    return _page(request, "login.html", None, status_code, next=wanted)


async def _shell(request: Request, template: str, title: str, *, login_status: int = 401, run_id: str | None = None,
                 operators_only: bool = False, **context) -> Response:
    """A page for the viewer of the session: the login form without one (coming back here after), 403 for
    an operators' page shown to a tenant, and the page's status 404 for a run the viewer may not see."""
    viewer = await _viewer(request)
    if viewer is None:
        return _login(request, login_status)
    if operators_only and not viewer.is_admin:
        return _page(request, "forbidden.html", viewer, 403, title="Operators only")
    status = 200 if run_id is None else await run_in_threadpool(_run_status, request, viewer, run_id)
    return _page(request, template, viewer, status, title=title, run_id=run_id, **context)


@router.get("", name="dashboard")
@router.get("/", include_in_schema=False)
async def run_list(request: Request) -> Response:
    """The viewer's runs, to open one or compare several (the first page: its login form is no error)."""
    return await _shell(request, "runs.html", "Training runs", login_status=200)


@router.get("/login")
async def login_form(request: Request) -> Response:
    """Where logout lands (the form itself POSTs to /dashboard/login, api/dashboard/auth.py)."""
    if await _viewer(request) is not None:
        return RedirectResponse("/dashboard", status_code=303)
    return _page(request, "login.html", None, next="/dashboard")


@router.get("/compare")
async def compare(request: Request) -> Response:
    """Several runs' series on shared axes; the runs come as ?run=<id>&run=<id> (checked by the API)."""
    return await _shell(request, "compare.html", "Compare runs")


@router.get("/runs/{run_id}")
async def run_page(request: Request, run_id: str) -> Response:
    """One run: its charts on a shared step axis, RL groups, failed requests."""
    return await _shell(request, "run.html", f"Run {run_id}", run_id=run_id)


@router.get("/runs/{run_id}/trajectories/{session_id}")
async def trajectory_page(request: Request, run_id: str, session_id: str) -> Response:
    """One trajectory's sampled tokens as a heatmap of the sampler's logprobs, beside the trainer's."""
    return await _shell(request, "trajectory.html", f"Trajectory {session_id}", run_id=run_id, session_id=session_id)


@router.get("/usage")
async def usage_page(request: Request) -> Response:
    """Tokens trained and sampled per day, by base model."""
    return await _shell(request, "usage.html", "Tokens per day")


@router.get("/admin")
async def admin_page(request: Request) -> Response:
    """The operator's view of every tenant, the scheduler's cycles and the sampler's queue."""
    return await _shell(request, "admin.html", "Operator view", operators_only=True)
