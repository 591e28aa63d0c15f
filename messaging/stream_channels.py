"""Streaming samples between processes (distributed mode): Redis pub/sub channels and their messages.

Each API replica listens on a channel of its own (subscribed when it starts, so no step of a later job
is missed) and names it in the streaming jobs it submits (`SampleJob.stream_to`); the sampler worker
that runs a job publishes each step's new tokens there, with the job's id, so a replica receives only
its own callers' streams. A replica whose caller went away publishes the job's id on the base model's
abort channel; the worker that runs it stops it. Messages are JSON: nothing is unpickled from the network.
"""

from __future__ import annotations

import json
import logging
import time

from contract.sampling import SampleDelta

log = logging.getLogger(__name__)


def keep_listening(error: Exception, pubsub, thread) -> None:
    """A pub/sub listener thread's exception handler: Redis away for a moment does not end it."""
    log.warning("listening on Redis pub/sub failed (%s); retrying", error)
    time.sleep(1.0)


def encode_deltas(request_id: str, deltas: list[SampleDelta]) -> bytes:
    return json.dumps({"request_id": request_id,
                       "deltas": [[d.index, d.tokens, d.logprobs, d.topk_logprobs] for d in deltas]}).encode()


def decode_deltas(raw: bytes) -> tuple[str, list[SampleDelta]]:
    """(request id, deltas); ValueError (or KeyError, TypeError) if the message is not one."""
    message = json.loads(raw)
    return str(message["request_id"]), [
        SampleDelta(index, tuple(tokens), tuple(logprobs),
                    None if topk is None else tuple(tuple((int(t), float(lp)) for t, lp in row) for row in topk))
        for index, tokens, logprobs, topk in message["deltas"]]
