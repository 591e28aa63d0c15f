"""Distributed mode lands on the bits of a model trained alone (issue 33), as the embedded service
does (tests/service/test_replay_bits.py): a model trains beside another tenant's model on a Celery
trainer worker (Postgres, Redis, a shared data dir); the worker is SIGKILLed while the model's
acknowledged gradient lives only in its memory, and a new worker replays that request from its
durable state, alone or beside the neighbour's replay. The final adapter (weights and Adam
moments) equals, with torch.equal, that of an engine that trained the model alone and never
stopped."""

from __future__ import annotations

import signal

import pytest
import redis
import tinker

from contract.redis_keys import worker_key
from service.embedded import ServerThread, free_port
from service.settings import Settings
from storage.live_slots import read_slots
from tests.distributed.processes import start_worker
from tests.redis_dbs import redis_url
from tests.servers import metric
from tests.service.conftest import drop_postgres_database, postgres_database
from tests.service.test_replay_bits import assert_same_bits, train_beside_a_neighbour, trained_alone
from tests.waiting import wait_until
from workers.trainer.engine import TrainerEngine

pytestmark = pytest.mark.slow  # two Celery worker processes start, one after the other
REDIS_URL = redis_url(__name__)
STEPS, KILL_AFTER = 3, 1  # the learning rates and data: tests/service/test_replay_bits.py's
EVERY_STEP = {"LORAPLEX_STATE_WRITE_INTERVAL_SECONDS": "0"}  # durable state after each optim_step


def test_a_replayed_worker_ends_on_the_bits_of_a_model_trained_alone(tmp_path, tiny_model_path):
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    pg_name = postgres_database()
    workers = [start_worker("w1", tmp_path, REDIS_URL, **EVERY_STEP)]
    settings = Settings(data_dir=tmp_path, database_url=f"postgresql+psycopg://postgres@127.0.0.1:5432/{pg_name}",
                        port=free_port(), base_model="tiny", executor="celery", redis_url=REDIS_URL,
                        sampler_enabled=False, long_poll_seconds=5, max_lora_rank=16, cycle_gather_seconds=0.2)
    server = ServerThread(settings)
    try:
        tc = tinker.ServiceClient(base_url=server.base_url, api_key=server.new_tenant()) \
            .create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
        neighbour = tinker.ServiceClient(base_url=server.base_url, api_key=server.new_tenant()) \
            .create_lora_training_client(base_model="tiny", rank=8, seed=3).result()

        def kill_the_worker() -> None:  # the gradient just acknowledged is in w1's memory only
            workers[0].send_signal(signal.SIGKILL)
            workers[0].wait()
            workers.append(start_worker("w2", tmp_path, REDIS_URL, **EVERY_STEP))
            wait_until(lambda: client.get(worker_key("w1")) is None,  # its registration expires: w1 is dead
                       "w1's registration to expire", timeout=60, interval=0.1)

        train_beside_a_neighbour(tc, neighbour, STEPS, KILL_AFTER, kill_the_worker)
        assert server.embedded.executor.placement()[tc.model_id] == "w2"
        # the two models did share cycles: more than one tenant per forward_backward cycle on average
        tenants = metric(server.base_url, "loraplex_cycle_tenants_sum")
        assert tenants > metric(server.base_url, "loraplex_cycle_tenants_count")
    finally:
        server.stop()
        workers[-1].send_signal(signal.SIGTERM)  # a warm shutdown finishes its durable writes
        workers[-1].wait(timeout=60)
        drop_postgres_database(pg_name)

    newest = read_slots(settings.live_dir, tc.model_id)[0]
    assert newest.manifest["step"] == STEPS
    restored = TrainerEngine(tiny_model_path, max_rank=16).load_state("restored", newest.path)
    assert_same_bits(restored, trained_alone(TrainerEngine(tiny_model_path, max_rank=16), STEPS))
