"""Which optimizer a model runs: chosen at create_model (Tinker's `optimizer_config`), fixed for the
model's life, taken over by a load that restores optimizer state (docs/optimizers.md).

No column holds it: a model's optimizer is its history's, the payload of the create_model or
load_weights that began that history (contract.kinds.STARTS_HISTORY), which the engine runs too.
"""

from __future__ import annotations

import sqlalchemy as sa
from fastapi import HTTPException
from loraplex.types import OPTIMIZERS
from pydantic import BaseModel
from sqlalchemy.orm import Session

from api.input_policy import Label
from contract.kinds import STARTS_HISTORY, RequestKind
from contract.payloads import CreateModelPayload, LoadWeightsPayload
from db.models import Request

DIMUON_VERSION = 1  # the version of Tinker's DimuonOptimizerConfig this server implements


class OptimizerConfig(BaseModel):
    """Tinker's optimizer choice: {"type": "adamw"} or {"type": "dimuon", "version": 1}."""

    type: Label = "adamw"
    version: int | None = None

    def resolve(self, field: str) -> str:
        """The optimizer it names ("adamw" or "dimuon"); a 400 naming the field for any other."""
        name = "adamw" if self.type.lower() == "adam" else self.type.lower()
        if name not in OPTIMIZERS:
            raise HTTPException(400, f"{field}.type: optimizer {self.type[:64]!r} is not supported; "
                                     f"known: {', '.join(OPTIMIZERS)}")
        if name == "dimuon" and self.version not in (None, DIMUON_VERSION):
            raise HTTPException(400, f"{field}.version: Dimuon version {self.version} is not supported; "
                                     f"this server implements version {DIMUON_VERSION}")
        return name


def wire_config(optimizer: str) -> dict:
    """The optimizer_config the SDK reads back (get_info, weights_info)."""
    return {"type": "dimuon", "version": DIMUON_VERSION} if optimizer == "dimuon" else {"type": "adamw"}


def run_optimizer(db: Session, model_id: str, before_seq: int | None = None) -> str:
    """The optimizer of `model_id` (as of its requests before `before_seq`): its last create_model's or
    load_weights'. A model with neither yet (a request ahead of its creation) runs AdamW, the default."""
    query = sa.select(Request.kind, Request.payload).where(Request.model_id == model_id,
                                                           Request.kind.in_(list(STARTS_HISTORY)))
    if before_seq is not None:
        query = query.where(Request.seq_id < before_seq)
    start = db.execute(query.order_by(Request.seq_id.desc()).limit(1)).first()
    if start is None:
        return "adamw"
    if start.kind == RequestKind.CREATE_MODEL:
        return CreateModelPayload.parse(start.payload).optimizer
    return LoadWeightsPayload.parse(start.payload).optimizer_type
