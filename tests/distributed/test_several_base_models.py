"""Two base models in one distributed deployment: an API replica serving both (LORAPLEX_BASE_MODEL=a,b),
one scheduler and one Celery trainer worker per model, all on one Postgres and one Redis. Each run
trains on its own model's worker; a restarted scheduler takes back only its own model's requests, and
the other model's wait for their own."""

from __future__ import annotations

import httpx
import numpy as np
import redis
import tinker
from loraplex.wire.client import decode_forward_backward_output, encode_forward_backward_request

from contract.redis_keys import worker_key
from service.embedded import free_port
from tests.distributed.processes import (
    create_tenant_key,
    service_env,
    start_service,
    start_worker,
    stop_all,
    wait_for,
    wait_healthy,
)
from tests.redis_dbs import redis_url
from tests.service.conftest import drop_postgres_database, postgres_database
from tests.service.test_several_base_models import MODELS, TOKENS, base_logprobs, scored

REDIS_URL = redis_url(__name__)


def test_each_models_runs_train_on_its_own_scheduler_and_worker(tmp_path):
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    pg_name = postgres_database()
    database_url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{pg_name}"
    port = free_port()
    common = dict(LORAPLEX_DATABASE_URL=database_url, LORAPLEX_SAMPLER_ENABLED="false",
                  LORAPLEX_LONG_POLL_SECONDS="5")
    one = {name: service_env(REDIS_URL, tmp_path, LORAPLEX_BASE_MODEL=name, **common) for name in MODELS}
    processes = {f"worker {name}": start_worker(f"w{i}", tmp_path, REDIS_URL, LORAPLEX_BASE_MODEL=name)
                 for i, name in enumerate(MODELS)}
    processes |= {f"scheduler {name}": start_service("scheduler", one[name]) for name in MODELS}
    processes["api"] = start_service("api", service_env(REDIS_URL, tmp_path, LORAPLEX_BASE_MODEL=",".join(MODELS),
                                                        **common), "--port", str(port))
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(processes["api"], base_url)
        assert [client.get(worker_key(f"w{i}")) is not None for i in range(2)] == [True, True]
        key = create_tenant_key(database_url, "ada")
        service = tinker.ServiceClient(base_url=base_url, api_key=key)
        for name in MODELS:
            run = service.create_lora_training_client(base_model=name, rank=4, seed=3).result()
            assert run.get_info().model_data.model_name == name
            out = run.forward([scored(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
            np.testing.assert_allclose(out, base_logprobs(name, TOKENS), atol=1e-5)

        # tiny-qwen3's scheduler away: its new run waits, and tiny's restarted scheduler does not take it
        stop_all([processes.pop(f"scheduler {MODELS[1]}")])
        http = httpx.Client(base_url=f"{base_url}/api/v1", headers={"X-API-Key": key}, timeout=30)
        session = http.post("/create_session", json={}).json()["session_id"]
        waiting = http.post("/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": MODELS[1],
                                                   "lora_config": {"rank": 4, "seed": 4}}).json()
        stop_all([processes.pop(f"scheduler {MODELS[0]}")])
        processes[f"scheduler {MODELS[0]}"] = start_service("scheduler", one[MODELS[0]])
        tiny = service.create_lora_training_client(base_model=MODELS[0], rank=4, seed=4).result()
        assert tiny.forward([scored(TOKENS)], "cross_entropy").result().loss_fn_outputs
        pending = http.post("/retrieve_future", json={"request_id": waiting["request_id"]}).json()
        assert pending.get("type") == "try_again", pending
        processes[f"scheduler {MODELS[1]}"] = start_service("scheduler", one[MODELS[1]])
        wait_for(http.post, waiting["request_id"], seconds=180)
        inputs = {"target_tokens": np.array(TOKENS[1:]), "weights": np.ones(len(TOKENS) - 1, np.float32)}
        body = encode_forward_backward_request(waiting["model_id"], 1, [(TOKENS[:-1], inputs)], "cross_entropy",
                                               forward_only=True)
        forward = http.post("/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf",
                                                                         "Content-Encoding": "zstd"}).json()
        logprobs = decode_forward_backward_output(wait_for(http.post, forward["request_id"]))[0][0]["logprobs"]
        np.testing.assert_allclose(logprobs.tolist(), base_logprobs(MODELS[1], TOKENS), atol=1e-5)
    finally:
        stop_all(processes.values())
        drop_postgres_database(pg_name)
