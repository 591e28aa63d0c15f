"""Several tenants' fine-tuning and RL runs on one server: all at once, then one after another.

    .venv/bin/python -m examples.driver --base-model SmolLM2-135M-Instruct --runs sft,rl,sft,rl

Starts its own embedded server (`python -m service serve`, a fresh data dir), creates one tenant
per run with `loraplex-admin`, then runs every run concurrently (one thread each, each with its own
client and key) and the same runs serially, and reports each way's total wall time and each run's
own time. Per-run logs and learning curves land in examples/results/ (`<kind>-<i>-<mode>.jsonl|png`),
the summary in examples/results/driver.md.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import typer

import loraplex
from examples import rl_arithmetic, sft
from examples.common import RESULTS

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def embedded_server(base_model: str, port: int) -> Iterator[tuple[str, Callable[[str], str]]]:
    """(base URL, new_tenant(name) -> API key) of a fresh embedded server in a child process."""
    data_dir = Path(tempfile.mkdtemp(prefix="loraplex-examples-"))
    env = os.environ | {"LORAPLEX_DATA_DIR": str(data_dir)}
    server = subprocess.Popen([sys.executable, "-m", "service", "serve", "--base-model", base_model, "--port", str(port)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    for line in server.stdout:  # it prints its URL once it listens
        if line.startswith("Loraplex serving"):
            break
    else:
        raise RuntimeError("the server did not start")

    def new_tenant(name: str) -> str:
        admin = [sys.executable, "-m", "admin.cli", "tenants", "create", name]
        out = subprocess.run(admin, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
        return out.strip().splitlines()[-1]

    try:
        yield f"http://127.0.0.1:{port}", new_tenant
    finally:
        server.terminate()
        server.wait(timeout=60)


def launch(kind: str, index: int, name: str, base_url: str, key: str, base_model: str, settings: dict,
           results: Path) -> dict:
    service = loraplex.ServiceClient(base_url=base_url, api_key=key)
    module = sft if kind == "sft" else rl_arithmetic
    return module.run(service, base_model, name=name, results=results, seed=index, **settings.get(kind, {}))


def compare(base_url: str, new_tenant: Callable[[str], str], base_model: str, runs: list[str], settings: dict,
            results: Path = RESULTS) -> dict:
    """Every run at once, then the same runs one after another; the wall times of both ways."""
    report = {}
    for mode in ("concurrent", "serial"):
        names = [f"{kind}-{i}-{mode}" for i, kind in enumerate(runs)]
        jobs = [(kind, i, name, base_url, new_tenant(name), base_model, settings, results)
                for i, (kind, name) in enumerate(zip(runs, names))]
        start = time.monotonic()
        if mode == "concurrent":
            with ThreadPoolExecutor(len(jobs)) as pool:
                summaries = list(pool.map(lambda job: launch(*job), jobs))
        else:
            summaries = [launch(*job) for job in jobs]
        report[mode] = {"wall_seconds": time.monotonic() - start, "runs": summaries}
    report["serial_over_concurrent"] = report["serial"]["wall_seconds"] / report["concurrent"]["wall_seconds"]
    return report


def markdown(report: dict, command: str) -> str:
    lines = [f"Command: `{command}`", "",
             f"Total wall time: concurrent {report['concurrent']['wall_seconds']:.0f} s, serial "
             f"{report['serial']['wall_seconds']:.0f} s: serial / concurrent = {report['serial_over_concurrent']:.2f}x", "",
             "| run | mode | own time (s) | start | end |", "|---|---|---|---|---|"]
    for mode in ("concurrent", "serial"):
        for run in report[mode]["runs"]:
            metric = "held_out_loss" if run["kind"] == "sft" else "held_out_accuracy"
            lines.append(f"| {run['name']} | {mode} | {run['seconds']:.0f} | {metric} {run[metric + '_start']:.3f} | "
                         f"{run[metric + '_end']:.3f} |")
    return "\n".join(lines) + "\n"


def main(base_model: str = "SmolLM2-135M-Instruct", runs: str = "sft,rl,sft,rl", sft_steps: int = 15,
         rl_steps: int = 10, port: int = typer.Option(0, help="0: any free port")) -> None:
    kinds = [kind.strip() for kind in runs.split(",")]
    unknown = set(kinds) - {"sft", "rl"}
    if unknown:
        raise typer.BadParameter(f"unknown run kinds {sorted(unknown)}: use sft and rl", param_hint="--runs")
    settings = {"sft": {"steps": sft_steps}, "rl": {"steps": rl_steps}}
    with embedded_server(base_model, port or free_port()) as (base_url, new_tenant):
        report = compare(base_url, new_tenant, base_model, kinds, settings)
    command = (f".venv/bin/python -m examples.driver --base-model {base_model} --runs {runs} --sft-steps {sft_steps} "
               f"--rl-steps {rl_steps}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "driver.json").write_text(json.dumps(report, indent=2))
    (RESULTS / "driver.md").write_text(markdown(report, command))
    print(markdown(report, command))


if __name__ == "__main__":
    typer.run(main)
