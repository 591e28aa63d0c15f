"""FastAPI dependencies: the database session and the tenant behind the X-API-Key header."""

from __future__ import annotations

from typing import Annotated, Iterator

import sqlalchemy as sa
from fastapi import Depends, Header, HTTPException, Request
from sqlalchemy.orm import Session

from db.models import ApiKey, Tenant
from service.tenants import hash_key


def db_session(request: Request) -> Iterator[Session]:
    with request.app.state.sessions() as session:
        yield session


DB = Annotated[Session, Depends(db_session)]


def current_tenant(db: DB, x_api_key: Annotated[str | None, Header()] = None) -> Tenant:
    if not x_api_key:
        raise HTTPException(401, "missing X-API-Key header")
    tenant = db.scalar(
        sa.select(Tenant).join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == hash_key(x_api_key), ApiKey.revoked_at.is_(None))
    )
    if tenant is None or tenant.disabled:
        raise HTTPException(401, "invalid, revoked or disabled API key")
    # End the read transaction: its pooled connection goes back now, not when the request ends
    # (a long-poll would hold it for up to 30 s; a few dozen of them exhausted the pool).
    db.commit()
    return tenant


CurrentTenant = Annotated[Tenant, Depends(current_tenant)]
