"""A running scheduler says so in the database, for tools that must not act behind its back.

The scheduler feeds the trainer engines that hold every active model's weights, gradients and Adam
state in memory (in this process, an engine process, or Celery workers) and write them out after
their steps. An operator's change to a model's stored state made meanwhile (`loraplex-admin models
reset`) would be written over by the next step, and so silently lost: the tool refuses while a
scheduler beats here. The database is what every deployment shares (SQLite beside the embedded
server, Postgres in distributed mode), so the check needs no other connection. The row goes when
the scheduler stops; one killed leaves its row, stale after db/scheduler_beats.py's STALE_SECONDS.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from contract.residency import ResidencyStats
from db.models import SchedulerBeat, utcnow

log = logging.getLogger(__name__)

BEAT_SECONDS = 2.0  # (db/scheduler_beats.py reads a row as gone after STALE_SECONDS)


class Heartbeat:
    """Keeps this process's row fresh from a daemon thread, from start() to stop(); with each beat, the
    memory of the trainers it feeds (`trainers`), for operators (`loraplex-admin trainers`)."""

    def __init__(self, sessions: sessionmaker[Session],
                 trainers: Callable[[], dict[str, ResidencyStats]] | None = None) -> None:
        self.sessions = sessions
        self.trainers = trainers
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._id: str | None = None

    def start(self) -> None:
        with self.sessions() as s:
            row = SchedulerBeat(host=socket.gethostname(), pid=os.getpid(), trainers=self._trainers())
            s.add(row)
            s.commit()
            self._id = row.id
        self._thread = threading.Thread(target=self._beat, name="scheduler-beat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_SECONDS):
            try:
                trainers = self._trainers()
                with self.sessions() as s:
                    s.execute(sa.update(SchedulerBeat).where(SchedulerBeat.id == self._id)
                              .values(beat_at=utcnow(), trainers=trainers))
                    s.commit()
            except Exception:  # the database away for a moment: the next beat tries again
                log.exception("scheduler beat failed")

    def _trainers(self) -> dict | None:
        return {name: stats.to_json() for name, stats in self.trainers().items()} if self.trainers else None

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)
        if self._id is not None:
            with self.sessions() as s:
                s.execute(sa.delete(SchedulerBeat).where(SchedulerBeat.id == self._id))
                s.commit()
