"""Distributed mode: the trainer runs in a Celery worker process, and the dashboard's numbers reach
Postgres through the cycle's outcomes (no side channel): one point per optim_step, as embedded."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import redis
import sqlalchemy as sa

import loraplex
from loraplex import types
from db.models import ServiceMetric
from service.embedded import ServerThread, free_port
from service.settings import Settings
from tests.distributed.processes import start_worker
from tests.redis_dbs import redis_url
from tests.service.conftest import drop_postgres_database, postgres_database

pytestmark = pytest.mark.distributed

REDIS_URL = redis_url(__name__)
TOKENS = list(range(10, 30))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    redis.Redis.from_url(REDIS_URL).flushdb()
    data_dir = tmp_path_factory.mktemp("dashboard-celery")
    pg_name = postgres_database()
    worker = start_worker("dash-w1", data_dir, REDIS_URL)
    settings = Settings(data_dir=data_dir, database_url=f"postgresql+psycopg://postgres@127.0.0.1:5432/{pg_name}",
                        port=free_port(), base_model="tiny", executor="celery", redis_url=REDIS_URL,
                        sampler_enabled=False, long_poll_seconds=5, max_lora_rank=16)
    running = ServerThread(settings)
    try:
        yield running
    finally:
        running.stop()
        worker.kill()
        worker.wait()
        drop_postgres_database(pg_name)


def test_celery_trainer_metrics_reach_the_dashboard(server):
    key = server.new_tenant("celery-dash")
    datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(TOKENS[1:], dtype=np.int64),
                                        "weights": np.ones(len(TOKENS) - 1, dtype=np.float32)})
    with loraplex.ServiceClient(base_url=server.base_url, api_key=key) as service:
        training = service.create_lora_training_client("tiny", rank=4, seed=2)
        losses = []
        for step in (1, 2):
            losses.append(training.forward_backward([datum]).result().metrics["loss:sum"])
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            training.log_metrics({"reward/mean": step / 2}, step=step)
    assert server.embedded.executor.placement()[training.model_id] == "dash-w1"  # it trained in the worker
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}) as http:
        series = http.get(f"/dashboard/api/runs/{training.model_id}/metrics").json()["series"]
    assert [p[0] for p in series["grad_norm"]["points"]] == [1, 2]
    assert [p[1] for p in series["tokens"]["points"]] == [len(TOKENS) - 1] * 2
    assert [p[1] for p in series["loss"]["points"]] == pytest.approx([loss / (len(TOKENS) - 1) for loss in losses])
    assert series["reward/mean"]["points"] == [[1, 0.5], [2, 1.0]]


def test_groups_inferred_from_datums_trained_by_a_celery_worker(server):
    """The trainer's count of datums with advantages travels with the outcome from the worker, and the RL
    groups route reads the stored bodies from Postgres."""
    key = server.new_tenant("celery-groups")

    def rl_datum(prompt: list[int], tail: list[int], advantage: float) -> types.Datum:
        tokens, before = prompt + tail, len(prompt) - 1
        return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "logprobs": np.array([0.0] * before + [-2.0] * len(tail), dtype=np.float32),
            "advantages": np.array([0.0] * before + [advantage] * len(tail), dtype=np.float32)})

    data = [rl_datum(TOKENS, [40 + i], a) for i, a in enumerate((1.0, -1.0))]
    data += [rl_datum(TOKENS[:8], [50 + i, 51], 0.0) for i in range(3)]
    with loraplex.ServiceClient(base_url=server.base_url, api_key=key) as service:
        training = service.create_lora_training_client("tiny", rank=4, seed=3)
        training.forward_backward(data, "importance_sampling").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}) as http:
        [step] = http.get(f"/dashboard/api/runs/{training.model_id}/rl_groups").json()["steps"]
    assert step["step"] == 1
    outcomes = sorted((g["prompt_tokens"], g["size"], g["outcome"]) for g in step["groups"])
    assert outcomes == [(8, 3, "uniform"), (len(TOKENS), 2, "mixed")]
    with server.embedded.sessions() as s:
        numbers = s.scalar(sa.select(ServiceMetric.numbers).where(ServiceMetric.run_id == training.model_id,
                                                                  ServiceMetric.source == "forward_backward"))
    assert numbers["advantage_datums"] == len(data)  # counted in the worker, stored with the outcome
