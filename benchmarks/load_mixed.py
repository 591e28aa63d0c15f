"""Mixed load on one embedded server: N tenants x M models training and sampling at once, for a
fixed time, over plain HTTP (httpx, asyncio).

    .venv/bin/python -m benchmarks.load_mixed [--tenants 4] [--models 2] [--seconds 60]   # from the repository root

It starts `python -m service serve` on the `tiny` model with its vLLM sampler, in a process of its
own (so the RSS it reports is the server's alone), creates the tenants in its database, and runs
one client loop per model (forward_backward of 2 x 32 tokens, then optim_step, each awaited to
its result) and one sampling loop per tenant (asample of 16 new tokens from a snapshot of the
tenant's first model). What it measures, over the window:
- throughput: completed requests per second, by kind and in all;
- latency per kind, p50 / p99, from submitting the request to holding its result (the
  retrieve_future long-poll included);
- fairness: completed requests per tenant, min / max;
- the server's RSS (VmRSS) every `rss_every` seconds, and its start / peak / end;
- errors (refused submissions, failed outcomes, transport errors): must be 0.
Writes the table to benchmarks/results/load_mixed.md unless --no-write.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
import zlib
from collections import defaultdict
from pathlib import Path

import httpx
import numpy as np
import typer

from loraplex.wire.client import encode_forward_backward_request
from service.embedded import free_port
from tests.distributed.processes import create_tenant_key, start_service, wait_healthy
from tests.reliability.processes import rss_bytes, stop

RESULTS = Path(__file__).parent / "results" / "load_mixed.md"
MB = 1 << 20
KINDS = ("forward_backward", "optim_step", "asample")


class Tenant:
    def __init__(self, base_url: str, key: str, index: int) -> None:
        self.index = index
        self.http = httpx.AsyncClient(base_url=f"{base_url}/api/v1", headers={"X-API-Key": key}, timeout=120)

    async def accept(self, route: str, **kw) -> dict:
        response = await self.http.post(route, **kw)
        if response.status_code != 200:
            raise RuntimeError(f"{route}: {response.status_code} {response.text[:200]}")
        return response.json()

    async def result(self, request_id: str) -> None:
        while True:
            response = await self.http.post("retrieve_future", json={"request_id": request_id})
            if response.status_code != 200:
                raise RuntimeError(f"retrieve_future: {response.status_code} {response.text[:200]}")
            if not response.headers["content-type"].startswith("application/json"):
                return
            body = response.json()
            if "error" in body:
                raise RuntimeError(f"failed: {str(body)[:200]}")
            if body.get("type") != "try_again":
                return


def batch(model_id: str, seq_id: int, rng: np.random.Generator) -> bytes:
    rows = [rng.integers(0, 512, 33) for _ in range(2)]
    data = [(r[:-1], {"target_tokens": r[1:], "weights": np.ones(32, np.float32)}) for r in rows]
    return encode_forward_backward_request(model_id, seq_id, data, "cross_entropy")


class Load:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.latencies: dict[str, list[float]] = defaultdict(list)
        self.per_tenant: dict[int, int] = defaultdict(int)
        self.errors: list[str] = []

    async def timed(self, tenant: Tenant, kind: str, route: str, **kw) -> None:
        start = time.monotonic()
        try:
            await tenant.result((await tenant.accept(route, **kw))["request_id"])
        except (RuntimeError, httpx.HTTPError) as e:
            self.errors.append(f"tenant {tenant.index} {kind}: {e}")
            return
        self.latencies[kind].append(time.monotonic() - start)
        self.per_tenant[tenant.index] += 1

    async def train(self, tenant: Tenant, model_id: str, first_seq: int) -> None:
        rng, seq = np.random.default_rng(zlib.crc32(model_id.encode())), first_seq
        while time.monotonic() < self.deadline:
            await self.timed(tenant, "forward_backward", "forward_backward", content=batch(model_id, seq, rng),
                             headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"})
            await self.timed(tenant, "optim_step", "optim_step", json={"model_id": model_id, "seq_id": seq + 1,
                                                                       "adam_params": {"learning_rate": 1e-3}})
            seq += 2

    async def sample(self, tenant: Tenant, sampler_id: str) -> None:
        prompt = {"chunks": [{"type": "encoded_text", "tokens": list(range(5, 21))}]}
        while time.monotonic() < self.deadline:
            await self.timed(tenant, "asample", "asample", json={
                "sampling_session_id": sampler_id, "prompt": prompt, "num_samples": 1,
                "sampling_params": {"max_tokens": 16, "temperature": 1.0, "stop": []}})


async def set_up(tenant: Tenant, models: int) -> tuple[list[str], str]:
    """The tenant's models (each one step trained, untimed) and a sampler on a snapshot of the first."""
    session = (await tenant.accept("create_session", json={"tags": [], "user_metadata": {}}))["session_id"]
    model_ids = []
    for m in range(models):
        created = await tenant.accept("create_model", json={"session_id": session, "model_seq_id": m, "base_model": "tiny",
                                                            "lora_config": {"rank": 8, "seed": 100 * tenant.index + m}})
        await tenant.result(created["request_id"])
        model_ids.append(created["model_id"])
    saved = await tenant.accept("save_weights_for_sampler", json={"model_id": model_ids[0], "seq_id": 1,
                                                                  "sampling_session_seq_id": 0})
    await tenant.result(saved["request_id"])
    return model_ids, f"{session}:sample:0"


