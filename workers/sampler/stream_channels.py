"""Streaming samples between processes (distributed mode): Redis pub/sub channels and their messages.

A sampler worker publishes each step's new tokens of a streaming job on the job's channel; every API
replica listens to all of them (one pattern subscription, made when it starts, so no step of a later
job is missed) and hands them to its Notifier, which drops those no call of its own follows. A
replica whose caller went away publishes the job's id on the base model's abort channel; the worker
that runs it stops it. Messages are JSON: nothing is unpickled from the network.
"""

from __future__ import annotations

import json
import logging
import time

from workers.sampler.jobs import SampleDelta

log = logging.getLogger(__name__)

STREAM_PREFIX = "loraplex:sample-stream:"
STREAM_PATTERN = STREAM_PREFIX + "*"


def stream_channel(request_id: str) -> str:
    return STREAM_PREFIX + request_id


def abort_channel(base_model: str) -> str:
    return f"loraplex:sample-abort:{base_model}"


def keep_listening(error: Exception, pubsub, thread) -> None:
    """A pub/sub listener thread's exception handler: Redis away for a moment does not end it."""
    log.warning("listening on Redis pub/sub failed (%s); retrying", error)
    time.sleep(1.0)


def encode_deltas(deltas: list[SampleDelta]) -> bytes:
    return json.dumps([[d.index, d.tokens, d.logprobs, d.topk_logprobs] for d in deltas]).encode()


def decode_deltas(raw: bytes) -> list[SampleDelta]:
    return [SampleDelta(index, tuple(tokens), tuple(logprobs),
                        None if topk is None else tuple(tuple((int(t), float(lp)) for t, lp in row) for row in topk))
            for index, tokens, logprobs, topk in json.loads(raw)]
