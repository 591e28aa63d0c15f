"""A request run in parts on a Celery trainer worker survives a restart of the scheduler halfway:
the worker keeps the parts that ran (their gradients and results), the restarted scheduler sends
the request from its first datum again, and the worker answers what already ran instead of
applying it twice."""

from __future__ import annotations

import pytest
import redis
from loraplex.types import AdamParams

from contract.inputs import ForwardBackwardInput
from service.embedded import ServerThread, free_port
from service.settings import Settings
from tests.distributed.processes import start_worker
from tests.redis_dbs import redis_url
from tests.service.conftest import drop_postgres_database, postgres_database
from tests.service.test_scheduling import PROTOBUF, http_client, proto_body, wait_result
from tests.service.test_split_requests import (
    LR,
    assert_same_output,
    engine_data,
    queue_a_request_in_parts,
    reference,
    rows,
    sdk_data,
)

REDIS_URL = redis_url(__name__)


@pytest.fixture
def deployment(tmp_path):
    redis.Redis.from_url(REDIS_URL).flushdb()
    pg_name = postgres_database()
    worker = start_worker("split-1", tmp_path, REDIS_URL)
    settings = Settings(data_dir=tmp_path, database_url=f"postgresql+psycopg://postgres@127.0.0.1:5432/{pg_name}",
                        port=free_port(), base_model="tiny", executor="celery", redis_url=REDIS_URL,
                        sampler_enabled=False, long_poll_seconds=5, max_lora_rank=16, cycle_token_budget=1024)
    yield settings
    worker.kill()
    worker.wait()
    drop_postgres_database(pg_name)


def test_a_scheduler_restart_halfway_through_a_request_in_parts_neither_repeats_nor_loses_a_part(
        deployment, tiny_model_path):
    warm, more, big, probe = rows(7, 1, 2), rows(8, 1, 3), rows(9), rows(10, 1, 2)
    first = ServerThread(deployment)
    try:
        key, model_id, big_id, step_id = queue_a_request_in_parts(first, warm, more, big)  # two parts on the worker
    finally:
        first.stop()

    second = ServerThread(deployment.model_copy(update={"port": free_port()}))
    try:
        with http_client(second, key) as http:
            result = wait_result(http, big_id)
            assert "metrics" in wait_result(http, step_id).json()
            # the weights after that step, read through a forward_backward of other data
            probe_id = http.post("/api/v1/forward_backward", content=proto_body(model_id, 6, sdk_data(probe)),
                                 headers=PROTOBUF).json()["request_id"]
            probed = wait_result(http, probe_id).content
    finally:
        second.stop()

    engine = reference(tiny_model_path, second, model_id)  # (its database is still there)
    engine.forward_backward([ForwardBackwardInput(model_id, engine_data(warm))])
    engine.optim_step([(model_id, AdamParams(learning_rate=LR))])
    engine.forward_backward([ForwardBackwardInput(model_id, engine_data(more))])
    expected_big = engine.forward_backward([ForwardBackwardInput(model_id, engine_data(big))])[0]
    engine.optim_step([(model_id, AdamParams(learning_rate=LR))])
    expected_probe = engine.forward_backward([ForwardBackwardInput(model_id, engine_data(probe))])[0]
    assert_same_output(result.content, expected_big)
    # the weights after the step: had a part run twice (or been lost), the step's gradient would differ
    assert_same_output(probed, expected_probe)
