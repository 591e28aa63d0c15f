"""The scheduler loop: accepted requests in, one batched cycle at a time out, results persisted.

The API stores each accepted request (state "pending") and calls `submit`. The loop keeps a
reorder buffer per model, plans a fair cycle across tenants, hands it to the executor, stores every
outcome, advances each model's applied seq_id and wakes the API's long-polls. On start it reloads
every unfinished request from the database, so a restart loses no accepted work. A seq_id that
has not arrived `seq_gap_seconds` after a later one of its model is recorded as a failed request
("never arrived") and skipped, so the model goes on.

Recovery runs on the scheduler's thread, never before the API serves: the requests an engine lost
with the old process are replayed one per cycle, between the cycles of every other model, and only
the model being replayed waits for it (its new requests stay pending until its replay is done).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from contract.executor import Executor
from contract.kinds import BATCHABLE_KINDS, RequestKind
from contract.payloads import RejectedPayload
from contract.queue import JSON, Cycle, Job, Outcome, QueuedRequest
from db import run_metrics
from db.models import Checkpoint, Request, RequestState, TrainingModel, utcnow
from messaging.notify import Answer, Notifier
from scheduler import metrics
from scheduler.liveness import Heartbeat
from scheduler.ordering import ReorderBuffer
from scheduler.planner import CyclePlanner

log = logging.getLogger(__name__)

# kinds that start a model's state afresh rather than run on it: nothing to read ahead for them
STARTS_STATE = (RequestKind.CREATE_MODEL, RequestKind.LOAD_WEIGHTS, RequestKind.REJECTED)


@dataclass
class CycleLog:
    """What ran together: the last cycles' request ids, for tests and operators."""

    cycles: list[list[str]] = field(default_factory=list)
    keep: int = 1000

    def record(self, cycle: Cycle) -> None:
        if cycle.forward_backward:
            self.cycles.append([r.id for r in cycle.forward_backward])
            del self.cycles[: -self.keep]


def observe(cycle: Cycle, outcomes: dict[str, Outcome], going_on: set[str] = frozenset()) -> None:
    """A finished cycle in the Prometheus metrics (`going_on`: requests it ran a part of, not the last)."""
    if cycle.forward_backward:
        metrics.CYCLE_TOKENS.observe(sum(q.num_tokens for q in cycle.forward_backward))
        metrics.CYCLE_TENANTS.observe(len({q.tenant_id for q in cycle.forward_backward}))
    for q in cycle.all():
        if q.id in going_on:
            continue
        outcome = outcomes.get(q.id)
        metrics.REQUESTS_FINISHED.labels(q.kind, "ok" if outcome and not outcome.error else "failed").inc()


def _failure(message: str) -> dict[str, str]:
    """A request's stored error, as the Tinker SDK reads it."""
    return {"error": message, "category": "user"}


def queued(row: Request) -> QueuedRequest:
    return QueuedRequest(row.id, row.tenant_id, row.model_id or row.id, row.seq_id or 0, row.kind, row.num_tokens)


