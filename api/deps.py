"""FastAPI dependencies: the database session and the tenant behind the X-API-Key header.

The hot routes (forward_backward, optim_step, retrieve_future) authenticate inside the one
worker-thread call that does their database work (`in_tenant_session`): FastAPI runs each sync
dependency in the thread pool on its own, and every hand-off waits for the GIL on a busy server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Callable, Iterator, TypeVar

import sqlalchemy as sa
from fastapi import Depends, Header, HTTPException, Query, Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.auth_tokens import INVALID_TOKEN, TokenIssuer, looks_like_jwt
from db.models import ApiKey, Tenant
from db.tenants import hash_key

T = TypeVar("T")


@dataclass(frozen=True)
class TenantRef:
    """The authenticated caller: most routes only need its id; the audit log and the token
    exchange need the key it authenticated with."""

    id: str
    key_id: str | None = None
    key_prefix: str | None = None


# Columns, not ORM entities: half the cost of loading a Tenant, on every authenticated call.
_KEY_COLUMNS = sa.select(Tenant.id, Tenant.disabled, ApiKey.id.label("key_id"), ApiKey.key_prefix) \
    .join(ApiKey, ApiKey.tenant_id == Tenant.id).where(ApiKey.revoked_at.is_(None))
_KEY_LOOKUP = _KEY_COLUMNS.where(ApiKey.key_hash == sa.bindparam("key_hash"))
# A token (api/auth_tokens.py) names its key by id: that key must still be live, in the token's tenant.
_TOKEN_KEY_LOOKUP = _KEY_COLUMNS.where(ApiKey.id == sa.bindparam("key_id"), Tenant.id == sa.bindparam("tenant_id"))

# A route parameter named `x_api_key` of this type reads the X-API-Key header.
ApiKeyHeader = Annotated[str | None, Header()]


# Page bounds of the list routes: a database cannot count past 2**63 (10**30 gave a 500).
Limit = Annotated[int, Query(ge=1, le=1000)]
Offset = Annotated[int, Query(ge=0, le=2**62)]


def db_session(request: Request) -> Iterator[Session]:
    with request.app.state.sessions() as session:
        yield session


DB = Annotated[Session, Depends(db_session)]


def tenant_of_key(db: Session, api_key: str | None, tokens: TokenIssuer | None = None) -> TenantRef | None:
    """The tenant of a live key (not revoked, tenant not disabled), or None. With `tokens` (the app's
    `state.tokens`), a token the exchange issued for a live key counts as that key."""
    if not api_key:
        return None
    if tokens is not None and looks_like_jwt(api_key):
        claims = tokens.verify(api_key)
        if claims is None:
            return None
        row = db.execute(_TOKEN_KEY_LOOKUP, {"key_id": claims["key_id"], "tenant_id": claims["tenant_id"]}).first()
    else:
        row = db.execute(_KEY_LOOKUP, {"key_hash": hash_key(api_key)}).first()
    return None if row is None or row.disabled else TenantRef(row.id, row.key_id, row.key_prefix)


def authenticate(db: Session, api_key: str | None, tokens: TokenIssuer | None = None) -> TenantRef:
    if not api_key:
        raise HTTPException(401, "missing X-API-Key header")
    tenant = tenant_of_key(db, api_key, tokens)
    if tenant is None:
        if looks_like_jwt(api_key):  # expired, or of a revoked key: the SDK exchanges its key again
            raise HTTPException(401, "X-API-Key: the token is expired, invalid or of a revoked key",
                                headers=INVALID_TOKEN)
        raise HTTPException(401, "invalid, revoked or disabled API key")
    # End the read transaction: its pooled connection goes back now, not when the request ends
    # (a long-poll would hold it for up to 30 s; a few dozen of them exhausted the pool).
    db.commit()
    return tenant


def current_tenant(request: Request, db: DB, x_api_key: ApiKeyHeader = None) -> TenantRef:
    return authenticate(db, x_api_key, request.app.state.tokens)


CurrentTenant = Annotated[TenantRef, Depends(current_tenant)]


async def in_tenant_session(request: Request, api_key: str | None, work: Callable[[Session, TenantRef], T]) -> T:
    """Authenticate and run `work(db, tenant)` in one database session, in one worker-thread call."""

    def run() -> T:
        with request.app.state.sessions() as db:
            return work(db, authenticate(db, api_key, request.app.state.tokens))

    return await run_in_threadpool(run)
