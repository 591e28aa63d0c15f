"""Finding live workers reads the registry set, not a SCAN of Redis (messaging/celery_app.py)."""

import redis

from contract.redis_keys import REGISTRY, sampler_key, worker_key
from messaging.celery_app import heartbeat, live_registrations
from tests.redis_dbs import redis_url

REDIS_URL = redis_url(__name__)
MODEL = "registry-test"  # no scheduler of a real base model mistakes these for its workers


def record(worker_id: str, base_model: str = MODEL) -> dict:
    return {"worker_id": worker_id, "base_model": base_model, "queues": [f"q.{worker_id}"]}


def test_live_workers_come_from_the_registry_and_expired_ones_leave_it():
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    try:
        heartbeat(client, worker_key("w1"), record("w1"))
        heartbeat(client, worker_key("w2"), record("w2", base_model="another-model"))
        heartbeat(client, sampler_key("s1"), record("s1"))
        heartbeat(client, worker_key("gone"), record("gone"))
        client.delete(worker_key("gone"))  # its registration expired
        client.set("loraplex:worker:not-registered", b"{}")  # a key outside the registry is never read

        assert set(live_registrations(client, worker_key, MODEL)) == {"w1"}
        assert set(live_registrations(client, sampler_key, MODEL)) == {"s1"}
        assert client.smembers(REGISTRY) == {worker_key(n).encode() for n in ("w1", "w2")} | {sampler_key("s1").encode()}

        heartbeat(client, worker_key("gone"), record("gone"))  # it beats again: back in the registry
        assert set(live_registrations(client, worker_key, MODEL)) == {"w1", "gone"}
    finally:
        client.flushdb()
