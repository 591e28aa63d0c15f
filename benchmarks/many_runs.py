"""A thousand training runs on one server under a memory budget: what stays resident, what it costs on
disk, and what a paged-out run's step costs, against the same active runs with nothing paged.

    .venv/bin/python -m benchmarks.many_runs [--runs 1000] [--active 0.1] [--rounds 3] [--budget-gib 6] \
        [--model HuggingFaceTB/SmolLM2-135M-Instruct] [--clients 4]   # from the repository root

It starts `python -m service serve` (no sampler) in a process of its own, so the RSS it samples every
second is the server's. Phase 1: `runs` rank-8 runs, created and stepped once each (a forward_backward
of 2 x 32 tokens, then an optim_step), round-robin over `clients` concurrent HTTP clients; the trainer
pages the least recently used out past its budget (LORAPLEX_TRAINER_MEMORY_BUDGET). Phase 2: a random
`active` share of the runs steps `rounds` times: the first round finds them paged out (cold), the later
ones resident. Phase 3: a second server holds only those active runs (never paged) and steps them the
same way: their throughput against phase 2's resident rounds is what the budget costs the active set.
The disk's read bandwidth is measured with O_DIRECT on a file the size of one run's state, for what
one page-in should cost. Writes benchmarks/results/many_runs.md unless --no-write.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import typer

from loraplex.wire.client import encode_forward_backward_request
from service.embedded import free_port
from storage.live_slots import slot_paths
from tests.distributed.processes import create_tenant_key, start_service, wait_healthy
from tests.reliability.processes import rss_bytes, stop

RESULTS = Path(__file__).parent / "results" / "many_runs.md"
MB = 1 << 20


class Run:
    """One run's requests over plain HTTP, each awaited to its result."""

    def __init__(self, http: httpx.Client, session: str, index: int) -> None:
        self.http, self.seq = http, 0
        created = self._accept("create_model", json={"session_id": session, "model_seq_id": index, "base_model": MODEL,
                                                     "lora_config": {"rank": 8, "seed": index}})
        self.model_id = created["model_id"]
        self._wait(created["request_id"])

    def step(self, rng: np.random.Generator) -> float:
        """forward_backward + optim_step; seconds from the first POST to the step's result."""
        rows = [rng.integers(0, 500, 33) for _ in range(2)]
        data = [(r[:-1], {"target_tokens": r[1:], "weights": np.ones(32, np.float32)}) for r in rows]
        started = time.perf_counter()
        self.seq += 1
        fb = self._accept("forward_backward", content=encode_forward_backward_request(self.model_id, self.seq, data,
                                                                                      "cross_entropy"),
                          headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"})
        self.seq += 1
        step = self._accept("optim_step", json={"model_id": self.model_id, "seq_id": self.seq,
                                                "adam_params": {"learning_rate": 1e-4}})
        self._wait(fb["request_id"])
        self._wait(step["request_id"])
        return time.perf_counter() - started

    def _accept(self, route: str, **kw) -> dict:
        response = self.http.post(f"/api/v1/{route}", **kw)
        response.raise_for_status()
        return response.json()

    def _wait(self, request_id: str) -> None:
        while True:
            response = self.http.post("/api/v1/retrieve_future", json={"request_id": request_id})
            response.raise_for_status()
            if not response.headers["content-type"].startswith("application/json"):
                return
            body = response.json()
            if "error" in body:
                raise RuntimeError(f"request failed: {str(body)[:300]}")
            if body.get("type") != "try_again":
                return


MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


class Server:
    def __init__(self, data_dir: Path, budget_gib: float | None) -> None:
        self.port, self.data_dir = free_port(), data_dir
        env = os.environ | {"LORAPLEX_BASE_MODEL": MODEL, "LORAPLEX_SAMPLER_ENABLED": "false",
                            "LORAPLEX_MAX_LORA_RANK": "16", "LORAPLEX_TRAINER_MEMORY_FRACTION": "0"}
        if budget_gib is not None:
            env["LORAPLEX_TRAINER_MEMORY_BUDGET"] = str(int(budget_gib * 2**30))
        self.process = start_service("serve", env, "--port", str(self.port), "--data-dir", str(data_dir))
        self.base_url = f"http://127.0.0.1:{self.port}"
        wait_healthy(self.process, self.base_url, seconds=600)
        self.key = create_tenant_key(f"sqlite:///{(data_dir / 'loraplex.db').resolve()}", "bench")
        self.rss: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.wait(1.0):
            self.rss.append((time.monotonic(), rss_bytes(self.process.pid)))

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers={"X-API-Key": self.key}, timeout=600)

    def session(self) -> str:
        with self.client() as http:
            return http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}}).json()["session_id"]

    def stop(self) -> None:
        self._stop.set()
        stop(self.process)


def in_parallel(clients: int, jobs: list, fn) -> list:
    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(fn, jobs))


def create_and_step(server: Server, count: int, clients: int) -> list[Run]:
    session = server.session()
    https = [server.client() for _ in range(clients)]

    def make(i: int) -> Run:
        run = Run(https[i % clients], session, i)
        run.step(np.random.default_rng(i))
        return run

    return in_parallel(clients, list(range(count)), make)


