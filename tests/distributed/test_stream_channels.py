"""A streaming job's tokens reach the API replica that follows it and no other, and before its finish
(real Redis pub/sub; the whole path through a Celery sampler worker: tests/distributed/test_streaming.py)."""

from __future__ import annotations

import asyncio

import redis

from contract.redis_keys import FINISHED
from contract.sampling import SampleDelta
from messaging.bus import FinishedListener
from messaging.notify import Finished, Notifier
from messaging.remote_streams import RemoteStreams
from messaging.stream_channels import encode_deltas
from tests.redis_dbs import redis_url

REDIS_URL = redis_url(__name__)
STEPS = 50


def test_a_replica_receives_its_streams_only_and_each_token_before_the_finish():
    client = redis.Redis.from_url(REDIS_URL)
    replicas = [RemoteStreams(client, Notifier(), "tiny") for _ in range(2)]
    listeners = [FinishedListener(client, replica.notifier, replica).start() for replica in replicas]
    follower, other = replicas
    assert follower.channel != other.channel
    deltas = [SampleDelta(0, (5 + i,), (-0.5 * i,), (((5 + i, -0.5 * i),),)) for i in range(STEPS)]

    async def follow():
        with follower.notifier.feed("r1") as followed, other.notifier.feed("r1") as elsewhere:
            # as a sampler worker publishes a job that names `follower`'s channel (SampleJob.stream_to),
            # then the scheduler its finish (on another connection, as they are)
            client.publish(follower.channel, b"not a stream message")  # dropped, and the listener goes on
            for delta in deltas:
                client.publish(follower.channel, encode_deltas("r1", [delta]))
            redis.Redis.from_url(REDIS_URL).publish(FINISHED, "r1")
            got = []
            while not isinstance(item := await asyncio.wait_for(followed.items.get(), timeout=10), Finished):
                got += item
            return got, elsewhere.items.qsize()  # `other` had its finish, nothing else

    try:
        got, elsewhere = asyncio.run(follow())
    finally:
        for listener in listeners:
            listener.stop()
    assert got == deltas  # all of them, in order, before the finish; topk rows as the tuples they were
    assert elsewhere == 1
