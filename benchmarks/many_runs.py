"""A thousand training runs on one server under a memory budget: what stays resident, what it costs on
disk, and what a paged-out run's step costs, against the same active runs with nothing paged.

    .venv/bin/python -m benchmarks.many_runs [--runs 1000] [--active 0.1] [--rounds 3] [--budget-gib 6] \
        [--repeats 1] [--model HuggingFaceTB/SmolLM2-135M-Instruct] [--clients 4] [--compare-prefetch] \
        [--one-at-a-time 20] [--never-paged-holds-all]

It starts `python -m service serve` (no sampler) in a process of its own, so the RSS it samples every
second is the server's. Phase 1: `runs` rank-8 runs, created and stepped once each (a forward_backward
of 2 x 32 tokens, then an optim_step), round-robin over `clients` concurrent HTTP clients; the trainer
pages the least recently used out past its budget (LORAPLEX_TRAINER_MEMORY_BUDGET). Phase 2: a random
`active` share of the runs, drawn from the first half created (paged out by then when the budget holds
less than half of them), steps `rounds` times: the first round finds them paged out (cold), the later
ones resident (`repeats` times, the active runs paged out again before each). With --compare-prefetch,
phases 1 and 2 run on two servers, one reading paged-out runs back ahead of their cycle (the default),
one not (LORAPLEX_TRAINER_PREFETCH_BYTES=0): what prefetch buys a cold step (docs/memory.md). In
round 1 every client's run is cold at once, so a step waits for the others' page-ins too; then, on one
client, `one_at_a_time` paged-out runs of the first half step one at a time, taking turns with
resident ones: a cold step's own extra latency. Phase 3: a server without a budget holds as many runs
as the active set (or all of them, --never-paged-holds-all, where they fit in RAM: then nothing but
the paging differs), never paged, and steps the active set the same way: its throughput against phase
2's resident rounds is what the budget costs the active set. All servers are
up at once, but each phase and each round runs on one at a time, the servers taking turns round by
round, so that other load on the machine falls on all alike and none competes with another.
The disk's read bandwidth is measured with O_DIRECT on a file the size of one run's state, for what
one page-in should cost. Writes benchmarks/results/many_runs.md (or --out) unless --no-write.
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
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import typer
from prometheus_client.parser import text_string_to_metric_families

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
    def __init__(self, data_dir: Path, budget_gib: float | None, prefetch: bool = True) -> None:
        self.port, self.data_dir = free_port(), data_dir
        env = os.environ | {"LORAPLEX_BASE_MODEL": MODEL, "LORAPLEX_SAMPLER_ENABLED": "false",
                            "LORAPLEX_MAX_LORA_RANK": "16", "LORAPLEX_TRAINER_MEMORY_FRACTION": "0"}
        if budget_gib is not None:
            env["LORAPLEX_TRAINER_MEMORY_BUDGET"] = str(int(budget_gib * 2**30))
        if not prefetch:
            env["LORAPLEX_TRAINER_PREFETCH_BYTES"] = "0"
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

    def metric(self, name: str) -> float:
        """One of the server's Prometheus numbers (0 if it has none)."""
        text = httpx.get(f"{self.base_url}/metrics").text
        return next((s.value for family in text_string_to_metric_families(text) for s in family.samples
                     if s.name == name), 0.0)

    def stop(self) -> None:
        self._stop.set()
        stop(self.process)


def page_in_counts(server: Server) -> tuple[float, float]:
    """The server's page-ins so far: (read ahead, read on the cycle's path)."""
    return server.metric("loraplex_trainer_prefetch_hits_total"), server.metric("loraplex_trainer_prefetch_misses_total")


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


def a_round(runs: list[Run], clients: int, seed: int) -> tuple[list[float], float]:
    """Every run steps once: (step latencies, steps per second)."""
    started = time.perf_counter()
    latencies = in_parallel(clients, runs, lambda run: run.step(np.random.default_rng(seed)))
    return latencies, len(runs) / (time.perf_counter() - started)


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


