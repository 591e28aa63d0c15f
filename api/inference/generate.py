"""A prompt through the sampler, the way asample sends one (api/routes/sampling.py): the same quotas,
backpressure and request row (so usage counts it), the same dispatcher and multi-LoRA batches. The
difference is only who waits: the route itself, for the stored outcome, as retrieve_future does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from api.inference.errors import InferenceError
from api.inference.targets import Target
from api.routes.futures import FINISHED, RECHECK_SECONDS
from api.routes.sampling import admit_sample
from api.submit import submit
from contract.kinds import RequestKind
from db.models import Request as RequestRow
from db.models import new_id
from loraplex.wire.client import decode_sample_response
from loraplex.wire.codec import SampledSequenceWire
from scheduler.notify import Answer
from workers.sampler.jobs import SampleJob, SamplingOptions

# An inference call is answered when its samples are done; past this it is a 504 (the samples finish
# anyway and count as usage, but nothing is recorded: the caller got no answer).
MAX_WAIT_SECONDS = 600.0


@dataclass(frozen=True)
class Generation:
    request_id: str
    sequences: list[SampledSequenceWire]  # tokens (stop token included), logprobs, top-k rows
    cached_prompt_tokens: int


def _submit(request: Request, tenant_id: str, job: SampleJob) -> None:
    dispatcher = request.app.state.sampling
    with request.app.state.sessions() as db:
        admit_sample(db, dispatcher, tenant_id, len(job.prompt) + job.options.max_tokens * job.num_samples)
        submit(request.app.state.scheduler, db, tenant_id=tenant_id, model_id=None, seq_id=None,
               kind=RequestKind.SAMPLE, payload=job.to_json(), num_tokens=len(job.prompt),
               request_id=job.request_id, dispatch=lambda: dispatcher.submit(job))


def _stored_answer(request: Request, request_id: str) -> Answer | None:
    with request.app.state.sessions() as db:
        row = db.get(RequestRow, request_id)
        return Answer.of_row(row) if row is not None and row.state in FINISHED else None


async def generate(request: Request, tenant_id: str, target: Target, prompt: list[int], num_samples: int,
                   options: SamplingOptions, topk: int) -> Generation:
    """Sample `num_samples` continuations of `prompt` from `target`; raises InferenceError."""
    if request.app.state.sampling is None:
        raise InferenceError(400, f"model: sampling is not available on this server: "
                                  f"{request.app.state.sampling_unavailable}")
    job = SampleJob(request_id=new_id(), prompt=tuple(prompt), num_samples=num_samples, options=options,
                    adapter_path=target.adapter_path, topk_sample_logprobs=topk,
                    policy_version=target.policy_version)
    deadline = time.monotonic() + MAX_WAIT_SECONDS
    with request.app.state.notifier.watch(job.request_id) as watch:  # before submitting: no wake-up is missed
        await run_in_threadpool(_submit, request, tenant_id, job)
        answer = None
        while answer is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise InferenceError(504, f"model: the sampler did not finish within {MAX_WAIT_SECONDS:.0f} s")
            if await request.is_disconnected():
                raise InferenceError(400, "the client disconnected before the samples were done")
            try:
                await asyncio.wait_for(watch.finished.wait(), timeout=min(remaining, RECHECK_SECONDS))
            except asyncio.TimeoutError:
                pass
            watch.finished.clear()
            answer = watch.answer or await run_in_threadpool(_stored_answer, request, job.request_id)
    if answer.error is not None:
        status = 400 if answer.error.get("category") == "user" else 500
        raise InferenceError(status, f"model: sampling failed: {answer.error.get('error', '')}")
    decoded = decode_sample_response(answer.result)
    return Generation(job.request_id, decoded["sequences"], decoded["prompt_cache_hit_tokens"])
