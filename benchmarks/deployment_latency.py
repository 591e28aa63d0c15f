"""What the split deployment costs per call: the same rounds through the embedded server and
through separate processes (API, scheduler, one Celery trainer worker), interleaved in one run.

    .venv/bin/python -m benchmarks.deployment_latency [--rounds 40]   # from the repository root (uses tests/ helpers)

A round is one forward_backward (1 x 16 tokens, tiny) and one optim_step of one model, each sent
with a bare HTTP client and long-polled to completion. Embedded: API, scheduler and engine in
one process (SQLite). Split: `python -m service api`, `python -m service scheduler` and a Celery
worker (Postgres, Redis on loopback, db 9); a request goes API -> Redis inbox -> scheduler ->
Celery task -> worker -> Redis -> scheduler -> database + Redis notification -> API long-poll.
Results go to benchmarks/results/deployment_latency.md.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import redis
import typer

from loraplex.wire.client import encode_forward_backward_request
from service.embedded import ServerThread, free_port
from service.settings import Settings
from tests.distributed.processes import create_tenant_key, service_env, start_service, start_worker, wait_healthy
from tests.service.conftest import drop_postgres_database, postgres_database

REDIS_URL = "redis://127.0.0.1:6379/9"
RESULTS = Path(__file__).resolve().parent / "results" / "deployment_latency.md"
TOKENS = list(range(10, 27))


class Tenant:
    """One model driven over the wire, as the SDK would (seq_ids in order, long-polls)."""

    def __init__(self, base_url: str, key: str) -> None:
        self.http = httpx.Client(base_url=f"{base_url}/api/v1", headers={"X-API-Key": key}, timeout=60)
        session = self.http.post("/create_session", json={"tags": []}).json()["session_id"]
        created = self.http.post("/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                                        "lora_config": {"rank": 4}}).json()
        self.model_id, self.seq = created["model_id"], 0
        self.wait(created["request_id"])

    def wait(self, request_id: str) -> None:
        while True:
            response = self.http.post("/retrieve_future", json={"request_id": request_id})
            body = response.json() if response.headers["content-type"].startswith("application/json") else {}
            if body.get("type") != "try_again":
                assert "error" not in body, body
                return

    def round(self) -> float:
        start = time.perf_counter()
        inputs = {"target_tokens": np.array(TOKENS[1:]), "weights": np.ones(len(TOKENS) - 1, np.float32)}
        self.seq += 1
        body = encode_forward_backward_request(self.model_id, self.seq, [(TOKENS[:-1], inputs)], "cross_entropy")
        self.wait(self.http.post("/forward_backward", content=body, headers={
            "Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}).json()["request_id"])
        self.seq += 1
        self.wait(self.http.post("/optim_step", json={"model_id": self.model_id, "seq_id": self.seq,
                                                       "adam_params": {"learning_rate": 1e-4}}).json()["request_id"])
        return time.perf_counter() - start


def main(rounds: int = 40) -> None:
    work = Path(tempfile.mkdtemp(prefix="loraplex-bench-"))
    embedded = ServerThread(Settings(data_dir=work / "embedded", port=free_port(), base_model="tiny",
                                     sampler_enabled=False, max_lora_rank=16))
    redis.Redis.from_url(REDIS_URL).flushdb()
    pg_name = postgres_database()
    database_url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{pg_name}"
    port = free_port()
    env = service_env(REDIS_URL, work / "split", LORAPLEX_DATABASE_URL=database_url, LORAPLEX_SAMPLER_ENABLED="false")
    processes = [start_worker("bench-w1", work / "split", REDIS_URL), start_service("scheduler", env),
                 start_service("api", env, "--port", str(port))]
    try:
        wait_healthy(processes[-1], f"http://127.0.0.1:{port}")
        tenants = {"embedded": Tenant(embedded.base_url, embedded.new_tenant()),
                   "split": Tenant(f"http://127.0.0.1:{port}", create_tenant_key(database_url, "bench"))}
        times: dict[str, list[float]] = {name: [] for name in tenants}
        for _ in range(3):  # warm up both
            for tenant in tenants.values():
                tenant.round()
        for _ in range(rounds):  # interleaved: the machine's noise falls on both alike
            for name, tenant in tenants.items():
                times[name].append(tenant.round())
    finally:
        for process in processes:
            process.kill()
            process.wait()
        embedded.stop()
        drop_postgres_database(pg_name)

    p50 = {name: statistics.median(values) * 1000 for name, values in times.items()}
    table = [
        ("round through the embedded server (one process, SQLite), p50", f"{p50['embedded']:.1f} ms"),
        ("round through the split deployment (API, scheduler, Celery worker; Postgres, Redis), p50",
         f"{p50['split']:.1f} ms"),
        ("added per call by the split (2 calls per round), p50", f"{(p50['split'] - p50['embedded']) / 2:.1f} ms"),
        ("split / embedded", f"{p50['split'] / p50['embedded']:.2f}x"),
    ]
    text = (f"Command: `.venv/bin/python -m benchmarks.deployment_latency --rounds {rounds}` (all processes on this "
            f"machine, services on loopback)\n\n| measure | value |\n|---|---|\n"
            + "\n".join(f"| {k} | {v} |" for k, v in table) + "\n")
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    typer.run(main)
