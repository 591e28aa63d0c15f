"""What computing an RL group's prompt once buys: one GRPO training step with and without shared rows.

A step = one tenant's forward_backward (importance_sampling) over G prompts x n completions, then
optim_step. The same engine and adapter run it twice per repetition, interleaved:
    plain    every datum's prompt computed again (min_shared_prefix=0)
    shared   each group's prompt computed once, its completions attend to it (the default)
Workloads (prompt tokens + completion tokens of 1..max each):
    rl       8 prompts x 8, 39 + up to 16: the shape of examples/rl_arithmetic.py on SmolLM2
    long     4 prompts x 8, 128 + up to 32

    .venv/bin/python benchmarks/trainer_shared_prefix.py [--models tiny,SmolLM2-135M-Instruct] [--reps 5]
        [--no-write]

Results go to benchmarks/results/trainer_shared_prefix.md; only the ratios are meaningful.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import transformers
import typer
from loraplex.types import AdamParams

from contract.configs import LoraConfig
from contract.inputs import EngineDatum, ForwardBackwardInput
from workers.trainer.batch import pack, prepare_request, split_into_passes
from workers.trainer.engine import TrainerEngine
from workers.trainer.shared_prefix import MIN_SHARED_TOKENS

RANK = 16
WORKLOADS = {"rl": (8, 8, 39, 16), "long": (4, 8, 128, 32)}  # prompts, group size, prompt len, max completion
RESULTS = Path(__file__).parent / "results" / "trainer_shared_prefix.md"


def grpo_data(prompts: int, group: int, prompt_len: int, max_completion: int, vocab: int) -> list[EngineDatum]:
    gen = torch.Generator().manual_seed(0)
    data = []
    for _ in range(prompts):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen)
        for _ in range(group):
            n = int(torch.randint(1, max_completion + 1, (1,), generator=gen))
            sequence = torch.cat([prompt, torch.randint(0, vocab, (n,), generator=gen)])
            positions = sequence.numel() - 1
            data.append(EngineDatum(sequence[:-1], {
                "target_tokens": sequence[1:],
                "logprobs": torch.full((positions,), -3.0),
                "advantages": torch.cat([torch.zeros(prompt_len - 1), torch.randn(n, generator=gen)]),
            }))
    return data


def packed_rows(engine: TrainerEngine, request: ForwardBackwardInput, min_shared: int) -> tuple[int, int]:
    """(rows computed, passes) for `request` at this setting."""
    prepared = [prepare_request(0, request, engine.vocab_size, engine.max_seq_len)]
    passes = split_into_passes(prepared, engine.max_pass_tokens, min_shared)
    return sum(pack(p, min_shared).input_ids.numel() for p in passes), len(passes)


def measure(model: str, workloads: list[str], reps: int) -> list[dict]:
    engine = TrainerEngine(model)
    engine.create_adapter("t", LoraConfig(rank=RANK, alpha=32, seed=0))
    settings = {"plain": 0, "shared": MIN_SHARED_TOKENS}
    rows = []
    for workload in workloads:
        request = ForwardBackwardInput("t", grpo_data(*WORKLOADS[workload], engine.vocab_size), "importance_sampling")
        times = {k: [] for k in settings}
        for rep in range(reps + 1):  # the first repetition warms up and is discarded
            for key, min_shared in settings.items():
                engine.min_shared_prefix = min_shared
                started = time.perf_counter()
                engine.forward_backward([request])
                engine.optim_step([("t", AdamParams(learning_rate=1e-5))])
                if rep:
                    times[key].append(time.perf_counter() - started)
        t = {k: statistics.median(v) for k, v in times.items()}
        shape = {k: packed_rows(engine, request, m) for k, m in settings.items()}
        row = {"model": model, "workload": workload, "datums": len(request.data),
               "positions": sum(d.tokens.numel() for d in request.data),
               **{f"{k}_ms": 1000 * v for k, v in t.items()}, **{f"{k}_rows": shape[k][0] for k in settings},
               **{f"{k}_passes": shape[k][1] for k in settings}, "speedup": t["plain"] / t["shared"]}
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


HEADER = ("| model | workload | datums | rows plain / shared | passes plain / shared | plain ms | shared ms | plain / shared |\n"
          "|---|---|---|---|---|---|---|---|")


def format_row(r: dict) -> str:
    return (f"| {r['model']} | {r['workload']} | {r['datums']} | {r['plain_rows']} / {r['shared_rows']} | "
            f"{r['plain_passes']} / {r['shared_passes']} | {r['plain_ms']:.0f} | {r['shared_ms']:.0f} | "
            f"**{r['speedup']:.2f}x** |")


def main(models: str = "tiny,SmolLM2-135M-Instruct", workloads: str = "rl,long", reps: int = 5,
         write: bool = True) -> None:
    transformers.utils.logging.disable_progress_bar()
    print(HEADER)
    rows = []
    for model in models.split(","):
        rows += measure(model, workloads.split(","), reps)
    if write:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(
            f"Command: `.venv/bin/python benchmarks/trainer_shared_prefix.py --models {models} --workloads {workloads} "
            f"--reps {reps}`\n\nTorch threads: {torch.get_num_threads()}, LoRA rank {RANK} on all linear layers and "
            f"lm_head, one forward_backward (importance_sampling) + optim_step per step, median of {reps} "
            f"interleaved repetitions.\n\n" + "\n".join([HEADER] + [format_row(r) for r in rows]) + "\n"
        )
        print(f"written to {RESULTS}")


if __name__ == "__main__":
    typer.run(main)
