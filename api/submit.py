"""Accepting a heavy request: store it durably, hand it to the scheduler, answer with its id.

A retry of an already accepted (model_id, seq_id) returns the original request id, so a request
whose response was lost is never run twice. A request refused at the door (bad input, a hard
quota) still used up its seq_id on the client: it is recorded as a failed request, so the model's
later requests do not wait for it forever. A 429 is not recorded: the client retries that seq_id.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable

import sqlalchemy as sa
from fastapi import HTTPException
from fastapi import Request as HttpRequest
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.quotas import check_concurrency
from db.models import Request, new_id
from scheduler.ordering import REJECTED, QueuedRequest


def submit(
    http: HttpRequest, db: Session, *, tenant_id: str, model_id: str | None, seq_id: int | None, kind: str,
    payload: bytes, content_type: str = "application/json", num_tokens: int = 0,
    request_id: str | None = None, dispatch: Callable[[], None] | None = None,
) -> dict[str, str]:
    """Store the request and queue it: on the trainer scheduler, or through `dispatch` (samples)."""
    if kind != REJECTED:
        check_concurrency(db, tenant_id)
    row = Request(
        id=request_id or new_id(), tenant_id=tenant_id, model_id=model_id, seq_id=seq_id, kind=kind, payload=payload,
        payload_content_type=content_type, num_tokens=num_tokens,
    )
    db.add(row)
    try:
        db.commit()
    except IntegrityError:  # (model_id, seq_id) was accepted before: a retry gets the original request
        db.rollback()
        existing = db.scalar(sa.select(Request.id).where(Request.model_id == model_id, Request.seq_id == seq_id))
        return {"request_id": existing, "model_id": model_id}
    if dispatch is not None:
        dispatch()
    else:
        http.app.state.scheduler.submit(QueuedRequest(row.id, tenant_id, model_id, seq_id, kind, num_tokens))
    return {"request_id": row.id, "model_id": model_id}


@contextmanager
def seq_id_used_even_if_refused(http: HttpRequest, db: Session, tenant_id: str, model_id: str, seq_id: int) -> Iterator[None]:
    """Around the checks of a request of an owned model with a valid seq_id."""
    try:
        yield
    except HTTPException as e:
        if 400 <= e.status_code < 500 and e.status_code != 429:
            db.rollback()
            error = {"error": str(e.detail), "category": "user", "status": e.status_code}
            submit(http, db, tenant_id=tenant_id, model_id=model_id, seq_id=seq_id, kind=REJECTED,
                   payload=json.dumps(error).encode())
        raise
