"""retrieve_future: long-poll a request's outcome (up to `long_poll_seconds`, then try_again)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.deps import ApiKeyHeader, TenantRef, in_tenant_session
from api.input_policy import Id
from api.public_errors import public_error
from contract.kinds import RequestKind
from db.models import Request as RequestRow
from db.models import RequestState
from messaging.notify import Answer, Watch

router = APIRouter()
FINISHED = (RequestState.DONE, RequestState.FAILED)
# A long-poll wakes when the scheduler says the request finished, and re-reads the database at
# least this often anyway: a wake-up lost between processes (messaging/bus.py) only delays.
RECHECK_SECONDS = 2.0


async def wait_for_answer(watch: Watch, deadline: float, reread: Callable[[], Awaitable[Answer | None]],
                          check: Callable[[], Awaitable[None]] | None = None) -> Answer | None:
    """Wait until the watched request finishes: its answer, or None once `deadline` (time.monotonic)
    passes. `check` runs before each wait (e.g. raise when the caller went away)."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        if check is not None:
            await check()
        try:
            await asyncio.wait_for(watch.finished.wait(), timeout=min(remaining, RECHECK_SECONDS))
        except asyncio.TimeoutError:
            pass
        watch.finished.clear()
        # the scheduler of this process hands over the committed answer; other wake-ups re-read it
        answer = watch.answer or await reread()
        if answer is not None:
            return answer


class RetrieveFuture(BaseModel):
    request_id: Id
    allow_metadata_only: bool = False


def _stored(db: Session, request_id: str):
    return db.execute(
        sa.select(RequestRow.tenant_id, RequestRow.state, RequestRow.result, RequestRow.result_content_type,
                  RequestRow.error).where(RequestRow.id == request_id)
    ).first()


def _answer_if_finished(row) -> Answer | None:
    return Answer.of_row(row) if row.state in FINISHED else None


def _owned_answer(db: Session, tenant: TenantRef, request_id: str) -> Answer | None:
    row = _stored(db, request_id)
    if row is None or row.tenant_id != tenant.id:
        raise HTTPException(404, f"request_id: no request {request_id!r}")
    return _answer_if_finished(row)


def _reread(request: Request, request_id: str) -> Answer | None:
    with request.app.state.sessions() as db:
        return _answer_if_finished(_stored(db, request_id))


def _queue_position(request: Request, request_id: str) -> int | None:
    """How many unfinished requests of its queue (training, or sampling) were accepted before this one, of
    every tenant: a count, never whose. None once it finished."""
    with request.app.state.sessions() as db:
        row = db.execute(sa.select(RequestRow.kind, RequestRow.state, RequestRow.created_at)
                         .where(RequestRow.id == request_id)).first()
        if row is None or row.state in FINISHED:
            return None
        same_queue = RequestRow.kind == RequestKind.SAMPLE if row.kind == RequestKind.SAMPLE \
            else RequestRow.kind != RequestKind.SAMPLE
        return db.scalar(sa.select(sa.func.count()).select_from(RequestRow).where(
            RequestRow.state.in_([RequestState.PENDING, RequestState.RUNNING]), same_queue,
            RequestRow.created_at < row.created_at))


@router.post("/retrieve_future")
async def retrieve_future(body: RetrieveFuture, request: Request, x_api_key: ApiKeyHeader = None) -> Response:
    deadline = time.monotonic() + request.app.state.settings.long_poll_seconds
    with request.app.state.notifier.watch(body.request_id) as watch:
        answer = await in_tenant_session(request, x_api_key, lambda db, tenant: _owned_answer(db, tenant, body.request_id))
        if answer is None:
            answer = await wait_for_answer(watch, deadline,
                                           lambda: run_in_threadpool(_reread, request, body.request_id))
        if answer is None:
            ahead = await run_in_threadpool(_queue_position, request, body.request_id)
            waiting = {} if ahead is None else {"queue_position": ahead,
                                                "queue_state_reason": f"{ahead} requests accepted before it are unfinished"}
            return JSONResponse({"type": "try_again", "request_id": body.request_id, "queue_state": "active", **waiting})
    if answer.error is not None:
        settings = request.app.state.settings
        error = dict(answer.error, error=public_error(str(answer.error.get("error", "")), settings.checkpoint_dir,
                                                      settings.store_root))
        return JSONResponse(error)
    return Response(answer.result, media_type=answer.content_type)
