"""Supervised fine-tuning of a LoRA on the instruction/answer pairs in data/sft_pairs.jsonl.

    .venv/bin/python -m examples.sft --base-model SmolLM2-135M-Instruct --steps 30
    (server and key from LORAPLEX_BASE_URL / LORAPLEX_API_KEY, or --base-url / --api-key)

Each pair becomes one datum: the chat prompt (weight 0) then the answer and the end-of-turn token
(weight 1). Every step trains on a random batch; the held-out pairs (every 10th) are scored before
training and every few steps, as the mean loss per answer token.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import typer

import loraplex
from examples.common import RESULTS, RunLog, chat_prompt, end_of_answer, plot
from loraplex import types

DATA = Path(__file__).resolve().parent / "data" / "sft_pairs.jsonl"


def load_pairs() -> tuple[list[dict], list[dict]]:
    """(train, held out): every 10th pair is held out."""
    pairs = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    return [p for i, p in enumerate(pairs) if i % 10], [p for i, p in enumerate(pairs) if not i % 10]


def sft_datum(tokenizer, pair: dict) -> types.Datum:
    prompt = chat_prompt(tokenizer, pair["instruction"])
    answer = tokenizer.encode(pair["answer"], add_special_tokens=False) + [end_of_answer(tokenizer)]
    tokens = prompt + answer
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)  # position i predicts tokens[i + 1]
    return types.Datum(types.ModelInput.from_ints(tokens[:-1]), {"target_tokens": tokens[1:], "weights": weights})


def answer_tokens(data: list[types.Datum]) -> float:
    return float(sum(d.arrays()["weights"].sum() for d in data))


def held_out_loss(training, data: list[types.Datum]) -> float:
    """Mean loss per answer token (the loss is a sum over tokens)."""
    return training.forward(data, "cross_entropy").result().metrics["loss:sum"] / answer_tokens(data)


def run(service: loraplex.ServiceClient, base_model: str, *, steps: int = 30, batch_size: int = 16,
        learning_rate: float = 3e-4, rank: int = 16, seed: int = 0, eval_every: int = 5, name: str = "sft",
        results: Path = RESULTS) -> dict:
    start = time.monotonic()
    training = service.create_lora_training_client(base_model, rank=rank, seed=seed)
    tokenizer = training.get_tokenizer()
    train, held_out = load_pairs()
    held_out_data = [sft_datum(tokenizer, p) for p in held_out]
    log = RunLog(name, results, training=training)
    first = held_out_loss(training, held_out_data)
    log.log(step=0, held_out_loss=first)

    rng = random.Random(seed)
    for step in range(1, steps + 1):
        batch = [sft_datum(tokenizer, p) for p in rng.sample(train, batch_size)]
        backward = training.forward_backward(batch, "cross_entropy")
        update = training.optim_step(types.AdamParams(learning_rate=learning_rate))  # queued behind it, in order
        row = {"step": step, "train_loss": backward.result().metrics["loss:sum"] / answer_tokens(batch)}
        update.result()
        if step % eval_every == 0 or step == steps:
            row["held_out_loss"] = held_out_loss(training, held_out_data)
        log.log(**row)

    last = log.rows[-1]["held_out_loss"]
    plot(log, ["train_loss", "held_out_loss"])
    return {"name": name, "kind": "sft", "run_id": training.model_id, "held_out_loss_start": first,
            "held_out_loss_end": last, "seconds": time.monotonic() - start}


def main(base_model: str = "SmolLM2-135M-Instruct", steps: int = 30, batch_size: int = 16,
         learning_rate: float = 3e-4, rank: int = 16, seed: int = 0,
         base_url: str = typer.Option(None), api_key: str = typer.Option(None)) -> None:
    summary = run(loraplex.ServiceClient(base_url=base_url, api_key=api_key), base_model, steps=steps,
                  batch_size=batch_size, learning_rate=learning_rate, rank=rank, seed=seed)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    typer.run(main)
