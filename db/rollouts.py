"""The rollout store: every call of the inference API (api/inference/) as a turn of a trajectory, with
the exact prompt and sampled tokens, the sampler's logprobs and the policy version; rewards attached
later; read back as `loraplex.rollouts` types, from which training datums are built.

Token ids are stored as int32 and logprobs as float32 bytes (little-endian), as recorded_sequences
holds them. Every query is scoped to one tenant: another tenant's trajectory is one that does not exist.

Retention (the tenant's quota row, set by `loraplex-admin quotas set`): trajectories untouched for
`rollout_ttl_seconds` are deleted by the janitor (`prune_expired`); past `max_rollout_bytes` a new
recording is refused with a 403 naming the quota. Refusing, not evicting the oldest, is what the
checkpoint quota does, and for the same reason: nothing a tenant stored disappears except by its TTL
or its own delete, so an RL loop never loses trajectories it has not read yet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Sequence

import numpy as np
import sqlalchemy as sa
from fastapi import HTTPException
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from db.models import Quota, RolloutSample, RolloutTrajectory, RolloutTurn, new_id, utcnow
from loraplex.rollouts import RolloutSample as SampleOut
from loraplex.rollouts import RolloutTurn as TurnOut
from loraplex.rollouts import Trajectory, TrajectorySummary

_DELETE_BATCH = 500  # ids per DELETE ... IN (...): well under SQLite's bound on parameters
_INSERT_TRIES = 5  # concurrent calls of one session race for the next turn number; the loser takes the one after


@dataclass(frozen=True)
class SampledChoice:
    tokens: Sequence[int]  # stop token included
    logprobs: Sequence[float]
    finish_reason: str


@dataclass(frozen=True)
class NewTurn:
    id: str
    api: str
    model: str
    sampler_path: str | None
    adapter_path: str | None
    policy_version: int | None
    request_id: str
    prompt: Sequence[int]
    choices: Sequence[SampledChoice]
    request_body: dict[str, Any]
    response_body: dict[str, Any]


def _i32(values: Sequence[int]) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def _f32(values: Sequence[float]) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def _ints(raw: bytes) -> list[int]:
    return np.frombuffer(raw, dtype="<i4").tolist()


def _floats(raw: bytes) -> list[float]:
    return np.frombuffer(raw, dtype="<f4").tolist()


def _iso(dt: datetime | None) -> str | None:
    return dt.isoformat().replace("+00:00", "Z") if dt else None


class RolloutQuotaExceeded(HTTPException):
    """An HTTPException so every inference route (api/inference/) answers it as a 403 in its own error
    shape, worded as api/quotas.py words the checkpoint quota's refusal."""

    def __init__(self, limit: int, used: int) -> None:
        super().__init__(403, f"quota max_rollout_bytes={limit} would be exceeded: {used} bytes of rollouts "
                              "stored; delete trajectories (DELETE /rollouts/trajectories/{session_id}) or "
                              "wait for the rollout TTL")


def stored_bytes(s: Session, tenant_id: str) -> int:
    return int(s.scalar(sa.select(sa.func.coalesce(sa.func.sum(RolloutTrajectory.size_bytes), 0))
                        .where(RolloutTrajectory.tenant_id == tenant_id)))


def check_quota(s: Session, tenant_id: str) -> None:
    """Refuse a new recording once the tenant's rollouts reach max_rollout_bytes (checked like
    max_checkpoint_bytes: the store may pass the limit by one recording, never by more)."""
    quota = s.get(Quota, tenant_id)
    if quota is None or quota.max_rollout_bytes is None:
        return
    used = stored_bytes(s, tenant_id)
    if used >= quota.max_rollout_bytes:
        raise RolloutQuotaExceeded(quota.max_rollout_bytes, used)


def _turn_bytes(new: NewTurn) -> int:
    """What a turn adds to the store: its token and logprob arrays and the request and response as JSON."""
    arrays = 4 * (len(new.prompt) + sum(2 * len(c.tokens) for c in new.choices))
    bodies = len(json.dumps(new.request_body)) + len(json.dumps(new.response_body))
    return arrays + bodies


