"""What reading a run's RL groups costs when they are inferred from its trained datums (db/inferred_groups.py):
GET /dashboard/api/runs/{run}/rl_groups on an RL run whose forward_backwards carry advantages, and on an
SFT run of the same size (whose bodies the route skips), against an embedded server (no sampler).

    .venv/bin/python -m benchmarks.rl_groups_read [--steps 20]   # from the repository root

Each step: one forward_backward of `groups` x `size` datums of `prompt` + `tail` tokens, then an
optim_step. Timed: the whole run (the page's first load, since=-1) and its last two steps (the page's
poll, since=steps-2), median of 5 reads each. The table goes to results/rl_groups_read.md.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import httpx
import loraplex
import numpy as np
import typer
from loraplex import types

from service.embedded import ServerThread, free_port
from service.settings import Settings

RESULTS = Path(__file__).resolve().parent / "results" / "rl_groups_read.md"


def rl_batch(rng: np.random.Generator, groups: int, size: int, prompt: int, tail: int) -> list[types.Datum]:
    data = []
    for _ in range(groups):
        shared = rng.integers(10, 400, prompt).tolist()
        advantages = rng.normal(size=size)
        for advantage in advantages - advantages.mean():  # centred in the group, as tinker-cookbook's
            tokens = shared + rng.integers(10, 400, tail).tolist()
            sampled = np.array([0.0] * (prompt - 1) + [1.0] * tail, dtype=np.float32)
            data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                "target_tokens": np.array(tokens[1:], dtype=np.int64), "logprobs": sampled * -2.0,
                "advantages": (sampled * advantage).astype(np.float32)}))
    return data


def sft_batch(rng: np.random.Generator, groups: int, size: int, prompt: int, tail: int) -> list[types.Datum]:
    rows = (rng.integers(10, 400, prompt + tail).tolist() for _ in range(groups * size))
    return [types.Datum(model_input=types.ModelInput.from_ints(t[:-1]), loss_fn_inputs={
        "target_tokens": np.array(t[1:], dtype=np.int64), "weights": np.ones(len(t) - 1, dtype=np.float32)})
        for t in rows]


def main(steps: int = typer.Option(20), groups: int = typer.Option(8), size: int = typer.Option(8),
         prompt: int = typer.Option(200), tail: int = typer.Option(40)) -> None:
    rng = np.random.default_rng(0)
    server = ServerThread(Settings(data_dir=Path(tempfile.mkdtemp()), port=free_port(), base_model="tiny",
                                   sampler_enabled=False, max_lora_rank=16))
    try:
        key = server.new_tenant("bench")
        runs = {}
        with loraplex.ServiceClient(base_url=server.base_url, api_key=key) as service:
            for name, batch, loss in (("RL (advantages)", rl_batch, "importance_sampling"),
                                      ("SFT (weights)", sft_batch, "cross_entropy")):
                training = service.create_lora_training_client("tiny", rank=4, seed=1)
                for _ in range(steps):
                    training.forward_backward(batch(rng, groups, size, prompt, tail), loss).result()
                    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
                runs[name] = training.model_id
        lines = [f"Command: `.venv/bin/python -m benchmarks.rl_groups_read --steps {steps}` ({steps} steps of "
                 f"{groups} x {size} datums of {prompt} + {tail} tokens; median of 5 reads)", "",
                 "| run | read | steps | groups | ms |", "|---|---|---|---|---|"]
        with httpx.Client(base_url=f"{server.base_url}/dashboard/api", headers={"X-API-Key": key}, timeout=300) as http:
            for name, run in runs.items():
                for label, since in (("whole run (first load)", -1), ("last 2 steps (poll)", steps - 2)):
                    times = []
                    for _ in range(5):
                        start = time.perf_counter()
                        answer = http.get(f"/runs/{run}/rl_groups", params={"since": since}).json()
                        times.append((time.perf_counter() - start) * 1000)
                    found = answer["steps"]
                    lines.append(f"| {name} | {label} | {len(found)} | {sum(len(s['groups']) for s in found)} | "
                                 f"{statistics.median(times):.1f} |")
    finally:
        server.stop()
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    typer.run(main)
