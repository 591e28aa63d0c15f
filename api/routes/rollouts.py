"""REST for the rollout store (db/rollouts.py): what the inference API recorded, scoped to the caller's tenant.

    GET    /rollouts/trajectories?limit&offset          summaries, most recently updated first
    GET    /rollouts/trajectories/{session_id}          turns: prompt and sampled tokens, logprobs, policy versions
    PUT    /rollouts/trajectories/{session_id}/reward   {"reward", "turn"?, "choice"?}
    DELETE /rollouts/trajectories/{session_id}
    GET    /rollouts/trajectories/{session_id}/datums?kind=rl|sft&advantage=
           training datums (loraplex.rollouts.trajectory_datums) and whether the trajectory is one datum
"""

from __future__ import annotations

import math
from typing import Literal

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel, ConfigDict

from api.deps import DB, CurrentTenant, Limit, Offset
from api.input_policy import NonNegInt32, readable
from db import rollouts, run_metrics
from loraplex.rollouts import trajectory_datums

router = APIRouter(prefix="/rollouts")


def _not_found(session_id: str) -> HTTPException:
    return HTTPException(404, f"session_id: no trajectory {session_id[:200]!r}")


@router.get("/trajectories")
def list_trajectories(tenant: CurrentTenant, db: DB, limit: Limit = 20, offset: Offset = 0) -> dict:
    total, summaries = rollouts.list_trajectories(db, tenant.id, limit, offset)
    return {"trajectories": [s.__dict__ for s in summaries], "total": total}


@router.get("/trajectories/{session_id}")
def get_trajectory(session_id: str, tenant: CurrentTenant, db: DB) -> dict:
    trajectory = rollouts.load_trajectory(db, tenant.id, session_id)
    if trajectory is None:
        raise _not_found(session_id)
    answer = trajectory.to_json()
    for turn in answer["turns"]:  # the bodies as recorded: one stored before the input policy may be too deep
        turn["request"], turn["response"] = readable(turn["request"]), readable(turn["response"])
    return answer


class RewardIn(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    reward: float | None
    turn: NonNegInt32 | None = None  # RolloutTurn.turn and RolloutSample.choice are INTEGER columns
    choice: NonNegInt32 | None = None


@router.put("/trajectories/{session_id}/reward")
def set_reward(session_id: str, body: RewardIn, tenant: CurrentTenant, db: DB) -> dict:
    if body.choice is not None and body.turn is None:
        raise HTTPException(400, "choice: name the turn too")
    try:
        rollouts.set_reward(db, tenant.id, session_id, body.reward, body.turn, body.choice)
    except rollouts.NotStored as e:
        raise HTTPException(404, str(e)) from None
    return {"session_id": session_id, "reward": body.reward, "turn": body.turn, "choice": body.choice}


@router.delete("/trajectories/{session_id}")
def delete_trajectory(session_id: str, tenant: CurrentTenant, db: DB) -> dict:
    if not rollouts.delete_trajectory(db, tenant.id, session_id):
        raise _not_found(session_id)
    return {"session_id": session_id, "deleted": True}


@router.get("/trajectories/{session_id}/datums")
def trajectory_as_datums(session_id: str, tenant: CurrentTenant, db: DB, kind: Literal["rl", "sft"] = "rl",
                         advantage: float | None = Query(None)) -> dict:
    if advantage is not None and not math.isfinite(advantage):
        raise HTTPException(400, "advantage: must be finite")
    trajectory = rollouts.load_trajectory(db, tenant.id, session_id)
    if trajectory is None:
        raise _not_found(session_id)
    try:
        built = trajectory_datums(trajectory, kind, advantage)
    except ValueError as e:
        raise HTTPException(400, str(e)) from None
    # the dashboard's policy staleness: these datums are about to be trained (db/run_metrics.py)
    run_metrics.record_staleness(db, tenant.id, session_id, [(t.sampler_path, t.policy_version) for t in trajectory.turns])
    return {"session_id": session_id, **built.to_json()}
