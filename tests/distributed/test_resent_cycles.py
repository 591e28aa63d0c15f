"""A scheduler killed after a Celery trainer worker ran a cycle, but before the scheduler committed
its outcomes, sends that cycle again after its restart (its requests are still pending). The worker
answers the requests it ran from their outcomes instead of running them again: a forward_backward's
gradient and an optim_step's step are applied once, and every acknowledged request resolves."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
import numpy as np
import pytest
import redis

from loraplex.wire.client import decode_forward_backward_output, encode_forward_backward_request
from service.embedded import free_port
from tests.distributed.processes import (
    ROOT, create_tenant_key, service_env, start_service, start_worker, wait_for, wait_healthy,
)
from tests.redis_dbs import redis_url
from tests.service.conftest import drop_postgres_database, postgres_database
from tests.uninterrupted import logprobs_after_steps
from tests.waiting import wait_until

REDIS_URL = redis_url(__name__)


@pytest.fixture
def deployment(tmp_path):
    redis.Redis.from_url(REDIS_URL).flushdb()
    pg_name = postgres_database()
    database_url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{pg_name}"
    port = free_port()
    env = service_env(REDIS_URL, tmp_path, LORAPLEX_DATABASE_URL=database_url, LORAPLEX_LONG_POLL_SECONDS="5")
    processes = {"worker": start_worker("resent-1", tmp_path, REDIS_URL)}
    state = {"processes": processes, "env": env, "base_url": f"http://127.0.0.1:{port}",
             "database_url": database_url, "tmp": tmp_path}
    try:
        processes["api"] = start_service("api", env, "--port", str(port))
        wait_healthy(processes["api"], state["base_url"])
        yield state
    finally:
        for process in processes.values():
            process.kill()
            process.wait()
        drop_postgres_database(pg_name)


def paused_scheduler(env: dict[str, str], seq_id: int, paused_file) -> subprocess.Popen:
    """The scheduler, stopping for good before it commits the batch holding `seq_id` (paused_scheduler.py)."""
    return subprocess.Popen([sys.executable, "-m", "tests.distributed.paused_scheduler"], cwd=ROOT,
                            env=env | {"LORAPLEX_TEST_PAUSE_AT_SEQ": str(seq_id),
                                       "LORAPLEX_TEST_PAUSED_FILE": str(paused_file)})


def kill_when_paused(process: subprocess.Popen, paused_file, seconds: float = 120) -> None:
    def paused() -> bool:
        assert process.poll() is None, "the scheduler exited"
        return paused_file.exists()

    wait_until(paused, "the scheduler to reach the commit", timeout=seconds)
    process.send_signal(signal.SIGKILL)  # the worker ran the cycle; the database never heard of it
    process.wait()


def test_a_cycle_resent_by_a_restarted_scheduler_is_not_run_twice(deployment, tiny_model_path):
    processes, env, tmp = deployment["processes"], deployment["env"], deployment["tmp"]
    key = create_tenant_key(deployment["database_url"], "resent")
    tokens = list(range(10, 30))

    def post(route: str, headers: dict | None = None, **kw) -> httpx.Response:
        return httpx.post(f"{deployment['base_url']}/api/v1/{route}", headers={"X-API-Key": key, **(headers or {})},
                          timeout=60, **kw)

    inputs = {"target_tokens": np.array(tokens[1:]), "weights": np.ones(len(tokens) - 1, np.float32)}

    def fwd_bwd(model_id: str, seq_id: int, forward_only: bool = False) -> str:
        body = encode_forward_backward_request(model_id, seq_id, [(tokens[:-1], inputs)], "cross_entropy",
                                               forward_only=forward_only)
        headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}
        response = post("forward_backward", content=body, headers=headers)
        assert response.status_code == 200, response.text
        return response.json()["request_id"]

    def optim_step(model_id: str, seq_id: int) -> str:
        response = post("optim_step", json={"model_id": model_id, "seq_id": seq_id, "adam_params": {"learning_rate": 1e-2}})
        assert response.status_code == 200, response.text
        return response.json()["request_id"]

    # 1: runs the forward_backward of seq_id 3 on the worker, then is killed before committing it
    processes["scheduler"] = paused_scheduler(env, 3, tmp / "paused-3")
    session = post("create_session", json={"tags": []}).json()["session_id"]
    created = post("create_model", json={"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                          "lora_config": {"rank": 4, "seed": 5}}).json()
    model_id = created["model_id"]
    wait_for(post, created["request_id"])
    wait_for(post, fwd_bwd(model_id, 1))
    wait_for(post, optim_step(model_id, 2))
    gradient = fwd_bwd(model_id, 3)
    kill_when_paused(processes["scheduler"], tmp / "paused-3")

    # 2: sends seq_id 3 again (answered from the worker's record), then runs the optim_step of seq_id 4
    # and is killed before committing it
    processes["scheduler"] = paused_scheduler(env, 4, tmp / "paused-4")
    first_answer = wait_for(post, gradient)
    step = optim_step(model_id, 4)
    kill_when_paused(processes["scheduler"], tmp / "paused-4")

    # 3: an ordinary scheduler sends seq_id 4 again; then a forward reads the weights
    processes["scheduler"] = start_service("scheduler", env)
    assert "metrics" in json.loads(wait_for(post, step))
    logprobs = decode_forward_backward_output(wait_for(post, fwd_bwd(model_id, 5, forward_only=True)))[0][0]["logprobs"]

    # the same history run once, uninterrupted: one gradient per step, two steps
    expected = logprobs_after_steps(tiny_model_path, tokens, rank=4, seed=5, steps=2, lr=1e-2)
    assert logprobs.tolist() == pytest.approx(expected, abs=1e-5)
    # the resent forward_backward was answered with the numbers it gave (the weights before step 2)
    before_second_step = logprobs_after_steps(tiny_model_path, tokens, rank=4, seed=5, steps=1, lr=1e-2)
    first_logprobs = decode_forward_backward_output(first_answer)[0][0]["logprobs"]
    forward_before = np.array(before_second_step)
    assert np.abs(first_logprobs - forward_before).max() < 1e-5
