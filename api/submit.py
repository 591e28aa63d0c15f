"""Accepting a heavy request: store it durably, hand it to the scheduler, answer with its id.

A retry of an already accepted (model_id, seq_id) returns the original request id, so a request
whose response was lost is never run twice. The same holds for a seq_id the scheduler skipped
because it never arrived (scheduler/service.py): a late arrival gets that skipped request, whose
future fails saying so; it never runs after the requests that went on without it.

A training request's seq_id must lie in its model's window: after the model's last applied
seq_id and at most `MAX_SEQ_AHEAD` beyond it. A seq_id far ahead would otherwise wait, and after
`seq_gap_seconds` make the scheduler skip every real seq_id before it.
"""

from __future__ import annotations

from typing import Callable

import sqlalchemy as sa
from fastapi import HTTPException
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.quotas import check_concurrency
from contract.kinds import RequestKind
from contract.queue import JSON, QueuedRequest
from db.models import Request, TrainingModel, new_id


# The SDK sends one model's requests one at a time, except the chunks of one large
# forward_backward (at most a few hundred for any batch that fits a quota): 1,024 leaves room.
MAX_SEQ_AHEAD = 1024


def seq_window(db: Session, model_id: str) -> tuple[int, int] | None:
    """The (lowest, highest) seq_id a model accepts now, None for a model that does not exist.
    Its lowest is one after its last applied: a lower one is a retry, found by its (model_id, seq_id)."""
    applied = db.scalar(sa.select(TrainingModel.last_applied_seq_id).where(TrainingModel.id == model_id))
    return None if applied is None else (applied + 1, applied + MAX_SEQ_AHEAD)


def check_seq_id(db: Session, model_id: str, seq_id: int) -> None:
    window = seq_window(db, model_id)
    if window is not None and seq_id > window[1]:
        raise HTTPException(400, f"seq_id: {seq_id} is more than {MAX_SEQ_AHEAD} beyond the model's next "
                                 f"expected seq_id {window[0]}")


def submit(
    scheduler, db: Session, *, tenant_id: str, model_id: str | None, seq_id: int | None, kind: RequestKind,
    payload: bytes, content_type: str = JSON, num_tokens: int = 0,
    request_id: str | None = None, dispatch: Callable[[], None] | None = None, error: dict[str, str] | None = None,
) -> dict[str, str]:
    """Store the request and queue it: on the trainer `scheduler` (anything with
    `.submit(QueuedRequest)`), or through `dispatch` (samples). A request stored with its `error`
    (a refusal) runs nothing: the scheduler fails it when its seq_id's turn comes."""
    if kind != RequestKind.REJECTED:
        check_concurrency(db, tenant_id)
        if dispatch is None and seq_id is not None and seq_id > 0:
            check_seq_id(db, model_id, seq_id)
    row = Request(
        id=request_id or new_id(), tenant_id=tenant_id, model_id=model_id, seq_id=seq_id, kind=kind, payload=payload,
        payload_content_type=content_type, num_tokens=num_tokens, error=error,
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
        scheduler.submit(QueuedRequest(row.id, tenant_id, model_id, seq_id, kind, num_tokens))
    return {"request_id": row.id, "model_id": model_id}
