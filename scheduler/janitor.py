"""Storage that outlived its use goes away by itself: expired checkpoints, ephemeral snapshots, rollouts.

- A checkpoint whose TTL passed is deleted (files and record).
- Recorded sampled sequences (stable_reinforce, db/stability.py) past their day go.
- Rollout-store trajectories (db/rollouts.py) untouched for their tenant's `rollout_ttl_seconds` go,
  turns and samples with them.
- An ephemeral sampler snapshot (`save_weights_and_get_sampling_client()`: saved without a name)
  is deleted once a newer ephemeral snapshot of its model exists and nothing sampled it for
  `grace_seconds` (through a sampling client or through the inference API, api/inference/: an
  agent sampling a snapshot by its path keeps it). An RL loop makes one per step and samples only
  the newest (or, async, the last few): a run of a thousand steps keeps a handful, not a thousand.
  Its sampler then answers 404 naming the expiry. Deleted snapshots no longer count against the
  storage quota.

One thread per scheduler process sweeps every `interval_seconds`; `loraplex-admin checkpoints
prune-expired` runs the same sweep once.
"""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from db import rollouts, stability
from db.checkpoints import delete_checkpoint
from db.models import Checkpoint, Request, Sampler, utcnow

log = logging.getLogger(__name__)


def prune_expired(s: Session, now: datetime) -> int:
    expired = s.scalars(sa.select(Checkpoint).where(Checkpoint.expires_at <= now)).all()
    for row in expired:
        delete_checkpoint(s, row)
    return len(expired)


def prune_ephemeral(s: Session, now: datetime, grace_seconds: float) -> int:
    """Ephemeral snapshots superseded by a newer one of their model and unused for `grace_seconds`."""
    cutoff = now - timedelta(seconds=grace_seconds)
    newer = sa.orm.aliased(Checkpoint)
    candidates = s.scalars(
        sa.select(Checkpoint).where(
            Checkpoint.ephemeral.is_(True), Checkpoint.created_at <= cutoff,
            sa.exists().where(newer.model_id == Checkpoint.model_id, newer.ephemeral.is_(True),
                              newer.created_at > Checkpoint.created_at))
    ).all()
    deleted = 0
    for row in candidates:
        samplers = s.scalars(sa.select(Sampler.id).where(Sampler.adapter_path == row.storage_path)).all()
        last_sample = s.scalar(sa.select(sa.func.max(Request.created_at)).where(Request.model_id.in_(samplers))) \
            if samplers else None
        if last_sample is not None and _aware(last_sample) > cutoff:
            continue
        last_proxy_use = rollouts.last_proxy_use(s, row.storage_path)  # its calls have no sampler row
        if last_proxy_use is not None and _aware(last_proxy_use) > cutoff:
            continue
        delete_checkpoint(s, row)
        deleted += 1
    return deleted


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)  # an aggregate may come back naive


def sweep(sessions: sessionmaker[Session], grace_seconds: float) -> tuple[int, int, int]:
    """(expired checkpoints, ephemeral snapshots, expired rollout trajectories) deleted; expired
    recorded sequences go too."""
    with sessions() as s:
        now = utcnow()
        counts = prune_expired(s, now), prune_ephemeral(s, now, grace_seconds), rollouts.prune_expired(s, now)
        stability.prune_expired(s, now)
        s.commit()
    return counts


class Janitor:
    def __init__(self, sessions: sessionmaker[Session], grace_seconds: float, interval_seconds: float = 60.0) -> None:
        self.sessions, self.grace_seconds, self.interval_seconds = sessions, grace_seconds, interval_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            try:
                expired, ephemeral, trajectories = sweep(self.sessions, self.grace_seconds)
                if expired or ephemeral or trajectories:
                    log.info("deleted %d expired checkpoints, %d ephemeral snapshots and %d expired rollout "
                             "trajectories", expired, ephemeral, trajectories)
            except Exception:  # e.g. the database or the store is unreachable: try again next time
                log.exception("janitor sweep failed")

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="janitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=30)