class SchedulerService:
    def __init__(
        self, sessions: sessionmaker[Session], executor: Executor, token_budget: int, notifier: Notifier,
        gather_seconds: float = 0.0, seq_gap_seconds: float = 60.0, tenant_max_tokens_in_flight: int = 0,
        base_model: str | None = None,
    ) -> None:
        self.sessions = sessions
        # the hub id of the base model whose runs this scheduler trains, where a database holds runs of
        # several (api/served_models.py); None: every run in it
        self.base_model = base_model
        self.executor = executor
        self.planner = CyclePlanner(token_budget, tenant_max_tokens_in_flight=tenant_max_tokens_in_flight)
        self.notifier = notifier
        self.buffer = ReorderBuffer()
        self.inbox: queue.SimpleQueue[QueuedRequest] = queue.SimpleQueue()
        self.wakeup = threading.Event()
        self.cycle_log = CycleLog()
        # After idling, wait this long before planning, so requests that several tenants send at
        # about the same time share a cycle (the price: this much latency on an idle server).
        self.gather_seconds = gather_seconds
        self.seq_gap_seconds = seq_gap_seconds
        self._idle = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # model -> the ids of its requests to replay, in seq_id order (`recover`); it runs nothing else meanwhile
        self.replaying: dict[str, deque[str]] = {}
        # says in the database that a scheduler runs, and what its trainers hold (scheduler/liveness.py)
        self.heartbeat = Heartbeat(sessions, executor.trainer_memory)

    # --- feeding ---------------------------------------------------------------------------------

    def submit(self, request: QueuedRequest) -> None:
        self.inbox.put(request)
        self.wakeup.set()
        if request.kind not in STARTS_STATE:  # it will need its model's state: a paged-out one is read meanwhile
            self.executor.prefetch([request.model_id])

    def recover(self) -> int:
        """Queue every training request that was accepted but not finished (a running one is re-run:
        its effects were never committed, since outcomes and model progress are stored together),
        and note what each model must replay first (`replaying`; `step` replays it). Samples are the
        sampling dispatcher's. Runs on the scheduler's thread (`start`): the API serves meanwhile."""
        unfinished = (sa.select(Request)
                      .where(Request.state.in_([RequestState.PENDING, RequestState.RUNNING]),
                             Request.kind != RequestKind.SAMPLE)
                      .order_by(Request.created_at))
        if self.base_model is not None:  # (every training request names its run)
            unfinished = unfinished.join(TrainingModel, TrainingModel.id == Request.model_id) \
                .where(TrainingModel.base_model == self.base_model)
        with self.sessions() as s:
            rows = s.scalars(unfinished).all()
            for row in rows:
                self.inbox.put(queued(row))
            # Local engines restarted with this process and lost their gradients; Celery workers
            # did not (a dead one's models are replayed when they move: see step).
            if self.executor.engines_restart_with_scheduler:
                self.replaying = self._lost_work(s)
        if self.replaying:
            log.info("replaying %d requests of %d models in the background",
                     sum(map(len, self.replaying.values())), len(self.replaying))
        metrics.RECOVERING_MODELS.set(len(self.replaying))
        self.wakeup.set()
        return len(rows)

    def _lost_work(self, s: Session, only: set[str] | None = None) -> dict[str, deque[str]]:
        """What models finished after their last durable state lived only in the old process (or a
        dead worker: `only` its models): the gradients of forward_backward requests and, where the
        state writer had not caught up, optim_steps. For each model, those requests' ids in seq_id
        order: recomputed in that order (same payloads, same weights -> same results), their stored
        outcomes are kept."""
        live = sa.select(TrainingModel).where(TrainingModel.deleted_at.is_(None))
        if self.base_model is not None:
            live = live.where(TrainingModel.base_model == self.base_model)
        if only is not None:
            live = live.where(TrainingModel.id.in_(only))
        lost = {}
        for model in s.scalars(live):
            # never a state newer than what the database holds as applied: that step runs again
            durable = self.executor.durable_seq(model.id, at_most=model.last_applied_seq_id)
            if durable is None or durable >= model.last_applied_seq_id:
                continue
            ids = s.scalars(
                sa.select(Request.id).where(
                    Request.model_id == model.id,
                    Request.kind.in_([RequestKind.FORWARD_BACKWARD, RequestKind.OPTIM_STEP]),
                    Request.state == RequestState.DONE, Request.seq_id > durable,
                    Request.seq_id <= model.last_applied_seq_id,
                ).order_by(Request.seq_id)
            ).all()
            if ids:
                lost[model.id] = deque(ids)
        return lost

    def _replay(self, s: Session, request_id: str) -> None:
        """Run one stored request again on its model's engine; its stored outcome stays as it is. One
        request per engine call gives the bits of any grouping: each request's gradient is summed on its
        own and added to the model's in seq_id order (docs/decisions/0022-batch-invariant-training.md)."""
        row = s.get(Request, request_id)
        q = queued(row)
        cycle = Cycle(forward_backward=[q]) if q.kind == RequestKind.FORWARD_BACKWARD else Cycle(optim_steps=[q])
        self.executor.run_cycle(cycle, {q.id: Job(q, row.payload)})

    def _replay_lost_work(self, s: Session, only: set[str] | None = None) -> None:
        """Replay what the models (`only`: these) lost, all of it, now: for a dead worker's models before
        they run elsewhere, and for `loraplex-admin models rebuild`."""
        for model_id, ids in self._lost_work(s, only).items():
            log.info("replaying %d requests of %s", len(ids), model_id)
            for request_id in ids:
                self._replay(s, request_id)

    def _replay_next(self) -> bool:
        """Replay one request of the next model that has some left (models take turns); False if none had."""
        if not self.replaying:
            return False
        model_id, ids = next(iter(self.replaying.items()))
        with self.sessions() as s:
            self._replay(s, ids[0])
        ids.popleft()  # only once it ran: a step that raised (the database away) tries it again
        del self.replaying[model_id]
        if ids:
            self.replaying[model_id] = ids  # to the back: the next model's turn
        else:
            log.info("%s: replayed; its requests run again", model_id)
        metrics.RECOVERING_MODELS.set(len(self.replaying))
        return True

    def _drain_inbox(self, s: Session) -> int:
        drained = 0
        while True:
            try:
                request = self.inbox.get_nowait()
            except queue.Empty:
                return drained
            drained += 1
            next_seq = None
            if not self.buffer.knows(request.model_id):  # first sight: the model's progress is in the database
                applied = s.scalar(
                    sa.select(TrainingModel.last_applied_seq_id).where(TrainingModel.id == request.model_id)
                )
                next_seq = (applied + 1) if applied is not None else request.seq_id
            try:
                self.buffer.add(request, next_seq=next_seq)
            except ValueError:  # its seq_id ran already
                state = s.scalar(sa.select(Request.state).where(Request.id == request.id))
                if state in (RequestState.DONE, RequestState.FAILED):
                    continue  # a second copy of a finished request (it may arrive twice around a restart)
                # a pending request the model is past: cannot happen while (model_id, seq_id) is unique,
                # but its future must never hang
                log.error("seq_id %s of %s already ran: failing %s", request.seq_id, request.model_id, request.id)
                answers = self._store([request], {request.id: Outcome.failed(
                    f"seq_id {request.seq_id}: the model is past it already", "user")}, utcnow())
                self.notifier.notify(request.id, answers[request.id])

    def _skip_stalled_gaps(self, s: Session) -> None:
        """The rule for a seq_id that never comes (lost on the network, or refused before its body
        could be read): once a later request of its model has waited `seq_gap_seconds` behind it,
        every missing seq_id before that request is recorded as failed ("never arrived") at once,
        and that request fails too, without running: the missing ones may have held gradients or a
        step it depends on. Requests after it run as usual. A missing request that arrives later
        finds its seq_id taken (api/submit.py) and gets the failed record: it never runs after
        requests that went on without it, and its caller is told."""
        for behind in self.buffer.stalled(time.monotonic(), self.seq_gap_seconds):
            first = self.buffer.next_seq(behind.model_id)
            arrived = set(s.scalars(sa.select(Request.seq_id).where(
                Request.model_id == behind.model_id, Request.seq_id >= first, Request.seq_id < behind.seq_id)))
            missing = [seq for seq in range(first, behind.seq_id) if seq not in arrived]
            if not missing:
                continue  # they arrived meanwhile and wait in the inbox
            gap = f"{missing[0]}" if len(missing) == 1 else f"{missing[0]}-{missing[-1]}"
            rows = [Request(tenant_id=behind.tenant_id, model_id=behind.model_id, seq_id=seq,
                            kind=RequestKind.REJECTED, payload=RejectedPayload().to_bytes(),
                            payload_content_type=JSON, error=_failure(
                                f"seq_id {seq}: never arrived; seq_id {behind.seq_id} waited {self.seq_gap_seconds:g} s "
                                "behind it, so it was skipped. Sent now, it is not run: the model's later requests "
                                "went on without it"))
                    for seq in missing]
            s.add_all(rows)
            s.execute(sa.update(Request).where(Request.id == behind.id).values(error=_failure(
                f"seq_id {behind.seq_id}: not run, because seq_id {gap} of this model never arrived within "
                f"{self.seq_gap_seconds:g} s (lost on the way, or refused before its body could be read); it may "
                "have held gradients or a step this request depends on. Later requests of the model run as usual")))
            try:
                s.commit()
            except IntegrityError:  # one arrived just now: look again next cycle
                s.rollback()
                continue
            log.warning("%s: seq_id %s never arrived; seq_id %s fails", behind.model_id, gap, behind.seq_id)
            for row in rows:
                self.buffer.add(queued(row))

    # --- running ---------------------------------------------------------------------------------

    def step(self) -> bool:
        """Plan and run one cycle; False when there was nothing to run. A request run in parts
        (scheduler/planner.py) runs one part per cycle; it finishes, is stored and answered, and its
        model moves on, only with its last part. Its progress lives in this process and in the
        engine that ran its parts: after a restart the request runs again from its first datum, and
        an engine that outlived the scheduler (a Celery worker) answers the parts it ran from there."""
        replayed = self._replay_next()  # one request of a model recovering from a restart, if any
        with self.sessions() as s:
            if self._drain_inbox(s) and self._idle and self.gather_seconds:
                time.sleep(self.gather_seconds)  # the first arrival after idling waits for its peers
                self._drain_inbox(s)
            self._skip_stalled_gaps(s)
            runnable = {m: run for m, run in self.buffer.runnable().items() if m not in self.replaying}
            cycle = self.planner.plan(runnable)
            self._idle = not cycle and not replayed
            if not cycle:
                return replayed
            if upcoming := self.planner.upcoming(runnable, cycle):  # paged in while this cycle runs
                self.executor.prefetch(upcoming)
            requests = cycle.all()
            self.buffer.start([q for q in requests if q.id not in cycle.continuing])  # those are running already
            selected = s.execute(sa.select(Request.id, Request.payload, Request.error)
                                 .where(Request.id.in_([q.id for q in requests])))
            rows = {row.id: row for row in selected}
            # A request whose failure was recorded before it ran (refused at the door, or behind a
            # seq_id that never arrived) only passes its seq_id: the executor never sees it.
            refused = {q.id: Outcome(error=dict(rows[q.id].error)) for q in requests if rows[q.id].error}
            jobs = {q.id: Job(q, rows[q.id].payload, cycle.parts.get(q.id)) for q in requests if q.id not in refused}
        # Two engine calls: first the cycle's whole requests (and its optim_steps and other operations),
        # answered at once, then the parts of large requests. A part never shares an engine pass with
        # another request (workers/trainer/parts.py), so nothing batches less, and a small request
        # waits only for the part that was running when it arrived, not for one beside it too.
        whole = cycle.keeping(lambda q: q.id not in refused and q.id not in cycle.parts)
        in_parts = Cycle(forward_backward=[q for q in cycle.forward_backward
                                           if q.id in cycle.parts and q.id not in refused])
        for batch, decided in ((whole, refused), (in_parts, {})):
            batch_requests = batch.all() + [q for q in requests if q.id in decided]
            if batch_requests:
                self._run_batch(batch, batch_requests, jobs, decided)
        return True

    def _run_batch(self, batch: Cycle, requests: list[QueuedRequest], jobs: dict[str, Job],
                   decided: dict[str, Outcome]) -> None:
        """Run one engine call of a cycle (`decided`: requests of it answered without running); store and
        answer what finished: all but the parts of large requests that have more to run."""
        # Placed per call: an engine found dead by the cycle's first call is replaced before its parts run.
        moved = self.executor.place({q.model_id for q in requests})
        if moved:  # their worker (or engine process) died: rebuild the gradients it held there, first
            with self.sessions() as s:
                self._replay_lost_work(s, only=moved)
            for request_id, job in list(jobs.items()):  # a request's parts that ran there died with it too
                if job.part is not None and job.part.start > 0 and job.request.model_id in moved:
                    self.planner.restart(request_id)
                    jobs[request_id] = replace(job, part=replace(job.part, start=0))
        # No "running" commit here: it would cost a database write per cycle on the latency path,
        # and recovery re-runs pending and running requests alike. started_at is stored with the outcome.
        started_at = utcnow()
        parts = [q.id for q in requests if q.id in self.planner.splits]
        for request_id in parts:
            self.planner.splits[request_id].started_at = self.planner.splits[request_id].started_at or started_at
        self.cycle_log.record(batch)
        try:
            with metrics.CYCLE_SECONDS.time():
                outcomes = self.executor.run_cycle(batch, jobs) if batch else {}
            outcomes.update(decided)
        except Exception as e:  # the executor should not raise; if it does, fail the cycle clearly
            log.exception("cycle failed")
            outcomes = {q.id: Outcome.failed(f"internal error: {e}", "server") for q in requests}
        going_on = {request_id for request_id in parts if outcomes.get(request_id) and outcomes[request_id].progress}
        first_started = {}
        for request_id in parts:
            if request_id in going_on:
                self.planner.advanced(request_id, outcomes[request_id].progress)
            else:
                first_started[request_id] = self.planner.splits[request_id].started_at
                self.planner.finished(request_id)
        batchable = [q for q in requests if q.kind in BATCHABLE_KINDS]
        observe(Cycle(forward_backward=batchable, others=[q for q in requests if q not in batchable]),
                outcomes, going_on)
        finished = [q for q in requests if q.id not in going_on]
        if not finished:  # a part with more to come: nothing to store (what ran lives in the engine)
            return
        answers = self._store(finished, outcomes, started_at, first_started)
        self.buffer.finish(finished)
        for q in finished:
            self.notifier.notify(q.id, answers[q.id])

    def _store(self, requests: list[QueuedRequest], outcomes: dict[str, Outcome], started_at,
               first_started: dict[str, datetime] | None = None) -> dict[str, Answer]:
        """Commit every request's outcome and its model's progress together; the answers, as stored.
        `first_started`: the start of requests that began before this cycle (run in parts)."""
        answers, updates, checkpoints, progress = {}, [], [], {}
        now = utcnow()
        for q in requests:
            outcome = outcomes.get(q.id) or Outcome.failed("no outcome was produced", "server")
            answers[q.id] = Answer(outcome.result, outcome.content_type, outcome.error)
            updates.append({
                "id": q.id, "result": outcome.result, "result_content_type": outcome.content_type,
                "error": outcome.error, "state": RequestState.FAILED if outcome.error else RequestState.DONE,
                "started_at": (first_started or {}).get(q.id, started_at), "finished_at": now,
            })
            if outcome.checkpoint:
                checkpoints.append((q, outcome.checkpoint))
            progress[q.model_id] = max(progress.get(q.model_id, q.seq_id), q.seq_id)
        with self.sessions() as s:
            # by primary key, without loading the rows (a cycle's database work is on every request's latency)
            s.execute(sa.update(Request), updates)
            run_metrics.store_outcomes(s, requests, outcomes)  # the dashboard's numbers, with their outcomes
            for q, checkpoint in checkpoints:
                self._record_checkpoint(s, q, checkpoint)
            for model_id, seq_id in progress.items():
                s.execute(
                    sa.update(TrainingModel)
                    .where(TrainingModel.id == model_id, TrainingModel.last_applied_seq_id < seq_id)
                    .values(last_applied_seq_id=seq_id)
                )
            s.commit()
        return answers

    @staticmethod
    def _record_checkpoint(s: Session, q: QueuedRequest, info: dict) -> None:
        row = s.scalar(sa.select(Checkpoint).where(Checkpoint.tinker_path == info["tinker_path"]))
        if row is None:
            row = Checkpoint(tenant_id=q.tenant_id, model_id=q.model_id, tinker_path=info["tinker_path"])
            s.add(row)
        row.kind, row.name = info["kind"], info["name"]
        row.storage_path, row.size_bytes = info["storage_path"], info["size_bytes"]
        row.user_metadata, row.ephemeral = info.get("user_metadata"), bool(info.get("ephemeral"))
        row.created_at = utcnow()
        ttl = info.get("ttl_seconds")
        row.expires_at = row.created_at + timedelta(seconds=ttl) if ttl else None

    def run_forever(self) -> None:
        while not self._stop.is_set():  # the database may not answer yet: recover as soon as it does
            try:
                self.recover()
                break
            except Exception:
                log.exception("recovery failed; trying again")
                self._stop.wait(1.0)
        while not self._stop.is_set():
            try:
                ran = self.step()
            except Exception:  # e.g. the database is unreachable: keep the loop alive and retry
                log.exception("scheduler step failed")
                self._stop.wait(1.0)
                continue
            if not ran:
                self.wakeup.wait(timeout=0.5)
                self.wakeup.clear()

    def start(self) -> None:
        self.heartbeat.start()  # before recovery: the models it replays are held by this process
        self._thread = threading.Thread(target=self.run_forever, name="scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.wakeup.set()
        if self._thread:
            self._thread.join(timeout=30)
        self.heartbeat.stop()
