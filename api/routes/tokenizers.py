"""The served base model's tokenizer files, for clients that load tokenizers by hub id.

    GET /api/v1/tokenizers/{model}/files
        {"model": hub id, "revision": 40 hex digits, "files": [{"path", "size", "sha256"}, ...]}
    GET /api/v1/tokenizers/{model}/files/{filename}
        the bytes of one listed file

`model` is the hub id or an alias (e.g. HuggingFaceTB/SmolLM2-135M-Instruct or SmolLM2-135M-Instruct).
`loraplex tokenizer pull` writes these files into a Hugging Face cache snapshot named by `revision`.
Only the listed tokenizer files are served (models/tokenizer_files.py), never a path.
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse

from api.deps import CurrentTenant
from api.lookups import served_names, serves
from models.tokenizer_files import TokenizerManifest, tokenizer_manifest

router = APIRouter()


def _served_manifest(request: Request, model: str) -> TokenizerManifest:
    if not serves(request, model):
        raise HTTPException(404, f"model: no tokenizer for {model[:200]!r}: this server serves {served_names(request)}")
    return tokenizer_manifest(request.app.state.model_info.path)


@router.get("/tokenizers/{model:path}/files")
def list_tokenizer_files(model: str, request: Request, _: CurrentTenant) -> dict:
    manifest = _served_manifest(request, model)
    return {"model": request.app.state.model_info.name, "revision": manifest.revision, "files": manifest.to_json()}


@router.get("/tokenizers/{model:path}/files/{filename}")
def get_tokenizer_file(model: str, filename: str, request: Request, _: CurrentTenant) -> FileResponse:
    listed = _served_manifest(request, model).file(filename)
    if listed is None:  # only listed names: nothing else of the model's folder can be read this way
        raise HTTPException(404, f"filename: {filename[:200]!r} is not one of the tokenizer files of {model[:200]!r}")
    return FileResponse(request.app.state.model_info.path / listed.path, media_type="application/octet-stream")
