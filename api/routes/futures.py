"""retrieve_future: long-poll a request's outcome (up to `long_poll_seconds`, then try_again)."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from api.deps import CurrentTenant
from db.models import Request as RequestRow
from db.models import RequestState

router = APIRouter()
FINISHED = (RequestState.DONE, RequestState.FAILED)
# A long-poll wakes when the scheduler says the request finished, and re-reads the database at
# least this often anyway: a wake-up lost between processes (scheduler/bus.py) only delays.
RECHECK_SECONDS = 2.0


class RetrieveFuture(BaseModel):
    request_id: str
    allow_metadata_only: bool = False


def _load(request: Request, request_id: str) -> RequestRow | None:
    with request.app.state.sessions() as s:
        row = s.get(RequestRow, request_id)
        if row is not None:
            s.expunge(row)
        return row


@router.post("/retrieve_future")
async def retrieve_future(body: RetrieveFuture, request: Request, tenant: CurrentTenant) -> Response:
    deadline = time.monotonic() + request.app.state.settings.long_poll_seconds
    with request.app.state.notifier.watch(body.request_id) as finished:
        while True:
            row = await run_in_threadpool(_load, request, body.request_id)
            if row is None or row.tenant_id != tenant.id:
                raise HTTPException(404, f"request_id: no request {body.request_id!r}")
            if row.state in FINISHED:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return JSONResponse({"type": "try_again", "request_id": row.id, "queue_state": "active"})
            try:
                await asyncio.wait_for(finished.wait(), timeout=min(remaining, RECHECK_SECONDS))
            except asyncio.TimeoutError:
                pass
            finished.clear()
    if row.error is not None:
        return JSONResponse(row.error)
    return Response(row.result, media_type=row.result_content_type)
