"""The sampler engine's interface (`submit`, `pending`, `failed`, `start`, `close`) over Celery
sampler workers (service/sampler_worker.py), for the scheduler's SamplingDispatcher.

Placement: jobs of one adapter snapshot go to the same live worker (rendezvous hashing on the
snapshot folder), so its LoRA stays loaded there; base-model jobs spread by request id. A job
waits here while no sampler worker is alive (e.g. still starting). Jobs travel to the worker
through Redis under a fresh key; outcomes come back on the base model's done list. A sample applies no
state, so when its worker dies (its registration expires) the job is sent to another worker, up
to `max_attempts` times, then it fails with category "server". A streaming job is not resent (its
caller already has part of the lost run's tokens): it fails.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import threading
from collections import deque
from dataclasses import dataclass

from contract.errors import EngineError
from contract.redis_keys import (
    RESULT_TTL_SECONDS,
    SAMPLE_TASK,
    sample_done_key,
    sample_job_key,
    sample_outcome_key,
    sampler_key,
)
from contract.sampling import SampleJob
from messaging.celery_app import HEARTBEAT_SECONDS, live_registrations, make_app

log = logging.getLogger(__name__)


@dataclass
class _Dispatch:
    job: SampleJob
    on_done: object
    attempts: int = 0
    worker_id: str | None = None


def rendezvous(key: str, workers: list[str]) -> str:
    """The worker with the highest hash for `key`: stable while the set of workers is."""
    return max(workers, key=lambda w: hashlib.sha256(f"{w}/{key}".encode()).digest())


class RemoteSamplerEngine:
    failed = None  # a worker that fails to start reports it per job; the dispatcher stays open

    def __init__(self, redis_url: str, base_model: str, max_attempts: int = 2) -> None:
        import redis

        self.redis = redis.Redis.from_url(redis_url)
        self.app = make_app(redis_url)
        self.base_model = base_model
        self.max_attempts = max_attempts
        self._lock = threading.Lock()
        self._waiting: deque[_Dispatch] = deque()
        self._sent: dict[str, _Dispatch] = {}
        self._stop = threading.Event()
        self._wakeup = threading.Event()
        self._threads = [threading.Thread(target=self._send_loop, name="sampler-send", daemon=True),
                         threading.Thread(target=self._collect_loop, name="sampler-collect", daemon=True)]

    def start(self) -> "RemoteSamplerEngine":
        for thread in self._threads:
            thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._wakeup.set()
        for thread in self._threads:
            thread.join(timeout=10)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._waiting) + len(self._sent)

    def submit(self, job: SampleJob, on_done) -> None:
        with self._lock:
            self._waiting.append(_Dispatch(job, on_done))
        self._wakeup.set()

    # --- the loop: send waiting jobs, collect outcomes, watch workers ---------------------------

    def _send_loop(self) -> None:
        while not self._stop.is_set():
            self._wakeup.wait(timeout=HEARTBEAT_SECONDS)
            self._wakeup.clear()
            try:
                live = live_registrations(self.redis, sampler_key, self.base_model)
                self._resend_from_dead_workers(live)
                self._send_waiting(live)
            except Exception:  # Redis away for a moment: jobs stay where they are
                log.exception("sending sample jobs failed; retrying")
                self._stop.wait(1.0)

    def _collect_loop(self) -> None:
        while not self._stop.is_set():
            try:
                done = self.redis.blpop([sample_done_key(self.base_model)], timeout=0.5)
                if done is not None:
                    self._collect(json.loads(done[1])["request_id"])
            except Exception:
                log.exception("collecting sample outcomes failed; retrying")
                self._stop.wait(1.0)

    def _send_waiting(self, live: dict[str, dict]) -> None:
        if not live:
            return
        queues = {worker_id: record["queues"][0] for worker_id, record in live.items()}
        while True:
            with self._lock:
                if not self._waiting:
                    return
                dispatch = self._waiting.popleft()
                dispatch.worker_id = rendezvous(dispatch.job.adapter_path or dispatch.job.request_id, list(queues))
                dispatch.attempts += 1
                self._sent[dispatch.job.request_id] = dispatch
            key = sample_job_key(dispatch.job.request_id, dispatch.attempts)
            self.redis.set(key, dispatch.job.to_json(), ex=RESULT_TTL_SECONDS)
            self.app.send_task(SAMPLE_TASK, args=[key], queue=queues[dispatch.worker_id])

    def _collect(self, request_id: str) -> None:
        raw = self.redis.get(sample_outcome_key(request_id))
        self.redis.delete(sample_outcome_key(request_id))
        with self._lock:
            dispatch = self._sent.pop(request_id, None)
        if dispatch is None or raw is None:
            return  # a second outcome of a resent job, or one sent before this scheduler started
        self._finish(dispatch, pickle.loads(raw))

    def _resend_from_dead_workers(self, live: dict[str, dict]) -> None:
        with self._lock:
            lost = [d for d in self._sent.values() if d.worker_id not in live]
            for dispatch in lost:
                del self._sent[dispatch.job.request_id]
        for dispatch in lost:
            if dispatch.job.stream:  # its caller has tokens of the lost run already: a new run cannot go on from them
                self._finish(dispatch, EngineError(
                    f"sampler worker {dispatch.worker_id} was lost while streaming; a streamed sample is not resent"))
            elif dispatch.attempts >= self.max_attempts:
                self._finish(dispatch, EngineError(
                    f"sampler worker {dispatch.worker_id} was lost while sampling (tried {dispatch.attempts} times)"))
            else:
                log.warning("sampler worker %s lost; sending %s again", dispatch.worker_id, dispatch.job.request_id)
                with self._lock:
                    self._waiting.appendleft(dispatch)

    @staticmethod
    def _finish(dispatch: _Dispatch, outcome) -> None:
        try:
            dispatch.on_done(dispatch.job.request_id, outcome)
        except Exception:
            log.exception("sample callback failed for %s", dispatch.job.request_id)
