"""The Tinker SDK's auth exchange: an API key in, a short-lived signed token out (api/auth_tokens.py)."""

from __future__ import annotations

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException, Request

from api.deps import DB, ApiKeyHeader, authenticate
from db.models import Tenant

router = APIRouter()


@router.post("/auth/token")
def auth_token(request: Request, db: DB, x_api_key: ApiKeyHeader = None) -> dict:
    tokens = request.app.state.tokens
    if tokens is None:
        raise HTTPException(404, "auth/token: this server does not exchange tokens (jwt_auth is off); "
                                 "send the API key itself")
    tenant = authenticate(db, x_api_key)  # an API key only: a token is not exchanged for a newer one
    name = db.scalar(sa.select(Tenant.name).where(Tenant.id == tenant.id))
    return {"jwt": tokens.issue(key_id=tenant.key_id, tenant_id=tenant.id, tenant_name=name)}
