"""What the service adds: a small forward_backward + optim_step through the official tinker SDK
over HTTP (embedded server on loopback) versus the same engine calls in-process, side by side.

    .venv/bin/python -m benchmarks.service_overhead [--rounds 100] [--clients 8] [--before REV --pairs 2]
    # from the repository root (uses tests/ helpers)

Part 1, latency: one client, `rounds` rounds of forward_backward(2 x 16 tokens).result() +
optim_step().result(); p50/p99 per round through the SDK and in-process, and the p50 difference
(the added latency, which includes HTTP, the database record of each request, the long-poll
wake-up, and writing the adapter's durable state after every optim_step).
Part 2, throughput: `clients` SDK clients (one tenant each) run rounds concurrently; requests/s
and how many tenants shared each batched engine call on average.
Both parts run twice: against `python -m service serve` in a process of its own (the README's
main command, as a user runs it beside a notebook) and against the embedded server on a thread
of the client's process (`ServerThread`, as a notebook or a test embeds it: the two then share
one GIL, and the OpenMP defaults, since torch was loaded first).
With `--before REV`, both parts run on REV's code (a temporary git worktree, benchmarks/before_tree.py)
and on this tree in alternating processes, `--pairs` per tree (the order flipped every pair); each
figure is the median over its processes, written to results/service_overhead_before.md.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import tinker
import transformers
import typer
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from service.embedded import ServerThread, free_port
from service.settings import Settings
from tests.distributed.processes import create_tenant_key, start_service, wait_healthy
from tests.servers import metric
from workers.trainer.engine import TrainerEngine

try:
    from contract.configs import LoraConfig
    from loraplex.types import AdamParams
except ModuleNotFoundError:  # the layout before the torch-free contract (c980d9e), for --before
    from workers.trainer.adapters import AdamParams, LoraConfig
try:
    from contract.inputs import EngineDatum, ForwardBackwardInput
except ModuleNotFoundError:  # for --before: the trainer's inputs before contract/ held them (d4c7dc5), or c980d9e's
    try:
        from workers.trainer.inputs import EngineDatum, ForwardBackwardInput
    except ModuleNotFoundError:
        from workers.trainer.batch import Datum as EngineDatum
        from workers.trainer.batch import ForwardBackwardInput

RESULTS = Path(__file__).parent / "results" / "service_overhead.md"
BEFORE_RESULTS = Path(__file__).parent / "results" / "service_overhead_before.md"


def token_rows(seed: int, n: int = 2, length: int = 16) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, length + 1) for _ in range(n)]


def sdk_data(rows) -> list[types.Datum]:
    return [types.Datum(model_input=types.ModelInput.from_ints(r[:-1].tolist()),
                        loss_fn_inputs={"target_tokens": r[1:], "weights": np.ones(len(r) - 1, np.float32)}) for r in rows]


def engine_data(rows) -> list[EngineDatum]:
    return [EngineDatum(r[:-1], {"target_tokens": r[1:], "weights": np.ones(len(r) - 1, np.float32)}) for r in rows]


class RawClient:
    """The same protocol calls as the SDK with plain httpx: separates server cost from SDK cost."""

    def __init__(self, base_url: str, key: str, model_id: str) -> None:
        self.http = httpx.Client(base_url=base_url, headers={"X-API-Key": key}, timeout=60)
        self.model_id, self.seq_id = model_id, 0

    def _wait(self, request_id: str) -> None:
        while "try_again" in self.http.post("/api/v1/retrieve_future", json={"request_id": request_id}).text:
            pass

    def round(self, data: list[types.Datum]) -> None:
        self.seq_id += 1
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
            model_id=self.model_id, seq_id=self.seq_id)
        body = forward_backward_request_to_proto(request).SerializeToString()
        r = self.http.post("/api/v1/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"})
        self._wait(r.json()["request_id"])
        self.seq_id += 1
        r = self.http.post("/api/v1/optim_step", json={"model_id": self.model_id, "seq_id": self.seq_id,
                                                         "adam_params": {"learning_rate": 1e-4}})
        self._wait(r.json()["request_id"])


class ServeCommand:
    """`python -m service serve` in a process of its own, exactly as a user starts it beside a
    notebook (with the OpenMP settings it applies before torch loads). Tenants are created in its
    SQLite database from here."""

    def __init__(self, settings: Settings) -> None:
        self._database_url = settings.resolved_database_url
        self._process = start_service("serve", dict(os.environ), "--base-model", settings.base_model,
                                      "--port", str(settings.port), "--data-dir", str(settings.data_dir))
        self.base_url = f"http://{settings.host}:{settings.port}"
        wait_healthy(self._process, self.base_url, seconds=600)
        # one sample waits until vLLM is up: it loads in the background, not while we measure
        tinker.ServiceClient(base_url=self.base_url, api_key=self.new_tenant()).create_sampling_client(
            base_model=settings.base_model).sample(types.ModelInput.from_ints([1, 2, 3]), 1,
                                                   types.SamplingParams(max_tokens=1)).result()

    def new_tenant(self) -> str:
        return create_tenant_key(self._database_url, f"bench-{uuid.uuid4().hex[:8]}")

    def stop(self) -> None:
        self._process.terminate()
        self._process.wait(timeout=60)


class LocalServer(ServerThread):
    """The embedded server on a thread of this process, once its sampler is ready."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        if self.embedded.sampling is not None:  # vLLM starts in the background: not while we measure
            self.embedded.sampling.engine.wait_ready(timeout=600)


