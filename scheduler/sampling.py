"""Sample requests: from the API's request table to the sampler engine, and the results back.

Samples have no ordering requirement (protocol section 4.5), so they bypass the trainer's
seq_id reorder buffer: each accepted request goes straight to the sampler engine, which batches
whatever is in flight. The outcome is stored in the request row and the long-poll is woken,
as for training requests. On start, accepted but unfinished samples are submitted again.

A streaming job's new tokens go to the notifier as the engine makes them (`progress`), before its
outcome; only an engine in this process streams (`streams`), and a stream whose caller left is
aborted there (`abort`).
"""

from __future__ import annotations

import logging
import threading

import sqlalchemy as sa
from loraplex.wire.codec import PROTOBUF, encode_sample_response
from sqlalchemy.orm import Session, sessionmaker

from contract.errors import EngineError, SamplerBusy, SamplerUnavailable
from contract.kinds import RequestKind
from contract.sampling import SampleJob, SampleResult
from db import run_metrics, stability
from db.models import Request, RequestState, utcnow
from messaging.notify import Answer, Notifier

log = logging.getLogger(__name__)


class SamplingDispatcher:
    """`engine`: a SamplerEngine in this process, or a RemoteSamplerEngine (scheduler/remote_sampler.py)
    over Celery sampler workers; both call back with each outcome."""

    def __init__(self, sessions: sessionmaker[Session], engine, notifier: Notifier,
                 max_pending: int, base_model: str | None = None) -> None:
        self.sessions = sessions
        # the hub id of the base model its engine samples, where a database holds samples of several
        # (api/served_models.py); None: it recovers every sample
        self.base_model = base_model
        self.engine = engine
        self.notifier = notifier
        self.max_pending = max_pending
        # a second copy of a job in flight is dropped (messaging/bus.py); the job is kept for its outcome
        self._in_flight: dict[str, SampleJob] = {}
        self._lock = threading.Lock()

    def check_capacity(self) -> None:
        if self.engine.failed is not None:
            raise SamplerUnavailable(f"the sampler engine failed to start: {self.engine.failed}")
        if self.engine.pending >= self.max_pending:
            raise SamplerBusy(f"the sampler has {self.engine.pending} requests in flight (limit {self.max_pending})")

    @property
    def streams(self) -> bool:
        """Whether the engine reports a streaming job's tokens as it makes them (one in this process)."""
        return getattr(self.engine, "streams", False)

    def submit(self, job: SampleJob) -> None:
        with self._lock:
            if job.request_id in self._in_flight:
                return
            self._in_flight[job.request_id] = job
        if job.stream and self.streams:
            self.engine.submit(job, self._done, on_progress=self.notifier.progress)
        else:
            self.engine.submit(job, self._done)

    def abort(self, request_id: str) -> None:
        """Stop sampling `request_id` (its caller went away); it fails as cancelled. No-op once finished."""
        if getattr(self.engine, "abort", None) is not None:
            self.engine.abort(request_id)

    def recover(self) -> int:
        with self.sessions() as s:
            rows = s.scalars(
                sa.select(Request).where(Request.kind == RequestKind.SAMPLE, Request.state == RequestState.PENDING)
                .order_by(Request.created_at)
            ).all()
            jobs = [SampleJob.from_json(row.payload) for row in rows]
        # a job stored before jobs named their base model is taken by each (its outcome is written once more)
        jobs = [job for job in jobs if self.base_model is None or job.base_model in (None, self.base_model)]
        for job in jobs:
            self.submit(job)
        return len(jobs)

    def _done(self, request_id: str, outcome: SampleResult | EngineError) -> None:
        with self._lock:
            job = self._in_flight.get(request_id)
        with self.sessions() as s:
            row = s.get(Request, request_id)
            if isinstance(outcome, EngineError):
                row.error, row.state = {"error": str(outcome), "category": outcome.category}, RequestState.FAILED
            else:
                row.result = encode_sample_response(
                    outcome.sequences, outcome.prompt_logprobs, topk_prompt_logprobs=outcome.topk_prompt_logprobs,
                    topk_k=outcome.topk, prompt_cache_hit_tokens=outcome.prompt_cache_hit_tokens,
                    target_prompt_logprobs=outcome.target_prompt_logprobs, target_prompt_csr=outcome.target_prompt_csr,
                    prompt_alt_tokens=outcome.prompt_alt_tokens,
                )
                row.result_content_type, row.state = PROTOBUF, RequestState.DONE
                row.output_tokens = sum(len(seq.tokens) for seq in outcome.sequences)  # usage
                if job is None:  # an outcome for a job this process did not submit (one from before a restart)
                    job = SampleJob.from_json(row.payload)
                # the dashboard's numbers of a run's snapshot, in the result's transaction
                run_metrics.record_sample(s, row, job.adapter_path, job.policy_version, outcome.sequences)
                if job.recorded_sequence_ids:  # in the result's transaction: no answer without its record
                    stability.record(s, row.tenant_id, row.model_id, job, outcome.sequences, utcnow())
                    stability.prune_expired(s, utcnow())
            row.finished_at = utcnow()
            s.commit()
            answer = Answer.of_row(row)
        with self._lock:
            self._in_flight.pop(request_id, None)
        self.notifier.notify(request_id, answer)

    def close(self) -> None:
        self.engine.close()
