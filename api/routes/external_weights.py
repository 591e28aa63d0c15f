"""External weights (save_weights_external's exports): signed URLs of their files, and the files.

`get_external_weights_urls` (an API key, the export's owner) answers one signed, expiring URL per
file; the files are then fetched with a plain GET and no key (api/download_urls.py). A download that
does not verify answers 403 whether or not such an export exists, so the route tells nobody which
exports there are.
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse

from api import download_urls
from api.deps import DB, CurrentTenant
from api.routes.runs import iso, owned_checkpoint
from db.models import Checkpoint, CheckpointKind
from storage.checkpoint_files import CheckpointError
from storage.external_weights import external_file, external_file_names

router = APIRouter()
DENIED = "the download URL is invalid or has expired; ask get_external_weights_urls for new ones"


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
def external_weights_urls(run_id: str, checkpoint_id: str, request: Request, tenant: CurrentTenant, db: DB) -> dict:
    row = owned_checkpoint(db, tenant.id, run_id, checkpoint_id)
    if row.kind != CheckpointKind.EXTERNAL:
        raise HTTPException(400, f"checkpoint_id: {checkpoint_id!r} is no external_weights checkpoint; "
                                 "save_weights_external makes them")
    try:
        files = external_file_names(row.storage_path)
    except CheckpointError as e:
        raise HTTPException(404, f"checkpoint_id: the files of {row.tinker_path!r} are not readable: {e}") from None
    settings = request.app.state.settings
    key = download_urls.signing_key(settings)
    expires = int(datetime.now(UTC).timestamp()) + settings.download_url_seconds
    base_url = str(request.base_url)
    return {"urls": {f: download_urls.signed_url(base_url, key, row.tinker_path, row.id, f, expires) for f in files},
            "expires": iso(datetime.fromtimestamp(expires, UTC))}


@router.get("/external_weights/{run_id}/{name}/{file:path}")
def download(run_id: str, name: str, file: str, expires: int, signature: str, request: Request, db: DB) -> FileResponse:
    """One file of an export, for whoever holds its signed URL (no API key)."""
    tinker_path = f"tinker://{run_id}/external_weights/{name}"
    row = db.scalar(sa.select(Checkpoint).where(Checkpoint.tinker_path == tinker_path,
                                                Checkpoint.kind == CheckpointKind.EXTERNAL))
    key = download_urls.signing_key(request.app.state.settings)
    if row is None or not download_urls.valid(key, row.id, file, expires, signature):
        raise HTTPException(403, DENIED)
    try:
        path = external_file(row.storage_path, file)
    except CheckpointError as e:
        raise HTTPException(404, f"{tinker_path}: {e}") from None
    return FileResponse(path, filename=path.name)
