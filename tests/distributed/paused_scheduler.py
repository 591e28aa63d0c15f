"""`python -m tests.distributed.paused_scheduler`: the distributed scheduler, as `python -m service
scheduler` runs it, except that it stops for good right before committing the outcomes of a batch
that holds seq_id $LORAPLEX_TEST_PAUSE_AT_SEQ, once it has written $LORAPLEX_TEST_PAUSED_FILE. The
worker has run that batch by then: a test SIGKILLs the scheduler there, at the one moment when the
work is done on the worker but not recorded in the database (no sleep-and-hope timing)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from scheduler.service import SchedulerService
from service.distributed import run_scheduler
from service.settings import Settings

PAUSE_AT_SEQ = int(os.environ["LORAPLEX_TEST_PAUSE_AT_SEQ"])
PAUSED_FILE = Path(os.environ["LORAPLEX_TEST_PAUSED_FILE"])
_store = SchedulerService._store


def _store_unless_paused(self, requests, outcomes, started_at, first_started=None):
    if any(q.seq_id == PAUSE_AT_SEQ for q in requests):
        PAUSED_FILE.write_text(",".join(q.id for q in requests))
        while True:  # until the test kills this process: the outcomes are never committed
            time.sleep(1)
    return _store(self, requests, outcomes, started_at, first_started)


SchedulerService._store = _store_unless_paused

if __name__ == "__main__":
    run_scheduler(Settings())
