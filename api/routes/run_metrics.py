"""Client metrics of a training run: what only the client knows (rewards, evals), stored for the
dashboard (docs/dashboard.md). The `loraplex` SDK's `TrainingClient.log_metrics` calls it.

    POST /training_runs/{run_id}/metrics   {"metrics": {name: number}, "step": int | null}
"""

from __future__ import annotations

import math
import re
from typing import Annotated

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field, StrictFloat, StrictInt

from api.deps import DB, CurrentTenant
from db.models import TrainingModel
from db import run_metrics

router = APIRouter()

MAX_METRICS = 64
MAX_NAME_CHARS = 128
NAME = re.compile(r"[A-Za-z0-9_./:\-]+")


class ClientMetrics(BaseModel):
    # JSON numbers only (strict: pydantic's lax mode would take true as 1 and "0.5" as 0.5); each name and
    # value is checked below, so the error names the metric
    metrics: dict[str, StrictInt | StrictFloat] = Field(max_length=MAX_METRICS)
    step: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None


def check_metrics(metrics: dict[str, float | int]) -> dict[str, float]:
    if not metrics:
        raise HTTPException(422, "metrics: give at least one name and value")
    checked = {}
    for name, value in metrics.items():
        shown = name[:MAX_NAME_CHARS]
        if not 1 <= len(name) <= MAX_NAME_CHARS or not NAME.fullmatch(name):
            raise HTTPException(422, f"metrics.{shown!r}: a name is 1..{MAX_NAME_CHARS} characters of "
                                     "A-Z a-z 0-9 _ . / : -")
        if isinstance(value, bool) or not math.isfinite(value):
            raise HTTPException(422, f"metrics.{shown}: must be a finite number")
        checked[name] = float(value)
    return checked


@router.post("/training_runs/{run_id}/metrics")
def log_metrics(run_id: str, body: ClientMetrics, tenant: CurrentTenant, db: DB) -> dict:
    run = db.get(TrainingModel, run_id)
    if run is None or run.tenant_id != tenant.id or run.deleted_at is not None:  # another tenant's: as nobody's
        raise HTTPException(404, f"run_id: no run {run_id[:200]!r}")  # the path's field, not the whole id echoed
    metrics = check_metrics(body.metrics)
    step = body.step if body.step is not None else run_metrics.current_step(db, run_id)
    run_metrics.store_client_metrics(db, tenant.id, run_id, step, metrics)
    return {"run_id": run_id, "step": step, "stored": len(metrics)}
