"""Trainer cycles on two Celery worker processes (Redis broker, Postgres database, shared data dir):
models spread over both, the same numbers as the in-process engine, and a SIGKILLed worker's
cycle fails clearly while acknowledged work survives on the other worker."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
import tinker
from loraplex.types import AdamParams
from loraplex.wire.client import decode_forward_backward_output, encode_forward_backward_request
from tinker import types

from contract.configs import LoraConfig
from contract.inputs import EngineDatum, ForwardBackwardInput
from service.embedded import ServerThread, free_port
from service.settings import Settings
from tests.distributed.processes import start_worker, wait_for
from tests.redis_dbs import redis_url
from tests.service.conftest import drop_postgres_database, postgres_database
from tests.uninterrupted import logprobs_after_steps
from tests.waiting import wait_until
from workers.trainer.engine import TrainerEngine

REDIS_URL = redis_url(__name__)


def cpu_seconds(pid: int) -> float:
    """The CPU time (user and system, all threads) a live process has spent so far (Linux: /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    redis.Redis.from_url(REDIS_URL).flushdb()
    data_dir = tmp_path_factory.mktemp("shared")
    pg_name = postgres_database()
    workers = {name: start_worker(name, data_dir, REDIS_URL) for name in ("w1", "w2")}
    settings = Settings(data_dir=data_dir, database_url=f"postgresql+psycopg://postgres@127.0.0.1:5432/{pg_name}",
                        port=free_port(), base_model="tiny", executor="celery", redis_url=REDIS_URL,
                        sampler_enabled=False, long_poll_seconds=5, max_lora_rank=16)
    server = ServerThread(settings)
    state = {"server": server, "workers": workers, "data_dir": data_dir, "settings": settings}
    yield state
    state["server"].stop()
    for worker in workers.values():
        worker.kill()
    drop_postgres_database(pg_name)


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": np.ones(len(tokens) - 1, np.float32)})


def test_cycles_on_celery_workers_give_the_in_process_numbers(cluster, tiny_model_path):
    server = cluster["server"]
    tokens = {"a": list(range(10, 40)), "b": list(range(100, 120)), "c": list(range(200, 230)), "d": list(range(300, 310))}
    clients = {name: tinker.ServiceClient(base_url=server.base_url, api_key=server.new_tenant())
               .create_lora_training_client(base_model="tiny", rank=4, seed=i + 1).result()
               for i, name in enumerate(tokens)}
    losses = {name: tc.forward_backward([datum(tokens[name])], "cross_entropy") for name, tc in clients.items()}
    losses = {name: f.result().metrics["loss:sum"] for name, f in losses.items()}
    for tc in clients.values():
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = {name: tc.forward([datum(tokens[name])], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
             for name, tc in clients.items()}
    placement = server.embedded.executor.placement()
    assert {placement[tc.model_id] for tc in clients.values()} == {"w1", "w2"}  # two models each

    local = TrainerEngine(tiny_model_path, max_rank=16)
    for i, name in enumerate(tokens):
        local.create_adapter(name, LoraConfig(rank=4, seed=i + 1))
        d = EngineDatum(tokens[name][:-1], {"target_tokens": tokens[name][1:], "weights": [1.0] * (len(tokens[name]) - 1)})
        assert local.forward_backward([ForwardBackwardInput(name, [d])])[0].metrics["loss:sum"] == pytest.approx(losses[name], rel=1e-6)
        local.optim_step([(name, AdamParams(learning_rate=1e-2))])
        expected = local.forward([ForwardBackwardInput(name, [d])])[0].loss_fn_outputs[0]["logprobs"].tolist()
        assert after[name] == pytest.approx(expected, rel=1e-6)


def test_a_killed_worker_fails_its_cycle_and_training_continues_on_the_next(cluster, tiny_model_path):
    server = cluster["server"]
    tc = tinker.ServiceClient(base_url=server.base_url, api_key=server.new_tenant()) \
        .create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    short = list(range(10, 30))
    tc.forward_backward([datum(short)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # acknowledged: durable
    tc.forward_backward([datum(short)], "cross_entropy").result()  # acknowledged gradient, in w1's memory
    reference = tc.forward([datum(short)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()

    # seconds of work on the worker: distinct first tokens, so no datum shares another's rows
    big = [datum([i] + list(range(5, 500))) for i in range(48)]
    doomed = tc.forward_backward(big, "cross_entropy")
    client = redis.Redis.from_url(REDIS_URL)
    wait_until(lambda: any(client.scan_iter("loraplex:cycle:*")),  # the cycle is on its way to the worker
               "the cycle to be sent to a worker", timeout=60, interval=0.01)
    victim = server.embedded.executor.placement()[tc.model_id]
    pid, before = cluster["workers"][victim].pid, cpu_seconds(cluster["workers"][victim].pid)
    # and running there: the victim took it off its queue and computes (an idle worker spends next to no CPU)
    wait_until(lambda: client.llen(f"trainer.{victim}") == 0 and cpu_seconds(pid) - before >= 0.3,
               lambda: f"{victim} to run the cycle ({cpu_seconds(pid) - before:.2f} CPU s since it was sent)",
               timeout=120, interval=0.01)
    cluster["workers"][victim].send_signal(signal.SIGKILL)
    cluster["workers"][victim].wait()
    with pytest.raises(Exception, match="worker lost"):
        doomed.result()

    # the other worker loaded the durable state and replayed the acknowledged gradient; the doomed one was not applied
    after = tc.forward([datum(short)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert after == pytest.approx(reference, rel=1e-6)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert server.embedded.executor.placement()[tc.model_id] != victim
    moved = tc.forward([datum(short)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()

    # the same history without any crash: the step on w2 used exactly the acknowledged gradient
    expected = logprobs_after_steps(tiny_model_path, short, rank=4, seed=3, steps=2, lr=1e-2)
    assert moved == pytest.approx(expected, rel=1e-5)
    assert moved != pytest.approx(reference, rel=1e-4)


def test_a_restarted_server_loses_no_accepted_request(cluster, tiny_model_path):
    """Requests accepted but not run (seq_ids 2-4 wait for 1) survive a restart of the API and
    scheduler; after it, seq 1 arrives and all four run once, in order."""
    server = cluster["server"]
    key = server.new_tenant()
    tokens = list(range(10, 30))

    def post(route: str, headers: dict | None = None, **kw) -> httpx.Response:
        return httpx.post(f"{cluster['server'].base_url}/api/v1/{route}", headers={"X-API-Key": key, **(headers or {})},
                          timeout=60, **kw)

    session = post("create_session", json={"tags": []}).json()["session_id"]
    created = post("create_model", json={"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                          "lora_config": {"rank": 4, "seed": 5}}).json()
    model_id = created["model_id"]
    wait_for(post, created["request_id"])
    inputs = {"target_tokens": np.array(tokens[1:]), "weights": np.ones(len(tokens) - 1, np.float32)}

    def fwd_bwd(seq_id: int, forward_only: bool = False) -> str:
        body = encode_forward_backward_request(model_id, seq_id, [(tokens[:-1], inputs)], "cross_entropy",
                                               forward_only=forward_only)
        headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}
        return post("forward_backward", content=body, headers=headers).json()["request_id"]

    later = [fwd_bwd(2), post("optim_step", json={"model_id": model_id, "seq_id": 3,
                                                   "adam_params": {"learning_rate": 1e-2}}).json()["request_id"],
             fwd_bwd(4, forward_only=True)]
    server.stop()  # the API and the scheduler go away with three requests accepted and waiting
    server = cluster["server"] = ServerThread(cluster["settings"])
    first = fwd_bwd(1)
    outcomes = [wait_for(post, request_id) for request_id in [first, *later]]
    logprobs = decode_forward_backward_output(outcomes[-1])[0][0]["logprobs"].tolist()

    expected_engine = TrainerEngine(tiny_model_path, max_rank=16)
    expected_engine.create_adapter("x", LoraConfig(rank=4, seed=5))
    d = EngineDatum(tokens[:-1], {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    expected_engine.forward_backward([ForwardBackwardInput("x", [d])] * 2)  # seq 1 and 2 accumulate
    expected_engine.optim_step([("x", AdamParams(learning_rate=1e-2))])
    expected = expected_engine.forward([ForwardBackwardInput("x", [d])])[0].loss_fn_outputs[0]["logprobs"].tolist()
    assert logprobs == pytest.approx(expected, rel=1e-5)


def test_a_joining_worker_takes_over_a_model_with_the_numbers_of_staying_put(cluster, tiny_model_path):
    """Rebalancing: the busier worker writes the model's full state (gradients and Adam moments
    included) to the shared store; the new worker loads it and goes on as if nothing had moved."""
    server = cluster["server"]
    tc = tinker.ServiceClient(base_url=server.base_url, api_key=server.new_tenant()) \
        .create_lora_training_client(base_model="tiny", rank=4, seed=11).result()
    tokens = list(range(50, 80))
    tc.forward_backward([datum(tokens)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    tc.forward_backward([datum(tokens)], "cross_entropy").result()  # a gradient only in the old worker's memory
    executor = server.embedded.executor
    before = executor.placement()[tc.model_id]
    assert sum(1 for w in executor.placement().values() if w == before) >= 2  # the busier worker

    cluster["workers"]["w3"] = start_worker("w3", cluster["data_dir"], REDIS_URL)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert executor.placement()[tc.model_id] == "w3"
    logprobs = tc.forward([datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    expected = logprobs_after_steps(tiny_model_path, tokens, rank=4, seed=11, steps=2, lr=1e-2)
    assert logprobs == pytest.approx(expected, rel=1e-6)
