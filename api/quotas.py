"""Quotas, checked before a request changes anything: 403 naming the limit for hard limits
(models, rank, tokens per day, storage), 429 with Retry-After for concurrency."""

from __future__ import annotations

from fastapi import HTTPException
from sqlalchemy.orm import Session

from db import usage
from db.models import Quota


def _quota(db: Session, tenant_id: str) -> Quota | None:
    """The tenant's limits, read once per database session (one request checks several; most
    tenants have no row, and the session's identity map does not remember a miss)."""
    key = ("quota", tenant_id)
    if key not in db.info:
        db.info[key] = db.get(Quota, tenant_id)
    return db.info[key]


def _refuse(limit: str, value: int, detail: str) -> HTTPException:
    return HTTPException(403, f"quota {limit}={value} would be exceeded: {detail}")


def check_concurrency(db: Session, tenant_id: str) -> None:
    quota = _quota(db, tenant_id)
    if quota is None or quota.max_concurrent_requests is None:
        return
    in_flight = usage.requests_in_flight(db, tenant_id)
    if in_flight >= quota.max_concurrent_requests:
        raise HTTPException(429, f"quota max_concurrent_requests={quota.max_concurrent_requests} reached: "
                                 f"{in_flight} requests in flight; retry when one finishes",
                            headers={"Retry-After": "1"})


def check_new_model(db: Session, tenant_id: str, rank: int) -> None:
    quota = _quota(db, tenant_id)
    if quota is None:
        return
    if quota.max_lora_rank is not None and rank > quota.max_lora_rank:
        raise _refuse("max_lora_rank", quota.max_lora_rank, f"rank {rank} requested")
    if quota.max_live_models is not None:
        live = usage.live_models(db, tenant_id)
        if live >= quota.max_live_models:
            raise _refuse("max_live_models", quota.max_live_models, f"{live} live models already")


def _check_daily_tokens(db: Session, tenant_id: str, limit: str, count_used, tokens: int, what: str) -> None:
    quota = _quota(db, tenant_id)
    allowed = getattr(quota, limit) if quota is not None else None
    if allowed is None:
        return
    used = count_used(db, tenant_id, usage.day_start())
    if used + tokens > allowed:
        raise _refuse(limit, allowed, f"{used} tokens {what} today, this request up to {tokens}")


def check_training_tokens(db: Session, tenant_id: str, tokens: int) -> None:
    _check_daily_tokens(db, tenant_id, "train_tokens_per_day", usage.tokens_trained, tokens, "trained")


def check_sampling_tokens(db: Session, tenant_id: str, tokens: int) -> None:
    """`tokens`: the prompt tokens and the most this request can generate."""
    _check_daily_tokens(db, tenant_id, "sample_tokens_per_day", usage.tokens_sampled, tokens, "sampled")


def check_storage(db: Session, tenant_id: str) -> None:
    quota = _quota(db, tenant_id)
    if quota is None or quota.max_checkpoint_bytes is None:
        return
    used = usage.storage_bytes(db, tenant_id)
    if used >= quota.max_checkpoint_bytes:
        raise _refuse("max_checkpoint_bytes", quota.max_checkpoint_bytes, f"{used} bytes of checkpoints stored")
