"""Dimuon against AdamW on SFT: held-out loss per step, both optimizers trained in one run.

Every adapter (same rank, same seed, so the same start) trains on the same batches of
examples/data/sft_pairs.jsonl in one engine: each step is one batched forward_backward over all of
them and one optim_step call, so they share the machine's state and the table compares like with
like. The held-out pairs (every 10th) are scored as mean loss per answer token every
`eval_every` steps. Every run's learning rate decays linearly to zero over the run, as in
tinker-cookbook's SFT (the caller supplies schedules, for Dimuon as for AdamW). Dimuon's step is a
direction of Frobenius norm sqrt(rank) per matrix, so its rates are not AdamW's (docs/optimizers.md).

    .venv/bin/python benchmarks/optimizer_sft.py [--model SmolLM2-135M-Instruct] [--steps 16] [--batch-size 4]
        [--no-write]

Results go to benchmarks/results/optimizer_sft.md.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace
from pathlib import Path

import torch
import typer
from loraplex.types import AdamParams, DimuonParams
from transformers import AutoTokenizer

from contract.configs import LoraConfig
from contract.inputs import EngineDatum, ForwardBackwardInput
from examples.common import chat_prompt, end_of_answer
from examples.sft import load_pairs
from workers.trainer.engine import TrainerEngine

RESULTS = Path(__file__).parent / "results" / "optimizer_sft.md"
RANK = 16
RUNS = {  # name -> (optimizer, params at step 1). AdamW at 1e-3, the best of 3e-4, 1e-3 and 3e-3 in a run at
    # constant rates; Dimuon at 0.03, whose per-element step at rank 16 (0.03 * 1.13 * 4 / sqrt(16 * 576)
    # = 1.4e-3) is about AdamW 1e-3's, and at a third of that
    "adamw 1e-3": ("adamw", AdamParams(learning_rate=1e-3)),
    "dimuon 0.01": ("dimuon", DimuonParams(learning_rate=0.01)),
    "dimuon 0.03": ("dimuon", DimuonParams(learning_rate=0.03)),
}


def sft_datum(tokenizer, pair: dict) -> EngineDatum:
    """The chat prompt (weight 0), then the answer and the end-of-turn token (weight 1)."""
    prompt = chat_prompt(tokenizer, pair["instruction"])
    answer = tokenizer.encode(pair["answer"], add_special_tokens=False) + [end_of_answer(tokenizer)]
    tokens = torch.tensor(prompt + answer)
    weights = torch.tensor([0.0] * (len(prompt) - 1) + [1.0] * len(answer))
    return EngineDatum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights})


def held_out_losses(engine: TrainerEngine, data: list[EngineDatum]) -> dict[str, float]:
    """Mean loss per answer token of each run (one batched forward over all of them)."""
    outputs = engine.forward([ForwardBackwardInput(name, data) for name in RUNS])
    tokens = sum(float(d.loss_fn_inputs["weights"].sum()) for d in data)
    return {name: out.metrics["loss:sum"] / tokens for name, out in zip(RUNS, outputs)}


def run(model: str, steps: int, batch_size: int, eval_every: int, seed: int) -> tuple[list[dict], float]:
    engine = TrainerEngine(model)
    tokenizer = AutoTokenizer.from_pretrained(engine.model_path)
    for name, (optimizer, _) in RUNS.items():
        engine.create_adapter(name, LoraConfig(rank=RANK, seed=seed), optimizer)
    train, held_out = load_pairs()
    held_out_data = [sft_datum(tokenizer, p) for p in held_out]
    rng = random.Random(seed)
    rows = [{"step": 0, **held_out_losses(engine, held_out_data)}]
    started = time.perf_counter()
    for step in range(1, steps + 1):
        batch = [sft_datum(tokenizer, p) for p in rng.sample(train, batch_size)]
        engine.forward_backward([ForwardBackwardInput(name, batch, "cross_entropy") for name in RUNS])
        decay = 1 - (step - 1) / steps  # the linear decay to zero that tinker-cookbook's SFT uses by default
        steps_now = [(name, replace(params, learning_rate=params.learning_rate * decay))
                     for name, (_, params) in RUNS.items()]
        for result in engine.optim_step(steps_now):
            assert isinstance(result, dict), result
        if step % eval_every == 0 or step == steps:
            rows.append({"step": step, **held_out_losses(engine, held_out_data)})
            print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()),
                  flush=True)
    return rows, time.perf_counter() - started


def table(rows: list[dict]) -> str:
    lines = ["| step | " + " | ".join(RUNS) + " |", "|---" * (len(RUNS) + 1) + "|"]
    for row in rows:
        lines.append(f"| {row['step']} | " + " | ".join(f"{row[name]:.3f}" for name in RUNS) + " |")
    return "\n".join(lines)


def main(model: str = "SmolLM2-135M-Instruct", steps: int = 16, batch_size: int = 4, eval_every: int = 4,
         seed: int = 0, write: bool = True) -> None:
    torch.manual_seed(seed)
    rows, seconds = run(model, steps, batch_size, eval_every, seed)
    best = {family: min((name for name in RUNS if name.startswith(family)), key=lambda n: rows[-1][n])
            for family in ("adamw", "dimuon")}
    report = "\n\n".join([
        f"Held-out loss per answer token (examples/data/sft_pairs.jsonl, every 10th pair), {model}, LoRA rank "
        f"{RANK} on all linear layers, batch {batch_size}, seed {seed}; all runs trained together in one engine "
        f"({seconds:.0f} s for {steps} steps of all {len(RUNS)}); learning rates decay linearly to zero over the "
        "run. Dimuon's other parameters at their defaults.",
        f"Command: `.venv/bin/python benchmarks/optimizer_sft.py --model {model} --steps {steps} --batch-size "
        f"{batch_size}`",
        table(rows),
        f"Best of each at step {steps}: {best['adamw']} {rows[-1][best['adamw']]:.3f}, "
        f"{best['dimuon']} {rows[-1][best['dimuon']]:.3f}.",
    ])
    print(report)
    if write:
        RESULTS.write_text(report + "\n")


if __name__ == "__main__":
    typer.run(main)
