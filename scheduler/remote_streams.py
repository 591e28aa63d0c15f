"""An API replica's side of streaming in distributed mode: each streaming job's new tokens, published
by the sampler worker that runs it, to this replica's Notifier; and aborts of jobs whose caller went
away, to the workers (channels and messages: workers/sampler/stream_channels.py).
"""

from __future__ import annotations

import logging

import redis

from scheduler.notify import Notifier
from workers.sampler.stream_channels import STREAM_PATTERN, STREAM_PREFIX, abort_channel, decode_deltas, keep_listening

log = logging.getLogger(__name__)


class RemoteStreams:
    streams = True  # generate_stream's test for a sampler that streams

    def __init__(self, client: redis.Redis, notifier: Notifier, base_model: str) -> None:
        self.redis, self.notifier, self.base_model = client, notifier, base_model
        self._pubsub = client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.psubscribe(**{STREAM_PATTERN: self._on_deltas})  # now: before any job is submitted
        self._thread = None

    def start(self) -> "RemoteStreams":
        self._thread = self._pubsub.run_in_thread(sleep_time=0.5, daemon=True, exception_handler=keep_listening)
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.stop()

    def _on_deltas(self, message: dict) -> None:
        request_id = message["channel"].decode().removeprefix(STREAM_PREFIX)
        try:
            self.notifier.progress(request_id, decode_deltas(message["data"]))
        except ValueError:
            log.warning("an unreadable stream message for %s", request_id)

    def abort(self, request_id: str) -> None:
        """Stop the job on whichever worker runs it (none: nothing happens)."""
        self.redis.publish(abort_channel(self.base_model), request_id)
