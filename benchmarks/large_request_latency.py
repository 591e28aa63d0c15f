"""How long another tenant's small requests wait while one tenant streams large ones: the scheduler
running large requests whole (splitting off) versus in parts (on), side by side in one run.

    .venv/bin/python -m benchmarks.large_request_latency [--seconds 180] [--datums 128] [--tokens 2048] \
        [--small-models 4] [--alone 2]   # from the repository root

One tenant sends forward_backward requests of `datums` x `tokens` tokens back to back (the next as
soon as the last is answered), which is the case measured in issue 29: 128 x 2,048 tokens took
31.8 s, and a 6-token request of another tenant sent 1 s later waited 30.7 s. Meanwhile another
tenant sends 6-token forward_backward requests from `small_models` models, each model one at a
time with a random pause of up to 0.5 s. Latency is from the POST to the answer of the long-poll
(retrieve_future), through a bare HTTP client (httpx; the protocol the SDKs speak), against the
embedded server on a thread of this process (`ServerThread`, model `tiny`, SQLite, the default
cycle budget of 8,192 tokens, no sampler). Each side runs `seconds`, on a fresh server; the
planner's `split_requests` switch is the only difference. What splitting costs the large tenant:
its throughput during that traffic (which also pays for serving the small requests it now lets
in), and before it, the latency of `alone` large requests with no other traffic at all.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import sqlalchemy as sa
import tinker
import transformers
import typer

from db.models import Request
from loraplex.wire.client import encode_forward_backward_request
from service.embedded import ServerThread, free_port
from service.settings import Settings

RESULTS = Path(__file__).parent / "results" / "large_request_latency.md"
HEADERS = {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}


def body(model_id: str, seq_id: int, rows: list[np.ndarray]) -> bytes:
    data = [(r[:-1], {"target_tokens": r[1:], "weights": np.ones(len(r) - 1, np.float32)}) for r in rows]
    return encode_forward_backward_request(model_id, seq_id, data, "cross_entropy")


class Model:
    """One model's requests, one at a time in seq_id order, over plain HTTP."""

    def __init__(self, base_url: str, key: str) -> None:
        self.model_id = tinker.ServiceClient(base_url=base_url, api_key=key).create_lora_training_client(
            base_model="tiny", rank=8, seed=0).result().model_id
        self.http = httpx.Client(base_url=base_url, headers={"X-API-Key": key}, timeout=120)
        self.seq_id = 0

    def forward_backward(self, rows: list[np.ndarray]) -> float:
        """Seconds from sending it to its answer."""
        self.seq_id += 1
        payload = body(self.model_id, self.seq_id, rows)
        start = time.perf_counter()
        request_id = self.http.post("/api/v1/forward_backward", content=payload, headers=HEADERS).json()["request_id"]
        while True:
            answer = self.http.post("/api/v1/retrieve_future", json={"request_id": request_id})
            if answer.headers["content-type"].startswith("application/x-protobuf"):
                return time.perf_counter() - start
            if "try_again" not in answer.text:
                raise RuntimeError(f"request {request_id} failed: {answer.text[:300]}")


@dataclass
class Side:
    split: bool
    small: list[float] = field(default_factory=list)  # seconds per small request
    large: list[float] = field(default_factory=list)  # seconds per large request
    alone: list[float] = field(default_factory=list)  # seconds per large request with no other traffic
    large_tokens_per_s: float = 0.0
    cycles_per_large: float = 0.0


def run_side(split: bool, seconds: float, datums: int, tokens: int, small_models: int, alone: int) -> Side:
    server = ServerThread(Settings(data_dir=Path(tempfile.mkdtemp()), port=free_port(), base_model="tiny",
                                   sampler_enabled=False))
    side = Side(split)
    try:
        server.embedded.scheduler.planner.split_requests = split
        rng = np.random.default_rng(0)
        large_rows = [rng.integers(0, 512, tokens + 1) for _ in range(datums)]
        large = Model(server.base_url, server.new_tenant())
        small_key = server.new_tenant()
        smalls = [Model(server.base_url, small_key) for _ in range(small_models)]
        for model in smalls:  # warm-up: the first call of a model is not what we measure
            model.forward_backward([rng.integers(0, 512, 7)])
        side.alone = [large.forward_backward(large_rows) for _ in range(alone)]  # what splitting itself costs
        stop, deadline = threading.Event(), time.monotonic() + seconds
        finished_at: list[float] = []

        def stream_large() -> None:
            while not stop.is_set():
                side.large.append(large.forward_backward(large_rows))
                finished_at.append(time.perf_counter())

        def send_small(model: Model, seed: int) -> None:
            pause, tokens_of = random.Random(seed), np.random.default_rng(seed)  # a generator per thread
            while time.monotonic() < deadline:
                side.small.append(model.forward_backward([tokens_of.integers(0, 512, 7)]))
                time.sleep(pause.uniform(0, 0.5))

        started = time.perf_counter()
        streamer = threading.Thread(target=stream_large)
        streamer.start()
        time.sleep(1.0)  # the first large request is running, as in the measurement
        senders = [threading.Thread(target=send_small, args=(m, i)) for i, m in enumerate(smalls)]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        stop.set()
        streamer.join()
        side.large_tokens_per_s = len(side.large) * datums * tokens / (finished_at[-1] - started)
        with server.embedded.sessions() as s:
            ids = set(s.scalars(sa.select(Request.id).where(Request.model_id == large.model_id, Request.seq_id > 0)))
        side.cycles_per_large = sum(len(ids & set(c)) for c in server.embedded.scheduler.cycle_log.cycles) / len(ids)
    finally:
        server.stop()
    return side


def nearest_rank(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(seconds: float = 180, datums: int = 128, tokens: int = 2048, small_models: int = 4, alone: int = 2,
         write: bool = True) -> None:
    transformers.utils.logging.disable_progress_bar()
    sides = []
    for split in (False, True):
        sides.append(run_side(split, seconds, datums, tokens, small_models, alone))
        print("split" if split else "whole", len(sides[-1].small), statistics.median(sides[-1].small), flush=True)
    lines = ["| measure | splitting off (large requests whole) | splitting on (in parts) |", "|---|---|---|"]

    def row(label: str, cell) -> None:
        lines.append(f"| {label} | {cell(sides[0])} | {cell(sides[1])} |")

    row("small requests (6 tokens) measured", lambda s: f"{len(s.small)}")
    row("**small request latency, p50 / p99**", lambda s: f"**{statistics.median(s.small):.2f} / "
        f"{nearest_rank(s.small, 0.99):.2f} s**")
    row("small request latency, max", lambda s: f"{max(s.small):.2f} s")
    row(f"large requests ({datums} x {tokens} tokens) answered", lambda s: f"{len(s.large)}")
    row("large request latency, mean", lambda s: f"{statistics.mean(s.large):.1f} s")
    row(f"large request latency with no other traffic, mean of {alone}", lambda s: f"{statistics.mean(s.alone):.1f} s")
    row("large tenant's throughput", lambda s: f"{s.large_tokens_per_s:,.0f} tokens/s")
    row("engine calls (cycles) per large request", lambda s: f"{s.cycles_per_large:.1f}")
    print("\n".join(lines))
    if write:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(
            f"Command: `.venv/bin/python -m benchmarks.large_request_latency --seconds {seconds:g} --datums {datums} "
            f"--tokens {tokens} --small-models {small_models} --alone {alone}` (model tiny, SQLite, embedded server "
            f"on a thread, cycle budget 8,192 tokens; {seconds:g} s of traffic per side)\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    typer.run(main)