def record_turn(sessions: sessionmaker[Session], tenant_id: str, session_id: str | None,
                turn: NewTurn) -> tuple[str, int]:
    """Store a call as the next turn of the tenant's trajectory `session_id` (created on first use; a
    new one named by a fresh id when None). Returns (session id, turn number)."""
    session_id = session_id or new_id()
    with sessions() as s:
        check_quota(s, tenant_id)
    for attempt in range(_INSERT_TRIES):
        with sessions() as s:
            try:
                return session_id, _insert(s, tenant_id, session_id, turn)
            except IntegrityError:
                s.rollback()
                if attempt == _INSERT_TRIES - 1:
                    raise
    raise AssertionError("unreachable")


def _insert(s: Session, tenant_id: str, session_id: str, new: NewTurn) -> int:
    now = utcnow()
    trajectory = s.scalar(sa.select(RolloutTrajectory).where(RolloutTrajectory.tenant_id == tenant_id,
                                                             RolloutTrajectory.session_id == session_id))
    if trajectory is None:
        trajectory = RolloutTrajectory(tenant_id=tenant_id, session_id=session_id, created_at=now)
        s.add(trajectory)
        s.flush()
    last = s.scalar(sa.select(sa.func.max(RolloutTurn.turn)).where(RolloutTurn.trajectory_id == trajectory.id))
    number = 0 if last is None else last + 1
    s.add(RolloutTurn(
        id=new.id, trajectory_id=trajectory.id, tenant_id=tenant_id, turn=number, api=new.api, model=new.model,
        sampler_path=new.sampler_path, adapter_path=new.adapter_path, policy_version=new.policy_version,
        request_id=new.request_id, prompt_tokens=_i32(new.prompt), request_body=new.request_body,
        response_body=new.response_body, created_at=now,
    ))
    s.flush()  # the turn before its samples: they reference it
    s.add_all(RolloutSample(turn_id=new.id, choice=i, tokens=_i32(c.tokens), logprobs=_f32(c.logprobs),
                            finish_reason=c.finish_reason) for i, c in enumerate(new.choices))
    trajectory.updated_at = now
    trajectory.size_bytes = (trajectory.size_bytes or 0) + _turn_bytes(new)
    s.commit()
    return number


def _trajectory_row(s: Session, tenant_id: str, session_id: str) -> RolloutTrajectory | None:
    return s.scalar(sa.select(RolloutTrajectory).where(RolloutTrajectory.tenant_id == tenant_id,
                                                       RolloutTrajectory.session_id == session_id))


def list_trajectories(s: Session, tenant_id: str, limit: int, offset: int) -> tuple[int, list[TrajectorySummary]]:
    where = RolloutTrajectory.tenant_id == tenant_id
    total = s.scalar(sa.select(sa.func.count()).select_from(RolloutTrajectory).where(where))
    newest_first = (RolloutTrajectory.updated_at.desc(), RolloutTrajectory.id)
    page = sa.select(RolloutTrajectory).where(where).order_by(*newest_first).limit(limit).offset(offset)
    rows = s.scalars(page).all()
    versions: dict[str, list[int | None]] = {row.id: [] for row in rows}
    if rows:
        for trajectory_id, version in s.execute(
                sa.select(RolloutTurn.trajectory_id, RolloutTurn.policy_version)
                .where(RolloutTurn.trajectory_id.in_(list(versions))).order_by(RolloutTurn.turn)):
            versions[trajectory_id].append(version)
    return total, [TrajectorySummary(row.session_id, len(versions[row.id]), row.reward, versions[row.id],
                                     _iso(row.created_at), _iso(row.updated_at)) for row in rows]