def tenants_per_cycle(base_url: str) -> tuple[float, float]:
    """(sum, count) of the server's histogram of tenants per batched forward_backward call."""
    return metric(base_url, "loraplex_cycle_tenants_sum"), metric(base_url, "loraplex_cycle_tenants_count")


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def measure(server, rounds: int, clients: int) -> dict:
    """Both parts against `server` (a ServeCommand or a LocalServer), which it stops."""
    rows = token_rows(0)
    try:
        # --- latency: SDK round vs in-process round, interleaved ---
        tc = tinker.ServiceClient(base_url=server.base_url, api_key=server.new_tenant()).create_lora_training_client(
            base_model="tiny", rank=8, seed=0).result()
        engine = TrainerEngine("tiny")
        engine.create_adapter("solo", LoraConfig(rank=8, seed=0))
        raw_key = server.new_tenant()
        raw_model = tinker.ServiceClient(base_url=server.base_url, api_key=raw_key).create_lora_training_client(
            base_model="tiny", rank=8, seed=0).result().model_id
        raw = RawClient(server.base_url, raw_key, raw_model)
        sdk_times, raw_times, local_times = [], [], []
        for i in range(rounds + 5):
            t0 = time.perf_counter()
            tc.forward_backward(sdk_data(rows), "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            t1 = time.perf_counter()
            raw.round(sdk_data(rows))
            t2 = time.perf_counter()
            engine.forward_backward([ForwardBackwardInput("solo", engine_data(rows))])
            engine.optim_step([("solo", AdamParams(learning_rate=1e-4))])
            t3 = time.perf_counter()
            if i >= 5:  # warm-up
                sdk_times.append(1000 * (t1 - t0))
                raw_times.append(1000 * (t2 - t1))
                local_times.append(1000 * (t3 - t2))

        # --- throughput: concurrent clients, one tenant each ---
        trainers = [tinker.ServiceClient(base_url=server.base_url, api_key=server.new_tenant())
                    .create_lora_training_client(base_model="tiny", rank=8, seed=i).result() for i in range(clients)]
        per_client = max(1, rounds // clients * 2)
        tenants_before, cycles_before = tenants_per_cycle(server.base_url)

        def run(trainer):
            for _ in range(per_client):
                trainer.forward_backward(sdk_data(rows), "cross_entropy").result()
                trainer.optim_step(types.AdamParams(learning_rate=1e-4)).result()

        threads = [threading.Thread(target=run, args=(t,)) for t in trainers]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        tenants_after, cycles_after = tenants_per_cycle(server.base_url)
        mean_batch = (tenants_after - tenants_before) / (cycles_after - cycles_before)
    finally:
        server.stop()
    sdk_p50, sdk_p99 = percentiles(sdk_times)
    raw_p50, raw_p99 = percentiles(raw_times)
    local_p50, local_p99 = percentiles(local_times)
    return {"sdk": (sdk_p50, sdk_p99), "raw": (raw_p50, raw_p99), "local": (local_p50, local_p99),
            "requests_per_s": 2 * clients * per_client / elapsed, "mean_batch": mean_batch}


def measure_both(rounds: int, clients: int) -> dict[str, dict]:
    results = {}
    for where, server_class in (("process", ServeCommand), ("thread", LocalServer)):
        results[where] = measure(server_class(Settings(data_dir=Path(tempfile.mkdtemp()), port=free_port())),
                                 rounds, clients)
        print(where, results[where], flush=True)
    return results


def table(results: dict[str, dict], clients: int, columns: dict[str, str]) -> list[str]:
    """One row per measure, a column per key of `results` (titled by `columns`)."""
    lines = [f"| measure | {' | '.join(columns.values())} |", f"|---|{'---|' * len(columns)}"]

    def row(label: str, cell) -> None:
        lines.append(f"| {label} | {' | '.join(cell(results[k]) for k in columns)} |")

    row("round (fwd_bwd 2x16 tokens + optim_step) through the SDK, p50 / p99",
        lambda r: "%.1f / %.1f ms" % tuple(r["sdk"]))
    row("same round with a bare HTTP client (httpx, no SDK), p50 / p99", lambda r: "%.1f / %.1f ms" % tuple(r["raw"]))
    row("same engine calls in-process, p50 / p99", lambda r: "%.1f / %.1f ms" % tuple(r["local"]))
    row("**added per call through the SDK, p50** (target 10 ms)",
        lambda r: f"**{(r['sdk'][0] - r['local'][0]) / 2:.1f} ms**")
    row("added per call by the server + HTTP (bare client), p50",
        lambda r: f"{(r['raw'][0] - r['local'][0]) / 2:.1f} ms")
    row(f"{clients} concurrent SDK clients: requests/s", lambda r: f"{r['requests_per_s']:.0f}")
    row(f"{clients} concurrent SDK clients: forward_backward requests per engine call (mean)",
        lambda r: f"{r['mean_batch']:.2f}")
    return lines


def median_result(runs: list[dict]) -> dict:
    """Each figure's median over the processes' results."""
    def med(key, i=None):
        return statistics.median(r[key] if i is None else r[key][i] for r in runs)
    return {k: (med(k, 0), med(k, 1)) if isinstance(runs[0][k], (list, tuple)) else med(k) for k in runs[0]}


def compare_with_before(before: str, pairs: int, rounds: int, clients: int) -> list[str]:
    from benchmarks.before_tree import ROOT, run_in_tree, short_rev, worktree

    runs: dict[str, list[dict]] = {}
    args = ("--rounds", str(rounds), "--clients", str(clients), "--json")
    with worktree(before) as old:
        for pair in range(pairs):
            order = (("before", old), ("now", ROOT)) if pair % 2 == 0 else (("now", ROOT), ("before", old))
            for label, tree in order:
                result = run_in_tree(tree, Path(__file__).resolve(), *args)
                print(label, "pair", pair + 1, json.dumps(result), flush=True)
                for where, r in result.items():
                    runs.setdefault(f"{where} {label}", []).append(r)
    rev = short_rev(before)
    columns = {"process before": f"`serve`, {rev}", "process now": "`serve`, this tree",
               "thread before": f"thread, {rev}", "thread now": "thread, this tree"}
    return table({k: median_result(v) for k, v in runs.items()}, clients, columns)


def main(rounds: int = 100, clients: int = 8, write: bool = True, before: str | None = None, pairs: int = 2,
         json_result: bool = typer.Option(False, "--json", hidden=True)) -> None:
    transformers.utils.logging.disable_progress_bar()
    command = f".venv/bin/python -m benchmarks.service_overhead --rounds {rounds} --clients {clients}"
    if before is not None:
        lines = compare_with_before(before, pairs, rounds, clients)
        text = (f"Command: `{command} --before {before} --pairs {pairs}` (model tiny, SQLite, embedded server on "
                f"loopback; each figure the median over {pairs} processes per tree, alternating)\n\n"
                + "\n".join(lines) + "\n")
        print(text)
        if write:
            BEFORE_RESULTS.write_text(text)
        return
    results = measure_both(rounds, clients)
    if json_result:  # a child of --before: its results, on one line
        print(json.dumps(results))
        return
    lines = table(results, clients, {"process": "`python -m service serve` (own process)",
                                     "thread": "server on a thread of the client's process"})
    print("\n".join(lines))
    if write:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(f"Command: `{command}` (model tiny, SQLite, embedded server on loopback)\n\n"
                           + "\n".join(lines) + "\n")


if __name__ == "__main__":
    typer.run(main)
