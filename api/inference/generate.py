"""A prompt through the sampler, the way asample sends one (api/routes/sampling.py): the same quotas,
backpressure and request row (so usage counts it), the same dispatcher and multi-LoRA batches. The
difference is only who waits: the route itself, for the stored outcome, as retrieve_future does.

`generate` waits for the whole outcome; `generate_stream` hands out each engine step's new tokens
as the engine makes them (`stream: true`), then the same stored outcome.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack
from dataclasses import dataclass

from fastapi import Request
from loraplex.wire.client import decode_sample_response
from loraplex.wire.codec import SampledSequenceWire
from starlette.concurrency import run_in_threadpool

from api.inference.errors import InferenceError
from api.inference.targets import Target
from api.routes.futures import FINISHED, RECHECK_SECONDS, wait_for_answer
from api.routes.sampling import admit_sample
from api.submit import submit
from contract.kinds import RequestKind
from contract.sampling import SampleDelta, SampleJob, SamplingOptions
from db import rollouts
from db.models import Request as RequestRow
from db.models import new_id
from messaging.notify import Answer, Finished

log = logging.getLogger(__name__)
# An inference call is answered when its samples are done; past this it is a 504 (the samples finish
# anyway and count as usage, but nothing is recorded: the caller got no answer).
MAX_WAIT_SECONDS = 600.0
STREAMING_NOT_SUPPORTED = "stream: this server's sampler does not stream"


@dataclass(frozen=True)
class Generation:
    request_id: str
    sequences: list[SampledSequenceWire]  # tokens (stop token included), logprobs, top-k rows
    cached_prompt_tokens: int


def _submit(request: Request, tenant_id: str, target: Target, job: SampleJob) -> None:
    dispatcher = target.served.sampling
    with request.app.state.sessions() as db:
        rollouts.check_quota(db, tenant_id)  # every call is recorded: refuse before sampling, not after
        admit_sample(db, dispatcher, tenant_id, len(job.prompt) + job.options.max_tokens * job.num_samples)
        submit(target.served.scheduler, db, tenant_id=tenant_id, model_id=None, seq_id=None,
               kind=RequestKind.SAMPLE, payload=job.to_json(), num_tokens=len(job.prompt),
               request_id=job.request_id, dispatch=lambda: dispatcher.submit(job))


def _stored_answer(request: Request, request_id: str) -> Answer | None:
    with request.app.state.sessions() as db:
        row = db.get(RequestRow, request_id)
        return Answer.of_row(row) if row is not None and row.state in FINISHED else None


def _job(request: Request, target: Target, prompt: list[int], num_samples: int, options: SamplingOptions,
         topk: int, stream: bool = False, stream_to: str | None = None) -> SampleJob:
    if target.served.sampling is None:
        raise InferenceError(400, f"model: sampling is not available for {target.served.name}: "
                                  f"{target.served.sampling_unavailable}")
    return SampleJob(request_id=new_id(), prompt=tuple(prompt), num_samples=num_samples, options=options,
                     adapter_path=target.adapter_path, topk_sample_logprobs=topk,
                     policy_version=target.policy_version, stream=stream, stream_to=stream_to,
                     base_model=target.served.name)


def _generation(request_id: str, answer: Answer) -> Generation:
    if answer.error is not None:
        status = 400 if answer.error.get("category") == "user" else 500
        raise InferenceError(status, f"model: sampling failed: {answer.error.get('error', '')}")
    decoded = decode_sample_response(answer.result)
    return Generation(request_id, decoded["sequences"], decoded["prompt_cache_hit_tokens"])


async def generate(request: Request, tenant_id: str, target: Target, prompt: list[int], num_samples: int,
                   options: SamplingOptions, topk: int) -> Generation:
    """Sample `num_samples` continuations of `prompt` from `target`; raises InferenceError."""
    job = _job(request, target, prompt, num_samples, options, topk)

    async def still_connected() -> None:
        if await request.is_disconnected():
            raise InferenceError(400, "the client disconnected before the samples were done")

    with request.app.state.notifier.watch(job.request_id) as watch:  # before submitting: no wake-up is missed
        await run_in_threadpool(_submit, request, tenant_id, target, job)
        answer = await wait_for_answer(watch, time.monotonic() + MAX_WAIT_SECONDS,
                                       lambda: run_in_threadpool(_stored_answer, request, job.request_id),
                                       still_connected)
    if answer is None:
        raise InferenceError(504, f"model: the sampler did not finish within {MAX_WAIT_SECONDS:.0f} s")
    return _generation(job.request_id, answer)


class GenerationStream:
    """A submitted streaming sample: iterate it for lists of `SampleDelta` (one engine step's new tokens
    of one or more samples, by sample index) as the engine makes them, and last the `Generation`
    (the stored outcome). Each sample's deltas, joined in order, are exactly its stored tokens,
    logprobs and top-k rows (stop token included). A failure of the sampler after the start raises
    InferenceError from the iteration. `aclose` (always call it: `async with` does) aborts the
    sample in the engine if it is still running, e.g. when the client went away."""

    def __init__(self, request: Request, job: SampleJob, exits: ExitStack, feed, streamer) -> None:
        self.request, self.job, self.request_id, self._streamer = request, job, job.request_id, streamer
        self._exits, self._feed = exits, feed
        self._sent: dict[int, int] = {}  # tokens handed out per sample index
        self.finished = False

    async def __aenter__(self) -> "GenerationStream":
        return self

    async def __aexit__(self, *_) -> None:
        await self.aclose()

    async def __aiter__(self) -> AsyncIterator[list[SampleDelta] | Generation]:
        deadline = time.monotonic() + MAX_WAIT_SECONDS
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise InferenceError(504, f"model: the sampler did not finish within {MAX_WAIT_SECONDS:.0f} s")
            try:
                item = await asyncio.wait_for(self._feed.items.get(), timeout=min(remaining, RECHECK_SECONDS))
            except asyncio.TimeoutError:  # a lost wake-up only delays: the database has the outcome
                answer = await run_in_threadpool(_stored_answer, self.request, self.request_id)
                if answer is None:
                    continue
                item = Finished(answer)
            if isinstance(item, Finished):
                break
            for delta in item:
                self._sent[delta.index] = self._sent.get(delta.index, 0) + len(delta.tokens)
            yield item
        answer = item.answer or await run_in_threadpool(_stored_answer, self.request, self.request_id)
        self.finished = True
        generation = _generation(self.request_id, answer)
        rest = self._catch_up(generation)
        if rest:
            yield rest
        yield generation

    def _catch_up(self, generation: Generation) -> list[SampleDelta]:
        """Tokens of the outcome no delta carried (none when the engine reported every step)."""
        rest = []
        for index, seq in enumerate(generation.sequences):
            sent = self._sent.get(index, 0)
            if sent < len(seq.tokens):
                rows = seq.topk_logprobs[sent:] if seq.topk_logprobs is not None else None
                rest.append(SampleDelta(index, tuple(seq.tokens[sent:]), tuple(seq.logprobs[sent:]),
                                        None if rows is None else tuple(tuple(map(tuple, r)) for r in rows)))
        return rest

    async def aclose(self) -> None:
        try:
            if not self.finished:
                self.finished = True
                self._streamer.abort(self.request_id)
        except Exception:  # (Redis away): the sample runs to its end, unread
            log.exception("aborting %s failed", self.request_id)
        finally:
            self._exits.close()


def _streamer(request: Request, target: Target):
    """What streams `target`'s samples and aborts them (`abort(request_id)`): the dispatcher of an engine
    in this process, or a distributed API replica's RemoteStreams (messaging/remote_streams.py); else None."""
    dispatcher = target.served.sampling
    if getattr(dispatcher, "streams", False):
        return dispatcher
    return target.served.streams


async def generate_stream(request: Request, tenant_id: str, target: Target, prompt: list[int], num_samples: int,
                          options: SamplingOptions, topk: int) -> GenerationStream:
    """Submit a streaming sample of `num_samples` continuations of `prompt` from `target`. Every refusal
    (quota, a busy sampler, one that does not stream) raises InferenceError/HTTPException here, before
    the caller has sent anything; then iterate the returned stream (see GenerationStream)."""
    streamer = _streamer(request, target)
    job = _job(request, target, prompt, num_samples, options, topk, stream=True,
               stream_to=getattr(streamer, "channel", None))
    if streamer is None:
        raise InferenceError(400, STREAMING_NOT_SUPPORTED)
    exits = ExitStack()
    feed = exits.enter_context(request.app.state.notifier.feed(job.request_id))  # before submitting: no step missed
    try:
        await run_in_threadpool(_submit, request, tenant_id, target, job)
    except BaseException:
        exits.close()
        raise
    return GenerationStream(request, job, exits, feed, streamer)
