"""Sampling sessions. Sessions and samplers are recorded now; sampling itself arrives with the
multi-LoRA vLLM sampler, and until then `asample` answers a clear 400 instead of pretending."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel

from api.deps import DB, CurrentTenant
from api.paths import sampler_id
from api.lookups import owned_session, resolve_checkpoint, served_model
from db.models import Sampler

router = APIRouter()
NOT_YET = "sampling is not available yet on this server (the vLLM sampler is not built yet)"


class CreateSamplingSession(BaseModel):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


@router.post("/create_sampling_session")
def create_sampling_session(body: CreateSamplingSession, request: Request, tenant: CurrentTenant, db: DB) -> dict:
    session = owned_session(db, tenant.id, body.session_id)
    base_model = body.base_model or request.app.state.model_info.name
    if body.model_path:
        resolve_checkpoint(db, tenant.id, body.model_path, "model_path")
    served_model(request, base_model)
    sid = sampler_id(session.id, body.sampling_session_seq_id)
    if db.get(Sampler, sid) is None:
        db.add(Sampler(id=sid, tenant_id=tenant.id, session_id=session.id, base_model=base_model,
                       model_path=body.model_path))
        db.commit()
    return {"type": "create_sampling_session", "sampling_session_id": sid}


@router.get("/samplers/{sampling_session_id}")
def get_sampler(sampling_session_id: str, tenant: CurrentTenant, db: DB) -> dict:
    row = db.get(Sampler, sampling_session_id)
    if row is None or row.tenant_id != tenant.id:
        raise HTTPException(404, f"sampling_session_id: no sampler {sampling_session_id!r}")
    return {"sampler_id": row.id, "base_model": row.base_model, "model_path": row.model_path}


@router.post("/asample")
def asample(tenant: CurrentTenant) -> dict:
    raise HTTPException(400, NOT_YET)
