"""The full distributed deployment on loopback, every part its own process with the command an
operator runs: an API replica, the scheduler, two Celery trainer workers and a Celery sampler worker
(vLLM) or two, on Postgres and Redis, with the checkpoint store on a WebDAV server. The official SDK drives four tenants at once;
a sampler worker is killed while it samples; then the API and the scheduler are restarted with
requests accepted and waiting."""

from __future__ import annotations

import json
import signal
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import redis
import tinker
from loraplex.wire.client import decode_forward_backward_output, encode_forward_backward_request
from tinker import types

from contract.redis_keys import PLACEMENT, sampler_key
from service.embedded import free_port
from storage import store
from storage.checkpoint_files import read_manifest
from tests.distributed.processes import (
    create_tenant_key,
    service_env,
    start_sampler,
    start_service,
    start_worker,
    stop_all,
    wait_for,
    wait_healthy,
)
from tests.redis_dbs import redis_url
from tests.service.conftest import drop_postgres_database, postgres_database
from tests.uninterrupted import logprobs_after_steps
from tests.waiting import wait_until

REDIS_URL = redis_url(__name__)
GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0)


def port_is_free(port: int) -> bool:
    """Whether a server can listen on `port` again (with SO_REUSEADDR, as uvicorn binds)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, webdav_store):
    redis.Redis.from_url(REDIS_URL).flushdb()
    data_dir = tmp_path_factory.mktemp("shared")
    pg_name = postgres_database()
    database_url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{pg_name}"
    port = free_port()
    store_url = webdav_store()  # checkpoints, snapshots and adapter state on a WebDAV server
    env = service_env(REDIS_URL, data_dir, LORAPLEX_DATABASE_URL=database_url, LORAPLEX_LONG_POLL_SECONDS="5",
                      LORAPLEX_STORE_URL=store_url)
    worker_env = {"LORAPLEX_STORE_URL": store_url}
    processes = {"w1": start_worker("w1", data_dir, REDIS_URL, **worker_env),
                 "w2": start_worker("w2", data_dir, REDIS_URL, **worker_env),
                 "s1": start_sampler("s1", data_dir, REDIS_URL, **worker_env),
                 "s2": start_sampler("s2", data_dir, REDIS_URL, **worker_env),
                 "scheduler": start_service("scheduler", env),
                 "api": start_service("api", env, "--port", str(port))}
    state = {"processes": processes, "env": env, "port": port, "base_url": f"http://127.0.0.1:{port}",
             "database_url": database_url, "store_url": store_url, "data_dir": data_dir}
    wait_healthy(processes["api"], state["base_url"])
    yield state
    stop_all(processes.values())
    drop_postgres_database(pg_name)


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": np.ones(len(tokens) - 1, np.float32)})


def test_four_tenants_train_and_sample_at_once(deployment, tiny_model_path):
    keys = [create_tenant_key(deployment["database_url"], f"tenant-{i}") for i in range(4)]

    def run(i: int):
        tokens = list(range(10 + 50 * i, 40 + 50 * i))
        training = tinker.ServiceClient(base_url=deployment["base_url"], api_key=keys[i]) \
            .create_lora_training_client(base_model="tiny", rank=4, seed=i + 1).result()
        for _ in range(2):
            training.forward_backward([datum(tokens)], "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        logprobs = training.forward([datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        sampler = training.save_weights_and_get_sampling_client().result()
        sampled = sampler.sample(types.ModelInput.from_ints(tokens[:5]), 1, GREEDY).result().sequences[0]
        return training.model_id, tokens, logprobs, sampled

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, range(4)))

    for i, (_, tokens, logprobs, sampled) in enumerate(results):  # the numbers of one engine in one process
        expected = logprobs_after_steps(tiny_model_path, tokens, rank=4, seed=i + 1, steps=2, lr=1e-2)
        assert logprobs == pytest.approx(expected, rel=1e-5)
        assert len(sampled.tokens) == GREEDY.max_tokens and len(sampled.logprobs) == len(sampled.tokens)
    placement = redis.Redis.from_url(REDIS_URL).hgetall(PLACEMENT)
    assert {placement[model_id.encode()] for model_id, *_ in results} == {b"w1", b"w2"}
    for model_id, *_ in results:  # the adapters' state is on the remote store, nothing on local disk
        assert read_manifest(store.join(deployment["store_url"], "live", model_id)) is not None
    assert not any((deployment["data_dir"] / folder).exists() for folder in ("live", "checkpoints"))


def test_a_killed_sampler_workers_samples_finish_on_another(deployment):
    """A sample changes no state: when its worker dies, the scheduler sends it to a live one."""
    key = create_tenant_key(deployment["database_url"], "sampler-loss")
    sampler = tinker.ServiceClient(base_url=deployment["base_url"], api_key=key).create_sampling_client(base_model="tiny").result()
    long = types.SamplingParams(max_tokens=1500, temperature=1.0, seed=7, stop=[])
    future = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 4, long)
    client = redis.Redis.from_url(REDIS_URL)
    busy = wait_until(  # the worker sampling it reports it in flight in its heartbeat
        lambda: [name for name in ("s1", "s2") if json.loads(client.get(sampler_key(name)) or "{}").get("pending")],
        "a sampler worker to take the job", timeout=60)
    victim = deployment["processes"][busy[0]]
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    sequences = future.result(timeout=120).sequences
    assert [len(s.tokens) for s in sequences] == [1500] * 4


def test_restarted_api_and_scheduler_lose_no_accepted_request(deployment, tiny_model_path):
    """Stop the scheduler, let the API accept requests (seq_ids 2-4 wait for 1), kill the API;
    start both again and send seq 1: all four run once, in order."""
    processes, env = deployment["processes"], deployment["env"]
    key = create_tenant_key(deployment["database_url"], "restarts")
    tokens = list(range(10, 30))

    def post(route: str, headers: dict | None = None, **kw) -> httpx.Response:
        return httpx.post(f"{deployment['base_url']}/api/v1/{route}", headers={"X-API-Key": key, **(headers or {})},
                          timeout=60, **kw)

    session = post("create_session", json={"tags": []}).json()["session_id"]
    created = post("create_model", json={"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                          "lora_config": {"rank": 4, "seed": 5}}).json()
    wait_for(post, created["request_id"])
    inputs = {"target_tokens": np.array(tokens[1:]), "weights": np.ones(len(tokens) - 1, np.float32)}

    def fwd_bwd(seq_id: int, forward_only: bool = False) -> str:
        body = encode_forward_backward_request(created["model_id"], seq_id, [(tokens[:-1], inputs)], "cross_entropy",
                                               forward_only=forward_only)
        headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}
        return post("forward_backward", content=body, headers=headers).json()["request_id"]

    processes["scheduler"].send_signal(signal.SIGTERM)
    processes["scheduler"].wait(timeout=30)
    later = [fwd_bwd(2), post("optim_step", json={"model_id": created["model_id"], "seq_id": 3,
                                                   "adam_params": {"learning_rate": 1e-2}}).json()["request_id"],
             fwd_bwd(4, forward_only=True)]
    processes["api"].kill()
    processes["api"].wait()
    wait_until(lambda: port_is_free(deployment["port"]), "the killed API's port to be free for the new one", timeout=60)
    processes["scheduler"] = start_service("scheduler", env)
    processes["api"] = start_service("api", env, "--port", str(deployment["port"]))
    wait_healthy(processes["api"], deployment["base_url"])
    first = fwd_bwd(1)
    outcomes = [wait_for(post, request_id) for request_id in [first, *later]]

    logprobs = decode_forward_backward_output(outcomes[-1])[0][0]["logprobs"].tolist()
    # seq 1 and 2 accumulated into one step, as if nothing had restarted
    expected = logprobs_after_steps(tiny_model_path, tokens, rank=4, seed=5, steps=1, lr=1e-2, fwd_bwd_per_step=2)
    assert logprobs == pytest.approx(expected, rel=1e-5)
