"""export_session_trace: a session's timeline as a Perfetto trace, behind a signed, expiring URL.

The SDK polls GET sessions/{id}/trace_export until it answers "ready" with a URL, then downloads that
URL with a plain GET and no credential, so the URL is the credential (api/download_urls.py signs it as
it signs external weights' files). The trace is built from the database when it is downloaded and shows
the session as it is then: building needs no job of its own, so the poll is always "ready".
"""

from __future__ import annotations

import time
from urllib.parse import quote

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response

from api import download_urls
from api.deps import DB, CurrentTenant
from api.lookups import owned_session
from api.perfetto_trace import MEDIA_TYPE, session_trace
from db.models import ClientSession, utcnow
from db.session_timeline import timeline

router = APIRouter()
DENIED = "the trace URL is invalid or has expired; ask export_session_trace for a new one"
FILE = "session.pftrace"


def _record(session_id: str) -> str:
    """What a trace URL signs in place of an export's checkpoint record (a uuid: the two never meet)."""
    return f"session_trace:{session_id}"


@router.get("/sessions/{session_id}/trace_export")
def trace_export(session_id: str, request: Request, tenant: CurrentTenant, db: DB) -> dict:
    session = owned_session(db, tenant.id, session_id)
    settings = request.app.state.settings
    expires = int(time.time()) + settings.download_url_seconds
    signature = download_urls.signature(download_urls.signing_key(settings), _record(session.id), FILE, expires)
    url = (f"{str(request.base_url).rstrip('/')}/api/v1/sessions/{quote(session.id, safe='')}/{FILE}"
           f"?expires={expires}&signature={signature}")
    return {"status": "ready", "url": url, "error": None}


@router.get(f"/sessions/{{session_id}}/{FILE}")
def download_session_trace(session_id: str, request: Request, db: DB, expires: int = 0,
                           signature: str = "") -> Response:
    """The trace, for whoever holds its signed URL (only the session's owner was handed one)."""
    key = download_urls.signing_key(request.app.state.settings)
    valid = download_urls.valid(key, _record(session_id), FILE, expires, signature)
    session = db.get(ClientSession, session_id) if valid else None
    if session is None:
        raise HTTPException(403, DENIED)
    body = session_trace(timeline(db, session), utcnow())
    return Response(body, media_type=MEDIA_TYPE,
                    headers={"Content-Disposition": f'attachment; filename="{session.id}.pftrace"'})
