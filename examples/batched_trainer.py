"""Several tenants fine-tune their own adapters together, every round in ONE batched engine call.

    python -m examples.batched_trainer [--model tiny] [--rounds 30] [--out data/demo]

Each tenant teaches its adapter a different kind of line (arithmetic, chat, prose); every
round all tenants' forward_backward requests go into one engine call, then one optim_step
call updates every adapter with its own hyperparameters. Losses per tenant are printed as
they fall, and each adapter is saved as a PEFT folder at the end.
"""

from __future__ import annotations

import time
from pathlib import Path

import transformers
import typer
from transformers import AutoTokenizer

from contract.configs import LoraConfig
from loraplex.types import AdamParams
from models.tiny import tiny_corpus
from workers.trainer.engine import TrainerEngine
from contract.inputs import EngineDatum, ForwardBackwardInput

TENANTS = {
    # tenant: (LoRA config, learning rate, which corpus lines it trains on)
    "alice": (LoraConfig(rank=8, seed=1), 2e-3, "arithmetic"),
    "bob": (LoraConfig(rank=4, seed=2, train_mlp=False), 3e-3, "chat"),
    "carol": (LoraConfig(rank=16, seed=3, train_unembed=False), 5e-3, "prose"),
}


def kind_of(line: str) -> str:
    return "arithmetic" if line.startswith("What is") else "chat" if line.startswith("<|im_start|>") else "prose"


def sft_datum(tokenizer, text: str) -> EngineDatum:
    ids = tokenizer(text)["input_ids"]
    return EngineDatum(ids[:-1], {"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


def main(model: str = "tiny", rounds: int = 30, batch: int = 4, out: Path = Path("data/demo")) -> None:
    transformers.utils.logging.disable_progress_bar()
    engine = TrainerEngine(model)
    tokenizer = AutoTokenizer.from_pretrained(engine.model_path)
    corpus = tiny_corpus()
    data = {}
    for tenant, (config, _, kind) in TENANTS.items():
        engine.create_adapter(tenant, config)
        data[tenant] = [sft_datum(tokenizer, line) for line in corpus if kind_of(line) == kind][:200]
    print(f"base model {model} ({engine.model_path}); tenants: {', '.join(TENANTS)}")

    for step in range(rounds):
        started = time.perf_counter()
        requests = [
            ForwardBackwardInput(t, [data[t][(step * batch + i) % len(data[t])] for i in range(batch)])
            for t in TENANTS
        ]
        results = engine.forward_backward(requests)  # one batched pass over all tenants
        engine.optim_step([(t, AdamParams(learning_rate=lr)) for t, (_, lr, _) in TENANTS.items()])
        if step % 5 == 0 or step == rounds - 1:
            tokens = {t: sum(len(d.tokens) for d in r.data) for t, r in zip(TENANTS, requests)}
            losses = "  ".join(
                f"{t}: {r.metrics['loss:sum'] / tokens[t]:.3f}/token" for t, r in zip(TENANTS, results)
            )
            print(f"round {step:3d}  {losses}  ({time.perf_counter() - started:.2f} s)")

    for tenant in TENANTS:
        path = engine.save_sampler_weights(tenant, out / tenant)
        print(f"saved {tenant}'s adapter (PEFT format) to {path}")


if __name__ == "__main__":
    typer.run(main)