def rounds_of(runs: list[Run], rounds: int, clients: int) -> list[tuple[list[float], float]]:
    """Each round: every run steps once; (step latencies, steps per second)."""
    out = []
    for r in range(rounds):
        started = time.perf_counter()
        latencies = in_parallel(clients, runs, lambda run: run.step(np.random.default_rng(1000 + r)))
        out.append((latencies, len(runs) / (time.perf_counter() - started)))
    return out


def disk_read_bytes_per_second(folder: Path, size: int) -> float:
    """Sequential O_DIRECT read of a file of `size` bytes (the page cache bypassed)."""
    path = folder / "bandwidth.bin"
    subprocess.run(["dd", "if=/dev/urandom", f"of={path}", "bs=1M", f"count={max(1, size // MB)}", "oflag=direct"],
                   check=True, capture_output=True)
    started = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"], check=True, capture_output=True)
    seconds = time.perf_counter() - started
    path.unlink()
    return max(1, size // MB) * MB / seconds


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def du(folder: Path) -> int:
    """Bytes under `folder` (the trainer may remove a slot meanwhile: du then says so, and still totals)."""
    if not folder.exists():
        return 0
    return int(subprocess.run(["du", "-sb", str(folder)], capture_output=True, text=True).stdout.split()[0])


def main(runs: int = 1000, active: float = 0.1, rounds: int = 3, budget_gib: float = 6.0, clients: int = 4,
         model: str = MODEL, write: bool = True) -> None:
    global MODEL
    MODEL = model
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="many-runs-") as tmp:
        tmp = Path(tmp)
        server = Server(tmp / "paged", budget_gib)
        try:
            base_rss = rss_bytes(server.process.pid)
            started = time.monotonic()
            all_runs = create_and_step(server, runs, clients)
            warm_seconds = time.monotonic() - started
            chosen = rng.sample(all_runs, max(1, int(active * runs)))
            paged_rounds = rounds_of(chosen, rounds, clients)
            live = tmp / "paged" / "live"
            disk_per_run = du(live) / runs
            idle = next(run for run in all_runs if run not in chosen)
            # a paged-out run: its one copy, in either of its two slots (storage/live_slots.py)
            state_bytes = sum(du(Path(slot)) for slot in slot_paths(str(live), idle.model_id))
        finally:
            server.stop()
        rss = server.rss
        alone = Server(tmp / "resident", None)
        try:
            resident_runs = create_and_step(alone, len(chosen), clients)
            resident_rounds = rounds_of(resident_runs, rounds, clients)
        finally:
            alone.stop()
        bandwidth = disk_read_bytes_per_second(tmp, state_bytes or 34 * MB)

    cold, warm = paged_rounds[0][0], [x for lat, _ in paged_rounds[1:] for x in lat]
    resident = [x for lat, _ in resident_rounds[1:] for x in lat]
    rate_paged = statistics.median(rate for _, rate in paged_rounds[1:])
    rate_resident = statistics.median(rate for _, rate in resident_rounds[1:])
    peak_after_warm = max((value for t, value in rss if t > started + 0.5 * warm_seconds), default=0)
    lines = [
        "| measure | value |", "|---|---|",
        f"| runs (rank 8, {model}) / active set | {runs} / {len(chosen)} |",
        f"| memory budget | {budget_gib:g} GiB |",
        f"| server RSS: after start / peak, second half of phase 1 / peak overall | {base_rss / 2**30:.2f} / "
        f"{peak_after_warm / 2**30:.2f} / {max(v for _, v in rss) / 2**30:.2f} GiB |",
        f"| disk per run (live slots, after phase 2) | {disk_per_run / MB:.1f} MB |",
        f"| one run's state / the disk's O_DIRECT read bandwidth / so one page-in should take | "
        f"{state_bytes / MB:.1f} MB / {bandwidth / MB:.0f} MB/s / {state_bytes / bandwidth * 1000:.0f} ms |",
        f"| step (forward_backward + optim_step) latency, paged-out run (round 1), p50 / p99 | "
        f"{pct(cold, 0.5) * 1000:.0f} / {pct(cold, 0.99) * 1000:.0f} ms |",
        f"| the same, resident (rounds 2-{rounds}), p50 / p99 | {pct(warm, 0.5) * 1000:.0f} / "
        f"{pct(warm, 0.99) * 1000:.0f} ms |",
        f"| the same runs on a server that never paged, p50 / p99 | {pct(resident, 0.5) * 1000:.0f} / "
        f"{pct(resident, 0.99) * 1000:.0f} ms |",
        f"| **active-set throughput, paged server / never paged** | {rate_paged:.2f} / {rate_resident:.2f} steps/s "
        f"(**{rate_paged / rate_resident:.2f}x**) |",
        f"| phase 1: create + step of {runs} runs | {warm_seconds:.0f} s |",
    ]
    print("\n".join(lines))
    if write:
        rss_trace = [(round(t - rss[0][0]), round(v / 2**30, 2)) for t, v in rss[::30]]
        RESULTS.write_text(
            f"Command: `.venv/bin/python -m benchmarks.many_runs --runs {runs} --active {active:g} --rounds {rounds} "
            f"--budget-gib {budget_gib:g} --clients {clients}` (`python -m service serve`, no sampler)\n\n"
            + "\n".join(lines) + f"\n\nServer RSS every 30 s (s, GiB): {json.dumps(rss_trace)}\n")


if __name__ == "__main__":
    typer.run(main)
