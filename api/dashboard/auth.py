"""Who is looking at the dashboard: login with a tenant's key or an operator key, a server-side
session in an HttpOnly, SameSite=Strict cookie, and the `Viewer` every dashboard route depends on.

The cookie holds a random session id; the database keeps its SHA-256 and the key that opened it
(`dashboard_sessions`), so the key itself is never stored in the browser or shown in a URL, logout
ends the session for good, and a revoked key or a disabled tenant ends its sessions at once (each
request checks the key as well as the session). Scripts may skip the cookie and send the key as
`Authorization: Bearer` or `X-API-Key`.
"""

from __future__ import annotations

import hashlib
import posixpath
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated
from urllib.parse import quote, unquote, urlsplit

import sqlalchemy as sa
from fastapi import APIRouter, Depends, Form, HTTPException, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from sqlalchemy.orm import Session

from api.deps import DB
from api.inference.keys import api_key as key_from_headers
from db.models import ApiKey, DashboardSession, OperatorKey, Tenant, utcnow
from db.tenants import hash_key

COOKIE = "loraplex_dashboard"
COOKIE_PATH = "/dashboard"
SESSION_SECONDS = 12 * 3600
MAX_KEY_CHARS = 512  # a key is ~47 characters: anything far longer is not one

router = APIRouter()


@dataclass(frozen=True)
class Viewer:
    tenant_id: str | None  # None: the operator
    tenant_name: str | None
    is_admin: bool

    def to_json(self) -> dict:
        return {"kind": "admin" if self.is_admin else "tenant", "tenant_id": self.tenant_id,
                "tenant_name": self.tenant_name}


ADMIN = Viewer(None, None, True)

_TENANT_KEY = (sa.select(ApiKey.id, Tenant.id, Tenant.name).join(Tenant, Tenant.id == ApiKey.tenant_id)
               .where(ApiKey.revoked_at.is_(None), Tenant.disabled.is_(False)))
_OPERATOR_KEY = sa.select(OperatorKey.id).where(OperatorKey.revoked_at.is_(None))


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _key_viewer(db: Session, key: str) -> tuple[Viewer, str | None, str | None] | None:
    """The viewer of a live key, with the tenant key's or operator key's row id."""
    if not key or len(key) > MAX_KEY_CHARS:
        return None
    digest = hash_key(key)
    row = db.execute(_TENANT_KEY.where(ApiKey.key_hash == digest)).first()
    if row is not None:
        return Viewer(row[1], row[2], False), row[0], None
    operator = db.scalar(_OPERATOR_KEY.where(OperatorKey.key_hash == digest))
    return (ADMIN, None, operator) if operator is not None else None


def _session_viewer(db: Session, session_id: str) -> Viewer | None:
    """The viewer of a live session (not expired, its key not revoked, its tenant not disabled)."""
    row = db.execute(sa.select(DashboardSession.api_key_id, DashboardSession.operator_key_id).where(
        DashboardSession.id == _digest(session_id), DashboardSession.expires_at > utcnow())).first()
    if row is None:
        return None
    if row.operator_key_id is not None:
        return ADMIN if db.scalar(_OPERATOR_KEY.where(OperatorKey.id == row.operator_key_id)) else None
    tenant = db.execute(_TENANT_KEY.where(ApiKey.id == row.api_key_id)).first()
    return Viewer(tenant[1], tenant[2], False) if tenant is not None else None


def viewer_of(db: Session, request: Request) -> Viewer | None:
    """The request's viewer: by its key header, else by its session cookie; None when neither is valid."""
    key = key_from_headers(request.headers)
    if key:
        found = _key_viewer(db, key)
        return found[0] if found else None
    session_id = request.cookies.get(COOKIE)
    return _session_viewer(db, session_id) if session_id else None


def viewer_or_none(request: Request) -> Viewer | None:
    """For page routes that send a visitor without a session to the login form."""
    with request.app.state.sessions() as db:
        return viewer_of(db, request)


def current_viewer(request: Request, db: DB) -> Viewer:
    viewer = viewer_of(db, request)
    if viewer is None:
        raise HTTPException(401, "not logged in: POST /dashboard/login with api_key, or send the key as "
                                 "Authorization: Bearer")
    db.commit()  # end the read transaction: its connection goes back to the pool now
    return viewer


CurrentViewer = Annotated[Viewer, Depends(current_viewer)]


def require_admin(viewer: CurrentViewer) -> Viewer:
    if not viewer.is_admin:
        raise HTTPException(403, "admin only: log in with an operator key (loraplex-admin operator-keys issue)")
    return viewer


AdminViewer = Annotated[Viewer, Depends(require_admin)]


def _wants_json(request: Request) -> bool:
    return "application/json" in request.headers.get("accept", "")


def safe_next(target: str | None) -> str:
    """Only a path of the dashboard: never another site (an open redirect) or a scheme-relative URL.
    Dot segments, %2e-encoded ones too, are resolved here as a browser would resolve them, so the
    path checked is the path visited: `/dashboard/../../evil` gives /dashboard, not /evil."""
    if not target or len(target) > 2048 or any(c in target for c in "\\\r\n\t"):
        return COOKIE_PATH
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or not parts.path.startswith("/"):
        return COOKIE_PATH
    path = "/" + posixpath.normpath(unquote(parts.path)).lstrip("/")  # normpath keeps a leading "//"
    if path != COOKIE_PATH and not path.startswith(COOKIE_PATH + "/"):
        return COOKIE_PATH
    return quote(path, safe="/:@!$&'()*+,;=-._~") + (f"?{parts.query}" if parts.query else "")


@router.post("/dashboard/login")
def login(request: Request, db: DB, api_key: Annotated[str, Form()], next: Annotated[str | None, Form()] = None
          ) -> Response:
    found = _key_viewer(db, api_key.strip())
    if found is None:
        raise HTTPException(401, "api_key: invalid, revoked or disabled key")
    viewer, api_key_id, operator_key_id = found
    session_id = secrets.token_urlsafe(32)
    now = utcnow()
    db.add(DashboardSession(id=_digest(session_id), api_key_id=api_key_id, operator_key_id=operator_key_id,
                            created_at=now, expires_at=now + timedelta(seconds=SESSION_SECONDS)))
    db.execute(sa.delete(DashboardSession).where(DashboardSession.expires_at <= now))  # expired ones go by the way
    db.commit()
    # the page's script goes where a plain form's redirect would (static/login.js)
    response: Response = (JSONResponse({"viewer": viewer.to_json(), "next": safe_next(next)}) if _wants_json(request)
                          else RedirectResponse(safe_next(next), status_code=303))
    response.set_cookie(COOKIE, session_id, max_age=SESSION_SECONDS, path=COOKIE_PATH, httponly=True,
                        samesite="strict", secure=request.url.scheme == "https")
    return response


@router.post("/dashboard/logout")
def logout(request: Request, db: DB) -> Response:
    session_id = request.cookies.get(COOKIE)
    if session_id:
        db.execute(sa.delete(DashboardSession).where(DashboardSession.id == _digest(session_id)))
        db.commit()
    response: Response = (JSONResponse({"logged_out": True}) if _wants_json(request)
                          else RedirectResponse(f"{COOKIE_PATH}/login", status_code=303))
    response.delete_cookie(COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict",
                           secure=request.url.scheme == "https")
    return response
