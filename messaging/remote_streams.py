"""An API replica's side of streaming in distributed mode: each streaming job's new tokens, published
by the sampler worker that runs it on this replica's channel, to this replica's Notifier; and aborts
of jobs whose caller went away, to the workers (channels and messages: messaging/stream_channels.py).
"""

from __future__ import annotations

import logging

import redis

from contract.redis_keys import abort_channel, replica_channel
from messaging.notify import Notifier
from messaging.stream_channels import decode_deltas

log = logging.getLogger(__name__)


class RemoteStreams:
    """This replica's channel for the streams it follows, named in its streaming jobs (SampleJob.stream_to).
    Its messages are read by the replica's FinishedListener (messaging/bus.py), on the connection
    that brings the finishes, so none overtakes the tokens it ends."""

    streams = True  # generate_stream's test for a sampler that streams

    def __init__(self, client: redis.Redis, notifier: Notifier, base_model: str, channel: str | None = None) -> None:
        """`channel`: the replica's, where it already has one (for another base model); else a new one."""
        self.redis, self.notifier, self.base_model = client, notifier, base_model
        self.channel = channel or replica_channel()

    def deliver(self, message: dict) -> None:
        """A message on this replica's channel: one job's new tokens, to the calls that follow it."""
        try:
            request_id, deltas = decode_deltas(message["data"])
        except (ValueError, KeyError, TypeError):
            log.warning("an unreadable message on %s", self.channel)
            return
        self.notifier.progress(request_id, deltas)

    def abort(self, request_id: str) -> None:
        """Stop the job on whichever worker runs it (none: nothing happens)."""
        self.redis.publish(abort_channel(self.base_model), request_id)
