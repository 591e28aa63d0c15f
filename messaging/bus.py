"""The links between API replicas and the one scheduler when they run as separate processes (Redis).

API -> scheduler: each accepted request goes onto its base model's Redis list (the inbox) after
it is committed to the database. A push made while no scheduler runs waits in the list; a push lost with Redis costs
nothing either, because the scheduler reloads every unfinished request from the database when it
starts. So a request may arrive twice around a start: the scheduler ignores the second copy.

Scheduler -> API: each finished request id is published on FINISHED, and every API replica wakes
its long-polls. A lost message only delays: a long-poll re-checks the database every few seconds.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict

import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from contract.errors import SamplerBusy, SamplerUnavailable
from contract.kinds import RequestKind
from contract.queue import QueuedRequest
from contract.redis_keys import FINISHED, inbox_key, sampler_key
from db.models import Request, RequestState
from messaging.celery_app import live_registrations
from messaging.notify import Answer, Notifier
from messaging.remote_streams import RemoteStreams

log = logging.getLogger(__name__)


class RedisInbox:
    """API side: stands in for the scheduler's `submit`."""

    def __init__(self, client: redis.Redis, base_model: str) -> None:
        self.redis = client
        self.key = inbox_key(base_model)

    def submit(self, request: QueuedRequest) -> None:
        self.redis.rpush(self.key, json.dumps({"train": asdict(request)}))

    def submit_sample(self, request_id: str) -> None:
        self.redis.rpush(self.key, json.dumps({"sample": request_id}))


class RemoteSampling:
    """API side: stands in for the sampling dispatcher. Capacity is read where every replica sees
    the same numbers: live sampler workers in Redis, samples in flight in the database."""

    def __init__(self, inbox: RedisInbox, sessions: sessionmaker[Session], base_model: str, max_pending: int) -> None:
        self.inbox = inbox
        self.sessions = sessions
        self.base_model = base_model
        self.max_pending = max_pending

    def check_capacity(self) -> None:
        if not live_registrations(self.inbox.redis, sampler_key, self.base_model):
            raise SamplerUnavailable(f"no sampler worker serving {self.base_model!r} is running")
        with self.sessions() as s:
            pending = s.scalar(sa.select(sa.func.count()).select_from(Request).where(
                Request.state == RequestState.PENDING, Request.kind == RequestKind.SAMPLE))
        if pending >= self.max_pending:
            raise SamplerBusy(f"{pending} samples are in flight (limit {self.max_pending})")

    def submit(self, job) -> None:
        self.inbox.submit_sample(job.request_id)


class FinishedPublisher:
    """Scheduler side: stands in for the API's Notifier."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client

    def notify(self, request_id: str, answer: Answer | None = None) -> None:
        # only the id travels: a replica's woken long-poll reads the answer from the database
        self.redis.publish(FINISHED, request_id)


class _Loop:
    """A daemon thread running `_once` until `stop`; an error (Redis away) is logged and retried."""

    name = "loop"

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._once()
            except Exception:
                log.exception("%s failed; retrying", self.name)
                self._stop.wait(1.0)

    def _once(self) -> None:
        raise NotImplementedError


class FinishedListener(_Loop):
    """API side: wake this replica's long-polls when the scheduler publishes a finished request, and
    hand the sampler workers' streamed tokens to this replica's streaming calls (`streams`,
    messaging/remote_streams.py). Both come on one connection, read by one thread, so a stream's
    tokens reach its call before its finish does: the worker publishes them before it reports the
    outcome that the scheduler's FINISHED follows, and Redis delivers one connection's messages in
    the order they were published."""

    name = "finished-listener"

    def __init__(self, client: redis.Redis, notifier: Notifier, streams: RemoteStreams | None = None) -> None:
        super().__init__()
        self.redis = client
        self.notifier = notifier
        self.streams = streams
        self._pubsub = self._subscribe()  # now: before any request is accepted

    def _subscribe(self):
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(FINISHED, **({self.streams.channel: self.streams.deliver} if self.streams else {}))
        return pubsub

    def _once(self) -> None:
        if self._pubsub is None:
            self._pubsub = self._subscribe()
        try:
            message = self._pubsub.get_message(timeout=0.5)  # a stream's message goes to its handler
        except redis.ConnectionError:
            self._pubsub = None  # subscribe again on a fresh connection
            raise
        if message is not None:
            self.notifier.notify(message["data"].decode())


class InboxConsumer(_Loop):
    """Scheduler side: training requests to the scheduler, samples to the sampling dispatcher
    (their payloads are read from the database, where the API stored them)."""

    name = "inbox-consumer"

    def __init__(self, client: redis.Redis, base_model: str, scheduler, sampling, sessions: sessionmaker[Session]) -> None:
        super().__init__()
        self.redis = client
        self.key = inbox_key(base_model)
        self.scheduler = scheduler
        self.sampling = sampling
        self.sessions = sessions

    def _once(self) -> None:
        item = self.redis.blpop([self.key], timeout=0.5)
        if item is None:
            return
        message = json.loads(item[1])
        if "train" in message:
            self.scheduler.submit(QueuedRequest(**message["train"]))
        elif self.sampling is None:
            self._fail(message["sample"], "sampling is disabled on this scheduler")
        else:
            with self.sessions() as s:
                row = s.get(Request, message["sample"])
                if row is None or row.state != RequestState.PENDING:
                    return  # a second copy of a sample that already finished
                payload = row.payload
            from contract.sampling import SampleJob

            self.sampling.submit(SampleJob.from_json(payload))

    def _fail(self, request_id: str, error: str) -> None:
        with self.sessions() as s:
            row = s.get(Request, request_id)
            if row is not None and row.state == RequestState.PENDING:
                row.error, row.state = {"error": error, "category": "server"}, RequestState.FAILED
                s.commit()
        self.scheduler.notifier.notify(request_id)
