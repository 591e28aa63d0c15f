"""What the dashboard's metric capture costs a training round: forward_backward + optim_step through
the loraplex SDK against an embedded server, with capture on and off, side by side in one run.

    .venv/bin/python -m benchmarks.metric_capture [--rounds 60] [--base-model tiny]   # from the repository root

Capture is switched per round on the server's executor (`InProcessExecutor.capture_metrics`): off,
outcomes carry no metrics, so nothing is computed on the trainer and no row is written with the
outcome; on, both happen (workers/trainer/run_metrics.py, db/run_metrics.py). Rounds alternate in
ABBA order so drift on a shared machine hits both alike. Each round is an RL step: one
importance_sampling request of 8 datums sharing a 64-token prompt, 32 sampled tokens each (the gap
and prefix-overlap code paths run), then an optim_step. Also timed alone: the capture's own
function on that request's engine output, and the trainer's forward_backward cycle alone (an
InProcessExecutor on the benchmark's thread, 2 x `rounds` cycles per setting, its thread's CPU
time). Wall time follows whatever else runs on the machine; the process's CPU time per round
(server threads and client together) less so; one thread's CPU time least.
The table goes to results/metric_capture.md.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import loraplex
import numpy as np
import typer
from loraplex import types

from service.embedded import ServerThread, free_port
from service.settings import Settings

PROMPT, TAIL, GROUP = 64, 32, 8
RESULTS = Path(__file__).resolve().parent / "results" / "metric_capture.md"


def rl_batch(rng: np.random.Generator) -> list[types.Datum]:
    prompt = rng.integers(10, 400, PROMPT).tolist()
    data = []
    for _ in range(GROUP):
        tokens = prompt + rng.integers(10, 400, TAIL).tolist()
        n = len(tokens) - 1
        mask = np.array([0.0] * (PROMPT - 1) + [1.0] * (n - PROMPT + 1), dtype=np.float32)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "logprobs": (mask * -5.0).astype(np.float32), "advantages": mask * rng.normal()}))
    return data


def capture_alone(server: ServerThread, data: list[types.Datum], blocks: int = 10, repeats: int = 50) -> float:
    """Microseconds per call of the capture function on one request's engine output (in-process): the
    fastest of `blocks` blocks, the function's own cost with the least interference from other jobs."""
    from contract.configs import LoraConfig
    from contract.inputs import EngineDatum, ForwardBackwardInput
    from workers.trainer.run_metrics import forward_backward_metrics

    engine = server.embedded.executor.engine
    engine.create_adapter("bench-alone", LoraConfig(rank=8))
    request = ForwardBackwardInput("bench-alone", [EngineDatum(d.model_input.to_ints(), dict(d.arrays()))
                                                   for d in data], "importance_sampling")
    [output] = engine.forward_backward([request])
    best = float("inf")
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(repeats):
            forward_backward_metrics(request, output, 0)
        best = min(best, (time.perf_counter() - start) / repeats * 1e6)
    return best


def executor_cycles(data: list[types.Datum], base_model: str, cycles: int) -> dict[bool, list[float]]:
    """Thread CPU ms of the trainer's forward_backward cycle (an InProcessExecutor on this thread, as the
    embedded server's and each Celery worker's), capture on and off in ABBA order: the trainer's side
    of the cost, without HTTP, the database or other threads."""
    from loraplex.wire.client import encode_forward_backward_request

    from contract.configs import LoraConfig
    from contract.kinds import RequestKind
    from contract.queue import Cycle, Job, QueuedRequest
    from workers.trainer.engine import TrainerEngine
    from workers.trainer.executor import InProcessExecutor

    with tempfile.TemporaryDirectory() as live:
        engine = TrainerEngine(base_model, max_rank=16)
        executor = InProcessExecutor(engine, live)
        engine.create_adapter("bench", LoraConfig(rank=8))
        body = encode_forward_backward_request("bench", 1, [(d.model_input.to_ints(), d.arrays()) for d in data],
                                               "importance_sampling", compress=False)
        request = QueuedRequest("r", "t", "bench", 1, RequestKind.FORWARD_BACKWARD, GROUP * (PROMPT + TAIL - 1))
        times: dict[bool, list[float]] = {True: [], False: []}
        for i in range(4 * cycles + 8):
            executor.capture_metrics = (True, False, False, True)[i % 4]
            start = time.thread_time()
            executor.run_cycle(Cycle(forward_backward=[request]), {"r": Job(request, body)})
            if i >= 8:  # warm-up
                times[executor.capture_metrics].append((time.thread_time() - start) * 1e3)
    return times


def main(rounds: int = typer.Option(60, help="rounds per setting"),
         base_model: str = typer.Option("tiny"), warmup: int = typer.Option(5)) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp), port=free_port(), base_model=base_model, sampler_enabled=False,
                            max_lora_rank=16)
        server = ServerThread(settings)
        try:
            executor = server.embedded.executor
            rng = np.random.default_rng(0)
            data = rl_batch(rng)
            times: dict[bool, list[float]] = {True: [], False: []}
            cpu: dict[bool, list[float]] = {True: [], False: []}  # this process's CPU time: server and client
            with loraplex.ServiceClient(base_url=server.base_url, api_key=server.new_tenant("bench")) as service:
                training = service.create_lora_training_client(base_model, rank=8, seed=1)
                order = [True, False, False, True] * ((rounds + 1) // 2)
                for i, capture in enumerate([True, False] * warmup + order[: 2 * rounds]):
                    executor.capture_metrics = capture
                    start, start_cpu = time.perf_counter(), time.process_time()
                    training.forward_backward(data, "importance_sampling").result()
                    training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
                    if i >= 2 * warmup:
                        times[capture].append((time.perf_counter() - start) * 1e3)
                        cpu[capture].append((time.process_time() - start_cpu) * 1e3)
            alone_us = capture_alone(server, data)
        finally:
            server.stop()
    trainer = executor_cycles(data, base_model, rounds)
    on, off = times[True], times[False]
    rows = [("round ms, median", statistics.median(on), statistics.median(off)),
            ("round ms, mean", statistics.fmean(on), statistics.fmean(off)),
            ("round ms, p90", float(np.percentile(on, 90)), float(np.percentile(off, 90))),
            ("round CPU ms (all threads), median", statistics.median(cpu[True]), statistics.median(cpu[False])),
            ("round CPU ms (all threads), mean", statistics.fmean(cpu[True]), statistics.fmean(cpu[False])),
            ("trainer cycle thread CPU ms, median", statistics.median(trainer[True]), statistics.median(trainer[False])),
            ("trainer cycle thread CPU ms, mean", statistics.fmean(trainer[True]), statistics.fmean(trainer[False]))]
    lines = [f"Command: `.venv/bin/python -m benchmarks.metric_capture --rounds {rounds} --base-model {base_model}` "
             f"({rounds} rounds per setting, ABBA order, {warmup} warm-up pairs left out; a round: forward_backward of "
             f"{GROUP} x {PROMPT + TAIL - 1} tokens, importance_sampling, + optim_step, through the loraplex SDK)", "",
             "| measure | capture on | capture off | on / off |", "|---|---|---|---|"]
    lines += [f"| {name} | {a:.2f} | {b:.2f} | {a / b:.3f}x |" for name, a, b in rows]
    lines += ["", f"The capture function alone on that request's engine output: {alone_us:.0f} us per call, fastest block "
                  f"({alone_us / 1e3 / statistics.median(off) * 100:.2f}% of a median round)."]
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    typer.run(main)
