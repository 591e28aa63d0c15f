"""What a request's `model` names, resolved at every call (so a deleted checkpoint stops serving):

- a sampler checkpoint, `tinker://<run>/sampler_weights/<name>`: the newest save under that name
  (the caller's own or a published one, as asample resolves it);
- a **policy alias**, `tinker://<run>/sampler_weights/@latest`: the newest save_weights_for_sampler
  (named or not) of one of the caller's training runs, so a harness keeps one model name while an
  RL loop saves new weights ('@' is never part of a checkpoint name, so the alias cannot clash);
- the base model, by its hub id or an alias (`loraplex/tiny`, `tiny`).

Anything else, and another tenant's unpublished checkpoint or run, is a 404 that leaks nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import sqlalchemy as sa
from fastapi import HTTPException, Request
from sqlalchemy.orm import Session

from api.inference.errors import InferenceError
from api.lookups import checkpoint_base_model, resolve_checkpoint
from api.served_models import ServedModel, served
from db.models import Checkpoint, CheckpointKind, TrainingModel
from storage.checkpoint_files import snapshot_policy_version

LATEST = "@latest"


@dataclass(frozen=True)
class Target:
    sampler_path: str | None  # the tinker:// sampler checkpoint that answers; None: the base model
    adapter_path: str | None  # its snapshot folder (the save current now)
    policy_version: int | None  # optimizer steps of that snapshot; None: the base model
    served: ServedModel  # the base model it samples (its run's), with that model's sampler

    @property
    def version_label(self) -> str:
        """As asample's sequence ids end: "v3", or "base"."""
        return "base" if self.policy_version is None else f"v{self.policy_version}"


def alias(run_id: str) -> str:
    return f"tinker://{run_id}/sampler_weights/{LATEST}"


def _not_found(message: str) -> InferenceError:
    return InferenceError(404, message, code="model_not_found")


def resolve(request: Request, db: Session, tenant_id: str, model: str) -> Target:
    if model.startswith("tinker://"):
        parts = model.removeprefix("tinker://").split("/")
        if len(parts) == 3 and parts[1] == "sampler_weights" and parts[2] == LATEST:
            return _latest(request, db, tenant_id, parts[0], model)
        try:
            _, checkpoint = resolve_checkpoint(db, tenant_id, model, "model")
        except HTTPException as e:
            raise (_not_found(str(e.detail)) if e.status_code == 404 else e) from None
        if checkpoint.kind != CheckpointKind.SAMPLER:
            raise InferenceError(400, "model: sample from sampler weights (tinker://<run>/sampler_weights/<name>), "
                                      "not a training state")
        return _snapshot(request, checkpoint, model, checkpoint_base_model(db, checkpoint))
    base = served(request).find(model)
    if base is not None:
        return Target(None, None, None, base)
    raise _not_found(f"model: no model {model[:200]!r}: name a sampler checkpoint (tinker://<run>/sampler_weights/"
                     f"<name>), a run's policy alias (tinker://<run>/sampler_weights/{LATEST}) or a base model "
                     f"served here: {served(request).described()}")


def _latest(request: Request, db: Session, tenant_id: str, run_id: str, model: str) -> Target:
    run = db.get(TrainingModel, run_id)
    if run is None or run.tenant_id != tenant_id or run.deleted_at is not None:
        raise _not_found(f"model: no training run {run_id[:200]!r} for the policy alias {model[:240]!r}")
    newest = db.scalar(sa.select(Checkpoint).where(
        Checkpoint.model_id == run_id, Checkpoint.tenant_id == tenant_id, Checkpoint.kind == CheckpointKind.SAMPLER,
    ).order_by(Checkpoint.created_at.desc(), Checkpoint.id.desc()).limit(1))
    if newest is None:
        raise _not_found(f"model: training run {run_id!r} has no save_weights_for_sampler yet")
    return _snapshot(request, newest, model, run.base_model)


def _snapshot(request: Request, checkpoint: Checkpoint, model: str, base_model: str | None) -> Target:
    version = snapshot_policy_version(checkpoint.storage_path)
    if version is None or base_model is None:
        raise _not_found(f"model: the weights of {model[:240]!r} are not saved (yet) or were deleted")
    try:
        base = served(request).stored(base_model, "model")
    except HTTPException as e:
        raise InferenceError(e.status_code, str(e.detail)) from None
    return Target(checkpoint.tinker_path, checkpoint.storage_path, version, base)


@dataclass(frozen=True)
class ListedModel:
    id: str
    created_at: datetime  # the checkpoint's save, the run's creation, or the base model's files


def listed_models(request: Request, db: Session, tenant_id: str) -> list[ListedModel]:
    """What the model lists show: the base models, the policy alias of each of the caller's runs that has
    a sampler checkpoint, and those checkpoints (oldest first)."""
    rows = db.execute(sa.select(Checkpoint.tinker_path, Checkpoint.created_at, TrainingModel.id,
                                TrainingModel.created_at.label("run_created_at")).join(
        TrainingModel, TrainingModel.id == Checkpoint.model_id,
    ).where(Checkpoint.tenant_id == tenant_id, Checkpoint.kind == CheckpointKind.SAMPLER,
            TrainingModel.deleted_at.is_(None)).order_by(Checkpoint.created_at)).all()
    bases = [ListedModel(model.name, datetime.fromtimestamp(Path(model.info.path).stat().st_mtime, timezone.utc))
             for model in served(request).all]
    runs = {row.id: ListedModel(alias(row.id), _utc(row.run_created_at)) for row in rows}
    return [*bases, *runs.values(), *(ListedModel(row.tinker_path, _utc(row.created_at)) for row in rows)]


def _utc(stored: datetime) -> datetime:
    """The database's naive UTC times (db/models.utcnow), as aware ones."""
    return stored.replace(tzinfo=timezone.utc) if stored.tzinfo is None else stored
