"""`stream: true` in distributed mode: an API replica, the scheduler and a Celery sampler worker (vLLM),
each its own process. The worker publishes each step's tokens straight to the API replica, which streams
them; the chunks add up to the stored turn; a client that leaves stops the sample on the worker."""

from __future__ import annotations

import json

import httpx
import loraplex
import openai
import pytest
import redis
import sqlalchemy as sa

from api.routes.futures import FINISHED
from contract.redis_keys import sampler_key
from db.models import Request as RequestRow
from db.models import RequestState
from service.embedded import free_port
from tests.distributed.processes import (
    create_tenant_key,
    service_env,
    start_sampler,
    start_service,
    stop_all,
    wait_healthy,
)
from tests.redis_dbs import redis_url
from tests.service.conftest import drop_postgres_database, postgres_database
from tests.waiting import wait_until
from workers.sampler.engine import CANCELLED

pytestmark = pytest.mark.vllm
REDIS_URL = redis_url(__name__)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    redis.Redis.from_url(REDIS_URL).flushdb()
    data_dir = tmp_path_factory.mktemp("shared")
    pg_name = postgres_database()
    database_url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{pg_name}"
    port = free_port()
    env = service_env(REDIS_URL, data_dir, LORAPLEX_DATABASE_URL=database_url, LORAPLEX_LONG_POLL_SECONDS="5")
    processes = {"s1": start_sampler("s1", data_dir, REDIS_URL),
                 "scheduler": start_service("scheduler", env),
                 "api": start_service("api", env, "--port", str(port))}
    base_url = f"http://127.0.0.1:{port}"
    wait_healthy(processes["api"], base_url)
    yield {"base_url": base_url, "key": create_tenant_key(database_url, "streamer"), "database_url": database_url}
    stop_all(processes.values())
    drop_postgres_database(pg_name)


def test_a_stream_comes_token_by_token_from_the_worker_and_a_gone_client_stops_it(deployment):
    base_url, key = deployment["base_url"], deployment["key"]
    client = openai.OpenAI(base_url=f"{base_url}/oai/api/v1", api_key=key, max_retries=0, timeout=300)
    chunks = list(client.completions.create(
        model="tiny", prompt=[5, 6, 7, 8, 9], max_tokens=12, temperature=0.0, logprobs=0, stream=True,
        extra_body={"return_tokens_as_token_ids": True}, extra_headers={"X-Loraplex-Session": "far"}))
    with_tokens = [c.choices[0].logprobs.tokens for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(with_tokens) > 1  # token by token, not one chunk at the end
    [turn] = loraplex.RolloutsClient(loraplex.ServiceClient(base_url=base_url, api_key=key)).get_trajectory("far").turns
    assert [int(t.removeprefix("token_id:")) for ts in with_tokens for t in ts] == turn.samples[0].tokens
    assert chunks[-1].choices[0].finish_reason == "length"

    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1500, "temperature": 0.0, "stream": True}
    with httpx.stream("POST", f"{base_url}/oai/api/v1/completions", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {key}"}) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the first event, then the client goes away
    outcome = wait_until(lambda: cancelled_sample(deployment["database_url"]), "the 1500-token sample to finish",
                         timeout=60, interval=0.2)
    assert outcome == (RequestState.FAILED, CANCELLED)  # stopped on the worker, not 1500 tokens later
    workers = redis.Redis.from_url(REDIS_URL)
    assert json.loads(workers.get(sampler_key("s1")))["ready"]  # and the worker serves on
    assert list(client.completions.create(model="tiny", prompt=[5], max_tokens=2, stream=True))[-1] \
        .choices[0].finish_reason == "length"


def cancelled_sample(database_url: str):
    """(state, error) of the 1500-token sample once it finished; None before."""
    engine = sa.create_engine(database_url)
    try:
        with engine.connect() as c:
            rows = c.execute(sa.select(RequestRow.state, RequestRow.error)
                             .where(RequestRow.num_tokens == 3, RequestRow.state.in_(FINISHED))).all()
    finally:
        engine.dispose()
    return (rows[0].state, rows[0].error["error"] if rows[0].error else None) if rows else None
