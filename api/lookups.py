"""Tenant-scoped lookups shared by the routes: another tenant's ids answer 404, never 403."""

from __future__ import annotations

import sqlalchemy as sa
from fastapi import HTTPException
from sqlalchemy.orm import Session

from api.paths import TinkerPath
from db.models import Checkpoint, ClientSession, Sampler, TrainingModel


def owned_session(db: Session, tenant_id: str, session_id: str) -> ClientSession:
    row = db.get(ClientSession, session_id)
    if row is None or row.tenant_id != tenant_id:
        raise HTTPException(404, f"session_id: no session {session_id!r}")
    return row


def owned_model(db: Session, tenant_id: str, model_id: str) -> TrainingModel:
    row = db.get(TrainingModel, model_id)
    _refuse_unless_owned(row, tenant_id, model_id)
    return row


def check_owned_model(db: Session, tenant_id: str, model_id: str) -> str:
    """owned_model without loading the row: the hot routes (forward_backward, optim_step) only check, and
    learn the run's base model (returned). They train, so a run that holds a copied checkpoint
    (copy_weights) is refused too."""
    row = db.execute(sa.select(TrainingModel.tenant_id, TrainingModel.deleted_at, TrainingModel.copied_from,
                               TrainingModel.base_model)
                     .where(TrainingModel.id == model_id)).first()
    _refuse_unless_owned(row, tenant_id, model_id)
    if row.copied_from is not None:
        raise HTTPException(400, f"model_id: run {model_id!r} holds a copy of {row.copied_from} and cannot be "
                                 "trained; create a training client from the copy's path instead")
    return row.base_model


def _refuse_unless_owned(row, tenant_id: str, model_id: str) -> None:
    if row is None or row.tenant_id != tenant_id or row.deleted_at is not None:
        raise HTTPException(404, f"model_id: no model {model_id!r}")


def owned_sampler(db: Session, tenant_id: str, sampler_id: str) -> Sampler:
    row = db.get(Sampler, sampler_id)
    if row is None or row.tenant_id != tenant_id:
        raise HTTPException(404, f"sampling_session_id: no sampler {sampler_id!r}")
    return row


def checkpoint_base_model(db: Session, checkpoint: Checkpoint) -> str | None:
    """The base model a checkpoint was trained on: its run's (hub id); None if the run's row is gone."""
    return db.scalar(sa.select(TrainingModel.base_model).where(TrainingModel.id == checkpoint.model_id))


def resolve_checkpoint(db: Session, tenant_id: str, path: str, field: str = "path") -> tuple[TinkerPath, Checkpoint]:
    parsed = TinkerPath.parse(path, field)
    row = db.scalar(sa.select(Checkpoint).where(Checkpoint.tinker_path == str(parsed)))
    if row is None or (row.tenant_id != tenant_id and not row.public):
        raise HTTPException(404, f"{field}: no checkpoint {path!r}")
    return parsed, row