async def rss_log(pid: int, every: float, until: float, out: list[tuple[float, int]]) -> None:
    start = time.monotonic()
    while time.monotonic() < until:
        out.append((time.monotonic() - start, rss_bytes(pid)))
        await asyncio.sleep(every)


async def run(base_url: str, keys: list[str], models: int, seconds: float, pid: int, rss_every: float):
    tenants = [Tenant(base_url, key, i) for i, key in enumerate(keys)]
    setups = await asyncio.gather(*(set_up(t, models) for t in tenants))
    warm = Load(0)  # one sample per tenant first: the snapshot loads into vLLM outside the window
    await asyncio.gather(*(warm.timed(t, "asample", "asample", json={
        "sampling_session_id": s, "num_samples": 1, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
        "sampling_params": {"max_tokens": 1}}) for t, (_, s) in zip(tenants, setups)))
    if warm.errors:
        raise RuntimeError(warm.errors)
    load, rss = Load(seconds), []
    start = time.monotonic()
    loops = [load.train(t, m, 2 if i == 0 else 1) for t, (ms, _) in zip(tenants, setups) for i, m in enumerate(ms)]
    loops += [load.sample(t, s) for t, (_, s) in zip(tenants, setups)]
    await asyncio.gather(rss_log(pid, rss_every, load.deadline, rss), *loops)
    elapsed = time.monotonic() - start
    rss.append((elapsed, rss_bytes(pid)))
    for t in tenants:
        await t.http.aclose()
    return load, elapsed, rss


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def table(load: Load, elapsed: float, rss: list[tuple[float, int]], tenants: int, models: int) -> list[str]:
    lines = ["| measure | value |", "|---|---|", f"| tenants x models (training loops) + sampling loops | "
             f"{tenants} x {models} + {tenants} |", f"| window | {elapsed:.1f} s |"]
    total = sum(len(v) for v in load.latencies.values())
    for kind in KINDS:
        done = load.latencies.get(kind, [])
        if done:
            lines.append(f"| {kind}: completed, per s, p50 / p99 latency | {len(done)}, {len(done) / elapsed:.1f}/s, "
                         f"{percentile(done, 50) * 1000:.0f} / {percentile(done, 99) * 1000:.0f} ms |")
    counts = [load.per_tenant.get(i, 0) for i in range(tenants)]
    lines += [f"| all requests per s | {total / elapsed:.1f} |",
              f"| completed per tenant: min / max (min/max) | {min(counts)} / {max(counts)} ({min(counts) / max(counts):.2f}) |",
              f"| server RSS start / peak / end | {rss[0][1] / MB:.0f} / {max(r for _, r in rss) / MB:.0f} / {rss[-1][1] / MB:.0f} MB |",
              "| server RSS over time (s: MB) | " + ", ".join(f"{t:.0f}: {r / MB:.0f}" for t, r in rss) + " |",
              f"| errors | {len(load.errors)} |"]
    return lines


def main(tenants: int = 4, models: int = 2, seconds: float = 60.0, rss_every: float = 10.0, write: bool = True) -> None:
    data_dir, port = Path(tempfile.mkdtemp(prefix="load-mixed-")), free_port()
    env = os.environ | {"LORAPLEX_BASE_MODEL": "tiny", "LORAPLEX_DATA_DIR": str(data_dir), "LORAPLEX_MAX_LORA_RANK": "16",
                        "LORAPLEX_SAMPLER_KV_CACHE_GIB": "0.25", "LORAPLEX_LONG_POLL_SECONDS": "10"}
    server = start_service("serve", env, "--port", str(port))
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, base_url, seconds=300)
        database = f"sqlite:///{(data_dir / 'loraplex.db').resolve()}"
        keys = [create_tenant_key(database, f"tenant-{i}") for i in range(tenants)]
        load, elapsed, rss = asyncio.run(run(base_url, keys, models, seconds, server.pid, rss_every))
    finally:
        stop(server)
    lines = table(load, elapsed, rss, tenants, models)
    print("\n".join(lines))
    for error in load.errors[:10]:
        print("error:", error)
    if write:
        RESULTS.write_text(f"Command: `.venv/bin/python -m benchmarks.load_mixed --tenants {tenants} --models {models} "
                           f"--seconds {seconds:g}` (model tiny, SQLite, `python -m service serve` with the vLLM "
                           f"sampler on loopback, this machine's {os.cpu_count()} CPU cores)\n\n" + "\n".join(lines) + "\n")
    if load.errors:
        raise SystemExit(f"{len(load.errors)} errors")


if __name__ == "__main__":
    typer.run(main)
