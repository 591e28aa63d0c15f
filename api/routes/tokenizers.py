"""The served base models' tokenizer files, for clients that load tokenizers by hub id.

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
from api.served_models import ServedModel, served
from models.tokenizer_files import TokenizerManifest, tokenizer_manifest

router = APIRouter()


def _served_manifest(request: Request, model: str) -> tuple[ServedModel, TokenizerManifest]:
    base = served(request).find(model)
    if base is None:
        raise HTTPException(404, f"model: no tokenizer for {model[:200]!r}: this server serves "
                                 f"{served(request).described()}")
    return base, tokenizer_manifest(base.info.path)


@router.get("/tokenizers/{model:path}/files")
def list_tokenizer_files(model: str, request: Request, _: CurrentTenant) -> dict:
    base, manifest = _served_manifest(request, model)
    return {"model": base.name, "revision": manifest.revision, "files": manifest.to_json()}


@router.get("/tokenizers/{model:path}/files/{filename}")
def get_tokenizer_file(model: str, filename: str, request: Request, _: CurrentTenant) -> FileResponse:
    base, manifest = _served_manifest(request, model)
    listed = manifest.file(filename)
    if listed is None:  # only listed names: nothing else of the model's folder can be read this way
        raise HTTPException(404, f"filename: {filename[:200]!r} is not one of the tokenizer files of {model[:200]!r}")
    return FileResponse(base.info.path / listed.path, media_type="application/octet-stream")