@dataclass
class Bench:
    """One server of the comparison, and what was measured on it."""

    server: Server
    prefetch: bool | None  # None: the server without a budget (never pages)
    runs: list[Run] = field(default_factory=list)
    active: list[Run] = field(default_factory=list)
    cold: list[float] = field(default_factory=list)  # step latencies of paged-out runs
    warm: list[float] = field(default_factory=list)  # of resident ones
    warm_rates: list[float] = field(default_factory=list)  # steps per second of the active set, resident
    cold_alone: list[float] = field(default_factory=list)  # a paged-out run stepped with nothing beside it
    warm_alone: list[float] = field(default_factory=list)  # a resident one, likewise, taking turns with those
    alone_page_ins: tuple[float, float] = (0, 0)  # page-ins while stepping alone: (read ahead, on the path)
    phase1_seconds: float = 0.0
    base_rss: int = 0

    @property
    def first_half(self) -> list[Run]:
        """The runs created first: the active set is drawn from them, so the second half's runs, created
        after, paged them out (a budgeted server)."""
        return self.runs[: max(1, len(self.runs) // 2)]

    @property
    def second_half(self) -> list[Run]:
        return self.runs[len(self.first_half):]

    @property
    def idle(self) -> list[Run]:
        """The first half's runs outside the active set: paged out in phase 1 (a budgeted server), not stepped
        in phase 2."""
        return [run for run in self.first_half if run not in self.active]

    @property
    def name(self) -> str:
        return "never paged" if self.prefetch is None else f"prefetch {'on' if self.prefetch else 'off'}"

    def peak_rss(self) -> int:
        return max(v for _, v in self.server.rss)


def main(runs: int = 1000, active: float = 0.1, rounds: int = 3, repeats: int = 1, budget_gib: float = 6.0,
         clients: int = 4, model: str = MODEL, compare_prefetch: bool = False, never_paged_holds_all: bool = False,
         one_at_a_time: int = 20, write: bool = True, out: Path = RESULTS) -> None:
    """repeats: phase 2 that many times, the active runs paged out again before each (every run of the second
    half steps once: the budget must hold fewer). never_paged_holds_all: the server without a budget holds
    all `runs` runs, not only the active ones (they must fit in RAM), so that its comparison separates what
    paging costs from what holding many runs costs. one_at_a_time: paged-out and resident steps taken
    one at a time, taking turns, on one client. out: the results file."""
    global MODEL
    MODEL = model
    active_runs = max(1, int(active * runs))
    settings = (False, True) if compare_prefetch else (True,)
    with tempfile.TemporaryDirectory(prefix="many-runs-") as tmp:
        tmp = Path(tmp)
        # All servers up at once; each phase and round runs on one server at a time, taking turns, so that
        # other load on the machine falls on all alike and no server competes with another.
        benches: list[Bench] = []
        try:
            for prefetch in (*settings, None):
                folder = tmp / ("resident" if prefetch is None else f"paged-{'on' if prefetch else 'off'}")
                benches.append(Bench(Server(folder, budget_gib if prefetch is not None else None,
                                            prefetch is not False), prefetch))
            paged, alone = benches[:-1], benches[-1]
            for bench in benches:
                bench.base_rss = rss_bytes(bench.server.process.pid)
                started = time.monotonic()
                holds_all = bench.prefetch is not None or never_paged_holds_all
                bench.runs = create_and_step(bench.server, runs if holds_all else active_runs, clients)
                bench.phase1_seconds = time.monotonic() - started
                # the same active set (by creation order) on every paged server, drawn from the first half
                bench.active = random.Random(0).sample(bench.first_half, active_runs) if holds_all else bench.runs
            for repeat in range(repeats):
                if repeat:  # page the active runs out again: the runs of the second half step once
                    for bench in paged:
                        a_round(bench.second_half, clients, 7)
                for r in range(rounds):
                    for bench in benches:  # taking turns
                        latencies, rate = a_round(bench.active, clients, 1000 + r)
                        if r == 0 and bench.prefetch is not None:
                            bench.cold += latencies
                        else:
                            bench.warm += latencies
                            bench.warm_rates.append(rate)
            for bench in paged:  # one run at a time, a paged-out one then a resident one: a cold step's own cost
                before = page_in_counts(bench.server)
                for i, (cold, warm) in enumerate(zip(bench.idle[:one_at_a_time], bench.active)):
                    bench.cold_alone.append(cold.step(np.random.default_rng(2000 + i)))
                    bench.warm_alone.append(warm.step(np.random.default_rng(2000 + i)))
                after = page_in_counts(bench.server)
                bench.alone_page_ins = (after[0] - before[0], after[1] - before[1])
            counts = {b.name: {name: b.server.metric(f"loraplex_trainer_{name}") for name in (
                "prefetch_hits_total", "prefetch_misses_total", "page_in_seconds_count", "page_in_seconds_sum")}
                for b in paged}
            live = tmp / paged[-1].name.replace("prefetch ", "paged-") / "live"
            disk_per_run = du(live) / runs
            # a paged-out run never stepped again (one_at_a_time stepped the first idle ones): its one copy, in
            # either of its two slots (storage/live_slots.py)
            state_bytes = sum(du(Path(slot)) for slot in slot_paths(str(live), paged[-1].idle[-1].model_id))
        finally:
            for bench in benches:
                bench.server.stop()
        bandwidth = disk_read_bytes_per_second(tmp, state_bytes or 34 * MB)

    page_in_ms = state_bytes / bandwidth * 1000
    rate_alone = statistics.median(alone.warm_rates)
    ms = lambda values, q: f"{pct(values, q) * 1000:.0f}"  # noqa: E731

    def row(what: str, cell) -> str:
        return f"| {what} | " + " | ".join(cell(b) for b in paged) + " |"

    def on_path(b: Bench) -> str:
        c = counts[b.name]
        mean = c["page_in_seconds_sum"] / c["page_in_seconds_count"] * 1000 if c["page_in_seconds_count"] else 0
        return f"{c['prefetch_hits_total']:.0f} / {c['prefetch_misses_total']:.0f}; {mean:.1f} ms"

    extra = lambda b: (pct(b.cold, 0.5) - pct(b.warm, 0.5)) * 1000  # noqa: E731
    lines = [
        "| measure | " + " | ".join(b.name if compare_prefetch else "value" for b in paged) + " |",
        "|---|" + "---|" * len(paged),
        row(f"runs (rank 8, {model}) / active set", lambda b: f"{runs} / {active_runs}"),
        row("memory budget", lambda b: f"{budget_gib:g} GiB"),
        row("server RSS: after start / peak", lambda b: f"{b.base_rss / 2**30:.2f} / {b.peak_rss() / 2**30:.2f} GiB"),
        row("disk per run (live slots, after phase 2)", lambda b: f"{disk_per_run / MB:.1f} MB"),
        row("one run's state / the disk's O_DIRECT read bandwidth / so one page-in should take",
            lambda b: f"{state_bytes / MB:.1f} MB / {bandwidth / MB:.0f} MB/s / {page_in_ms:.0f} ms"),
        row("page-ins read ahead / read on the cycle's path; mean page-in time on the cycle's path",
            on_path),
        row(f"step (forward_backward + optim_step) latency, paged-out run ({repeats} x round 1), p50 / p99",
            lambda b: f"{ms(b.cold, 0.5)} / {ms(b.cold, 0.99)} ms"),
        row(f"the same, resident (rounds 2-{rounds}), p50 / p99", lambda b: f"{ms(b.warm, 0.5)} / {ms(b.warm, 0.99)} ms"),
        row("**a cold step's extra latency, p50** (paged-out minus resident)",
            lambda b: f"**{extra(b):.0f} ms** ({extra(b) / page_in_ms:.1f} page-ins)"),
        row(f"**one run at a time: a paged-out step's extra latency, p50** ({one_at_a_time} of each, taking turns)",
            lambda b: f"**{(pct(b.cold_alone, 0.5) - pct(b.warm_alone, 0.5)) * 1000:.0f} ms** "
                      f"({ms(b.cold_alone, 0.5)} vs {ms(b.warm_alone, 0.5)} ms; page-ins read ahead / on the path: "
                      f"{b.alone_page_ins[0]:.0f} / {b.alone_page_ins[1]:.0f})"),
        row(f"the same runs on a server that never paged (holding {len(alone.runs)} runs), p50 / p99",
            lambda b: f"{ms(alone.warm, 0.5)} / {ms(alone.warm, 0.99)} ms"),
        row("**active-set throughput, paged server / never paged** (median of resident rounds)",
            lambda b: f"{statistics.median(b.warm_rates):.2f} / {rate_alone:.2f} steps/s "
                      f"(**{statistics.median(b.warm_rates) / rate_alone:.2f}x**)"),
        row(f"phase 1: create + step of {runs} runs", lambda b: f"{b.phase1_seconds:.0f} s"),
    ]
    print("\n".join(lines))
    if write:
        traces = "\n".join(f"Server RSS every 30 s (s, GiB), {b.name}: " + json.dumps(
            [(round(t - b.server.rss[0][0]), round(v / 2**30, 2)) for t, v in b.server.rss[::30]]) for b in paged)
        out.write_text(
            f"Command: `.venv/bin/python -m benchmarks.many_runs --runs {runs} --active {active:g} --rounds {rounds} "
            f"--repeats {repeats} --budget-gib {budget_gib:g} --clients {clients}"
            f"{' --compare-prefetch' if compare_prefetch else ''}"
            f"{' --never-paged-holds-all' if never_paged_holds_all else ''} --one-at-a-time {one_at_a_time}"
            f"{'' if out == RESULTS else f' --out {out}'}` (`python -m service serve`, no sampler)\n\n"
            + "\n".join(lines) + f"\n\n{traces}\n")


if __name__ == "__main__":
    typer.run(main)