def load_trajectory(s: Session, tenant_id: str, session_id: str) -> Trajectory | None:
    row = _trajectory_row(s, tenant_id, session_id)
    if row is None:
        return None
    turns = s.scalars(sa.select(RolloutTurn).where(RolloutTurn.trajectory_id == row.id)
                      .order_by(RolloutTurn.turn)).all()
    samples: dict[str, list[SampleOut]] = {turn.id: [] for turn in turns}
    if turns:
        for sample in s.scalars(sa.select(RolloutSample).where(RolloutSample.turn_id.in_(list(samples)))
                                .order_by(RolloutSample.turn_id, RolloutSample.choice)):
            samples[sample.turn_id].append(SampleOut(sample.choice, _ints(sample.tokens), _floats(sample.logprobs),
                                                     sample.finish_reason, sample.reward))
    return Trajectory(row.session_id, [
        TurnOut(t.id, t.turn, t.api, t.model, t.sampler_path, t.policy_version, _ints(t.prompt_tokens),
                samples[t.id], _iso(t.created_at), t.request_body, t.response_body) for t in turns
    ], row.reward, _iso(row.created_at), _iso(row.updated_at))


class NotStored(LookupError):
    """What a reward names is not in the tenant's store; the message names the field."""


def set_reward(s: Session, tenant_id: str, session_id: str, reward: float | None, turn: int | None,
               choice: int | None) -> None:
    """The trajectory's reward, or (with `turn`) its samples' own: one choice, or all of the turn's.
    A `choice` without a `turn` is the caller's to refuse."""
    row = _trajectory_row(s, tenant_id, session_id)
    if row is None:
        raise NotStored(f"session_id: no trajectory {session_id!r}")
    if turn is None:
        row.reward = reward
    else:
        turn_id = s.scalar(sa.select(RolloutTurn.id).where(RolloutTurn.trajectory_id == row.id,
                                                           RolloutTurn.turn == turn))
        if turn_id is None:
            raise NotStored(f"turn: trajectory {session_id!r} has no turn {turn}")
        update = sa.update(RolloutSample).where(RolloutSample.turn_id == turn_id)
        if choice is not None:
            update = update.where(RolloutSample.choice == choice)
        if s.execute(update.values(reward=reward)).rowcount == 0:
            raise NotStored(f"choice: turn {turn} of {session_id!r} has no choice {choice}")
    row.updated_at = utcnow()
    s.commit()


def delete_trajectory(s: Session, tenant_id: str, session_id: str) -> bool:
    row = _trajectory_row(s, tenant_id, session_id)
    if row is None:
        return False
    _delete_rows(s, [row.id])
    s.commit()
    return True


def _delete_rows(s: Session, trajectory_ids: list[str]) -> None:
    """Trajectories with their turns and samples (the caller commits)."""
    turn_ids = sa.select(RolloutTurn.id).where(RolloutTurn.trajectory_id.in_(trajectory_ids)).scalar_subquery()
    s.execute(sa.delete(RolloutSample).where(RolloutSample.turn_id.in_(turn_ids)))
    s.execute(sa.delete(RolloutTurn).where(RolloutTurn.trajectory_id.in_(trajectory_ids)))
    s.execute(sa.delete(RolloutTrajectory).where(RolloutTrajectory.id.in_(trajectory_ids)))


def prune_expired(s: Session, now: datetime) -> int:
    """Every tenant's trajectories untouched (no turn, no reward) for its rollout_ttl_seconds, deleted
    (the caller commits). An agent still running keeps its trajectory: each turn renews it."""
    deleted = 0
    for tenant_id, ttl in s.execute(sa.select(Quota.tenant_id, Quota.rollout_ttl_seconds)
                                    .where(Quota.rollout_ttl_seconds.is_not(None))).all():
        expired = s.scalars(sa.select(RolloutTrajectory.id).where(
            RolloutTrajectory.tenant_id == tenant_id,
            RolloutTrajectory.updated_at <= now - timedelta(seconds=ttl))).all()
        for start in range(0, len(expired), _DELETE_BATCH):
            _delete_rows(s, list(expired[start:start + _DELETE_BATCH]))
        deleted += len(expired)
    return deleted


def last_proxy_use(s: Session, adapter_path: str) -> datetime | None:
    """When the inference API last recorded a call answered by this snapshot folder (None: never)."""
    return s.scalar(sa.select(sa.func.max(RolloutTurn.created_at)).where(RolloutTurn.adapter_path == adapter_path))
