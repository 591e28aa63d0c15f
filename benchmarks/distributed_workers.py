"""Celery trainer workers against the in-process executor, side by side in one run.

    .venv/bin/python benchmarks/distributed_workers.py [--model tiny] [--tenants 8] [--rounds 20]

Part 1, dispatch cost: the same small cycle (one forward_backward of 1 x 16 tokens) through the
in-process executor and through a CeleryExecutor to one worker process; p50 per cycle and the
difference (Redis round trips, pickling, the Celery task, the result poll).
Part 2, throughput: `tenants` adapters, each round one forward_backward (2 x 128 tokens) per
tenant and one optim_step per tenant, through 1 worker process and through 2 (models split 4/4,
the two parts of each cycle running at the same time), the machine's cores shared out between
the workers (OMP_NUM_THREADS). Needs Redis on 127.0.0.1:6379 (db 8).
Results go to benchmarks/results/distributed_workers.md.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis
import typer
from loraplex.wire.client import encode_forward_backward_request

from contract.configs import LoraConfig
from contract.queue import Cycle, Job, QueuedRequest
from contract.redis_keys import worker_key
from models.registry import model_info
from scheduler.celery_executor import CeleryExecutor
from workers.trainer.engine import TrainerEngine
from workers.trainer.executor import InProcessExecutor

REDIS_URL = "redis://127.0.0.1:6379/8"
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "distributed_workers.md"


class Requests:
    """Jobs with real payloads, as the API stores them."""

    def __init__(self) -> None:
        self.seq: dict[str, int] = {}
        self.count = 0

    def job(self, model_id: str, kind: str, payload: bytes, tokens: int = 0) -> Job:
        self.count += 1
        seq = self.seq[model_id] = self.seq.get(model_id, -1) + 1
        return Job(QueuedRequest(f"r{self.count}", "t", model_id, seq, kind, tokens), payload)

    def create(self, model_id: str) -> Job:
        return self.job(model_id, "create_model", json.dumps({"lora_config": LoraConfig(rank=16, seed=1).to_dict()}).encode())

    def forward_backward(self, model_id: str, rows: int, length: int) -> Job:
        inputs = {"target_tokens": np.arange(11, 11 + length), "weights": np.ones(length, np.float32)}
        data = [(list(range(10, 10 + length)), inputs) for _ in range(rows)]
        payload = encode_forward_backward_request(model_id, 0, data, "cross_entropy", compress=False)
        return self.job(model_id, "forward_backward", payload, rows * length)

    def optim_step(self, model_id: str) -> Job:
        return self.job(model_id, "optim_step", json.dumps({"adam_params": {"learning_rate": 1e-4}}).encode())


def run(executor, jobs: list[Job]) -> float:
    cycle = Cycle(forward_backward=[j.request for j in jobs if j.request.kind == "forward_backward"],
                  optim_steps=[j.request for j in jobs if j.request.kind == "optim_step"],
                  others=[j.request for j in jobs if j.request.kind not in ("forward_backward", "optim_step")])
    if hasattr(executor, "place"):
        executor.place({j.request.model_id for j in jobs})
    start = time.perf_counter()
    outcomes = executor.run_cycle(cycle, {j.request.id: j for j in jobs})
    seconds = time.perf_counter() - start
    failed = [o.error for o in outcomes.values() if o.error]
    if failed:
        raise RuntimeError(failed[0])
    return seconds


def start_workers(names: list[str], model: str, data_dir: Path) -> list[subprocess.Popen]:
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    procs = []
    for name in names:
        env = os.environ | {"LORAPLEX_BASE_MODEL": model, "LORAPLEX_DATA_DIR": str(data_dir),
                            "LORAPLEX_REDIS_URL": REDIS_URL, "LORAPLEX_WORKER_ID": name,
                            # the cores shared out: two workers with all cores each oversubscribe them
                            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // len(names)))}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "service.celery_worker", "worker", "--pool", "solo", "-Q",
             f"trainer.{name}", "-n", f"{name}@localhost", "--without-gossip", "--without-mingle", "--without-heartbeat",
             "-l", "WARNING"], cwd=ROOT, env=env))
    while not all(client.get(worker_key(n)) for n in names):
        time.sleep(0.1)
    return procs


def p50(values: list[float]) -> float:
    return statistics.median(values) * 1000


def main(model: str = "tiny", tenants: int = 8, rounds: int = 20) -> None:
    info = model_info(model)
    data_dir = Path(tempfile.mkdtemp(prefix="loraplex-bench-"))
    requests = Requests()

    local = InProcessExecutor(TrainerEngine(info.path, max_rank=16), data_dir / "local-live")
    run(local, [requests.create("solo")])
    local_small = [run(local, [requests.forward_backward("solo", 1, 16)]) for _ in range(rounds * 5)]

    rows = {}
    for names in (["w1"], ["w1", "w2"]):
        procs = start_workers(names, info.name, data_dir)
        try:
            executor = CeleryExecutor(REDIS_URL, info.name, data_dir / "live")
            models = [f"{len(names)}-t{i}" for i in range(tenants)]
            run(executor, [requests.create(m) for m in models])
            if len(names) == 1:
                run(executor, [requests.create("solo-celery")])
                celery_small = [run(executor, [requests.forward_backward("solo-celery", 1, 16)]) for _ in range(rounds * 5)]
            times = []
            for _ in range(rounds):
                fb = run(executor, [requests.forward_backward(m, 2, 128) for m in models])
                opt = run(executor, [requests.optim_step(m) for m in models])
                times.append(fb + opt)
            rows[len(names)] = times
            print(f"{len(names)} worker(s): round p50 {p50(times):.0f} ms", flush=True)
        finally:
            for p in procs:
                p.kill()
                p.wait()

    table = [
        ("small cycle in-process, p50", f"{p50(local_small):.1f} ms"),
        ("same cycle through Celery (1 worker), p50", f"{p50(celery_small):.1f} ms"),
        ("Celery dispatch cost per cycle, p50", f"{p50(celery_small) - p50(local_small):.1f} ms"),
        (f"{tenants} tenants, round (fwd_bwd 2x128 + optim_step each), 1 worker, p50", f"{p50(rows[1]):.0f} ms"),
        ("same, 2 workers (models split between them, parts in parallel), p50", f"{p50(rows[2]):.0f} ms"),
        ("throughput 2 workers / 1 worker", f"{p50(rows[1]) / p50(rows[2]):.2f}x"),
    ]
    text = (f"Command: `.venv/bin/python benchmarks/distributed_workers.py --model {model} --tenants {tenants} "
            f"--rounds {rounds}` (worker processes on this machine, Redis on loopback)\n\n| measure | value |\n|---|---|\n"
            + "\n".join(f"| {k} | {v} |" for k, v in table) + "\n")
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    typer.run(main)
