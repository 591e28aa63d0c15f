"""Several tenants' fine-tuning and RL runs on one server: all at once, then one after another.

    .venv/bin/python -m examples.driver --base-model SmolLM2-135M-Instruct --runs sft,rl,sft,rl

Starts its own embedded server (`python -m service serve`, a fresh data dir), creates one tenant
per run with `loraplex-admin`, then runs every run concurrently and the same runs serially (each
run a process of its own with its own client and key, like each user's notebook), and reports each
way's total wall time, each run's own time, and how busy the server's trainer and sampler were
(its GET /metrics). Per-run logs and learning curves land in examples/results/
(`<kind>-<i>-<mode>.jsonl|png`), the summary in examples/results/driver.md.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import multiprocessing
import queue
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import httpx
import psutil
import typer
from prometheus_client.parser import text_string_to_metric_families

import loraplex
from examples import rl_arithmetic, sft
from examples.common import RESULTS

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def embedded_server(base_model: str, port: int, *, env: dict[str, str] | None = None, stderr=None,
                    start_timeout: float = 600) -> Iterator[tuple[str, Callable[[str], str], psutil.Process]]:
    """(base URL, new_tenant(name) -> API key, the server process) of a fresh embedded server in a
    child process (`env`: its environment, default this one's; `stderr`: where its log goes)."""
    data_dir = Path(tempfile.mkdtemp(prefix="loraplex-examples-"))
    env = (os.environ if env is None else env) | {"LORAPLEX_DATA_DIR": str(data_dir)}
    server = subprocess.Popen([sys.executable, "-m", "service", "serve", "--base-model", base_model, "--port", str(port)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    watchdog = threading.Timer(start_timeout, server.kill)  # one that never serves is killed, which ends the read
    watchdog.start()
    try:
        for line in server.stdout:  # it prints its URL once it listens
            if line.startswith("Loraplex serving"):
                break
        else:
            raise RuntimeError("the server did not start")
    finally:
        watchdog.cancel()

    def new_tenant(name: str) -> str:
        admin = [sys.executable, "-m", "admin.cli", "tenants", "create", name]
        out = subprocess.run(admin, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
        return out.strip().splitlines()[-1]

    try:
        yield f"http://127.0.0.1:{port}", new_tenant, psutil.Process(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)


def launch(kind: str, index: int, name: str, base_url: str, key: str, base_model: str, settings: dict,
           results: Path, go, outbox) -> None:
    """One run's process: connect, report ready, wait for the start signal, run, report the summary."""
    try:
        service = loraplex.ServiceClient(base_url=base_url, api_key=key)
        module = sft if kind == "sft" else rl_arithmetic
        outbox.put(("ready", index, None))
        go.wait()
        summary = module.run(service, base_model, name=name, results=results, seed=index, **settings.get(kind, {}))
        outbox.put(("done", index, summary))
    except BaseException:
        outbox.put(("failed", index, traceback.format_exc()))


def run_together(jobs: list[tuple]) -> tuple[float, list[dict]]:
    """One process per job; once every one is ready (imported and connected), all start at once.
    (Seconds from the start signal until the last one finished, the summaries in job order.)"""
    spawn = multiprocessing.get_context("spawn")
    go, outbox = spawn.Event(), spawn.Queue()
    processes = [spawn.Process(target=launch, args=(*job, go, outbox), daemon=True) for job in jobs]
    for process in processes:
        process.start()
    ready, summaries, start = 0, {}, 0.0
    try:
        while len(summaries) < len(jobs):
            try:
                state, index, payload = outbox.get(timeout=5)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in processes):
                    raise RuntimeError("a run's process died") from None
                continue
            if state == "failed":
                raise RuntimeError(f"run {index} failed:\n{payload}")
            if state == "ready":
                ready += 1
                if ready == len(jobs):
                    start = time.monotonic()
                    go.set()
            else:
                summaries[index] = payload
        seconds = time.monotonic() - start
    finally:  # a failed run stops the others too
        for process in processes:
            if process.exitcode is None and len(summaries) < len(jobs):
                process.terminate()
            process.join()
    return seconds, [summaries[job[1]] for job in jobs]  # job[1]: the run's index


def cpu_seconds(server: psutil.Process) -> float:
    """CPU time the server process and its children (trainer engine, vLLM) have used so far."""
    processes = [server, *server.children(recursive=True)]
    return sum(sum(p.cpu_times()[:2]) for p in processes)


BUSY_METRICS = {  # what the driver reads from the server's GET /metrics, per mode: (sample, its work label)
    "trainer_cycle_seconds": ("loraplex_cycle_seconds_sum", None),
    # with one compute thread (the default on CPU) a cycle's time includes its waits for it
    "trainer_compute_seconds": ("loraplex_compute_thread_busy_seconds_total", "trainer"),
    "trainer_cycles": ("loraplex_cycle_seconds_count", None),
    "forward_backward_cycles": ("loraplex_cycle_tenants_count", None),
    "tenants_in_forward_backward_cycles": ("loraplex_cycle_tenants_sum", None),
    "sampler_busy_seconds": ("loraplex_sampler_step_seconds_sum", None),
    "sampler_generated_tokens": ("loraplex_sampler_generated_tokens_total", None),
}


def busy_counters(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics").text
    values = {(s.name, s.labels.get("work")): s.value for family in text_string_to_metric_families(text)
              for s in family.samples}
    counters = {key: values.get(sample, 0.0) for key, sample in BUSY_METRICS.items()}
    # the trainer's own time: on the compute thread where there is one, else its cycles' time
    counters["trainer_busy_seconds"] = counters["trainer_compute_seconds"] or counters["trainer_cycle_seconds"]
    return counters


def compare(base_url: str, new_tenant: Callable[[str], str], base_model: str, runs: list[str], settings: dict,
            results: Path = RESULTS, server: psutil.Process | None = None) -> dict:
    """Every run at once, then the same runs one after another; the wall time of both ways, how
    busy the server's trainer and sampler were, and (given the server process) its CPU time."""
    report = {}
    # Each run is a process of its own, as each user's notebook would be (threads of one client
    # process would serialize the runs' own Python work on its GIL), in both modes alike; the clock
    # starts when a mode's processes are ready, so process start-up counts in neither.
    for mode in ("concurrent", "serial"):
        names = [f"{kind}-{i}-{mode}" for i, kind in enumerate(runs)]
        jobs = [(kind, i, name, base_url, new_tenant(name), base_model, settings, results)
                for i, (kind, name) in enumerate(zip(runs, names))]
        cpu_start, busy_start = cpu_seconds(server) if server else 0.0, busy_counters(base_url)
        if mode == "concurrent":
            wall_seconds, summaries = run_together(jobs)
        else:
            timed = [run_together([job]) for job in jobs]
            wall_seconds, summaries = sum(t for t, _ in timed), [s for _, [s] in timed]
        report[mode] = {"wall_seconds": wall_seconds, "runs": summaries,
                        **{k: v - busy_start[k] for k, v in busy_counters(base_url).items()}}
        if server:
            report[mode]["server_cpu_seconds"] = cpu_seconds(server) - cpu_start
    report["serial_over_concurrent"] = report["serial"]["wall_seconds"] / report["concurrent"]["wall_seconds"]
    return report


def cpu_lines(report: dict) -> list[str]:
    if "server_cpu_seconds" not in report["serial"]:
        return []
    cores = psutil.cpu_count()
    parts = [f"{mode} {report[mode]['server_cpu_seconds']:.0f} s "
             f"({report[mode]['server_cpu_seconds'] / report[mode]['wall_seconds'] / cores:.0%} of {cores} cores)"
             for mode in ("concurrent", "serial")]
    return ["Server CPU time: " + ", ".join(parts), ""]


def busy_lines(report: dict) -> list[str]:
    lines = ["| mode | trainer busy (s) | trainer cycles | tenants per forward_backward cycle | sampler busy (s) | "
             "sampled tokens |", "|---|---|---|---|---|---|"]
    for mode in ("concurrent", "serial"):
        r = report[mode]
        per_cycle = r["tenants_in_forward_backward_cycles"] / max(r["forward_backward_cycles"], 1)
        lines.append(f"| {mode} | {r['trainer_busy_seconds']:.0f} | {r['trainer_cycles']:.0f} | {per_cycle:.2f} | "
                     f"{r['sampler_busy_seconds']:.0f} | {r['sampler_generated_tokens']:.0f} |")
    return lines + [""]


def markdown(report: dict, command: str) -> str:
    lines = [f"Command: `{command}`", "",
             f"Total wall time: concurrent {report['concurrent']['wall_seconds']:.0f} s, serial "
             f"{report['serial']['wall_seconds']:.0f} s: serial / concurrent = {report['serial_over_concurrent']:.2f}x", "",
             *cpu_lines(report), *busy_lines(report),
             "| run | mode | own time (s) | start | end |", "|---|---|---|---|---|"]
    for mode in ("concurrent", "serial"):
        for run in report[mode]["runs"]:
            metric = "held_out_loss" if run["kind"] == "sft" else "held_out_accuracy"
            lines.append(f"| {run['name']} | {mode} | {run['seconds']:.0f} | {metric} {run[metric + '_start']:.3f} | "
                         f"{run[metric + '_end']:.3f} |")
    return "\n".join(lines) + "\n"


def server_environment() -> str:
    """The settings the server inherits from this environment that change how it uses the cores."""
    names = sorted(k for k in os.environ if k.startswith(("LORAPLEX_", "OMP_", "GOMP_", "MKL_")))
    return " ".join(f"{k}={os.environ[k]}" for k in names)


def main(base_model: str = "SmolLM2-135M-Instruct", runs: str = "sft,rl,sft,rl", sft_steps: int = 15,
         rl_steps: int = 10, port: int = typer.Option(0, help="0: any free port"),
         results: Path = typer.Option(RESULTS, help="where run logs, plots and driver.md|json go")) -> None:
    kinds = [kind.strip() for kind in runs.split(",")]
    unknown = set(kinds) - {"sft", "rl"}
    if unknown:
        raise typer.BadParameter(f"unknown run kinds {sorted(unknown)}: use sft and rl", param_hint="--runs")
    settings = {"sft": {"steps": sft_steps}, "rl": {"steps": rl_steps}}
    with embedded_server(base_model, port or free_port()) as (base_url, new_tenant, server):
        report = compare(base_url, new_tenant, base_model, kinds, settings, results, server=server)
    command = (f"{server_environment()} .venv/bin/python -m examples.driver --base-model {base_model} --runs {runs} "
               f"--sft-steps {sft_steps} --rl-steps {rl_steps}"
               + (f" --results {results}" if results != RESULTS else "")).strip()
    results.mkdir(parents=True, exist_ok=True)
    (results / "driver.json").write_text(json.dumps(report, indent=2))
    (results / "driver.md").write_text(markdown(report, command))
    print(markdown(report, command))


if __name__ == "__main__":
    typer.run(main)
