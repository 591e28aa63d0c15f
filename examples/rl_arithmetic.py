"""GRPO-style RL: the model learns to add small numbers, rewarded by a verifier.

    .venv/bin/python -m examples.rl_arithmetic --base-model SmolLM2-135M-Instruct --steps 20 [--async-mode]
    (server and key from LORAPLEX_BASE_URL / LORAPLEX_API_KEY, or --base-url / --api-key)

Each step:
1. sample `group_size` completions for each of `prompts_per_step` problems from the current
   adapter snapshot;
2. score each with the verifier (1 if the last number in the answer is the sum, else 0);
3. group-relative advantages: reward minus the group's mean (groups where all agree carry no
   signal and are left out);
4. datums token for token from what was sampled (prompt + sampled tokens, the sampler's logprobs
   as the behaviour policy; nothing is re-tokenized);
5. forward_backward with `importance_sampling` (or `ppo`), optim_step, a new snapshot.

Asynchronous mode: the samples of step k+1 are requested from the newest snapshot before step k
trains, so sampling overlaps training; every trajectory's policy version (carried in its sequence
id) is checked against the bound `max_staleness`, and the importance ratio corrects for it.
Logged per step: reward, held-out accuracy (greedy, every few steps), entropy (estimated as the
mean -logprob of the sampled tokens), the sampler-trainer logprob gap on those tokens, the
staleness, and the time spent waiting for samples vs training.
"""

from __future__ import annotations

import json
import random
import re
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import typer

import loraplex
from examples.common import RESULTS, RunLog, chat_prompt, end_of_answer, plot
from loraplex import types


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b

    @property
    def question(self) -> str:
        return f"What is {self.a} + {self.b}? Answer with the number only."


def problem_sets(seed: int, low: int, high: int, held_out: int) -> tuple[list[Problem], list[Problem]]:
    """(train, held out): every pair in [low, high]^2, a fixed share of them never trained on."""
    everything = [Problem(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    random.Random(seed).shuffle(everything)
    return everything[held_out:], everything[:held_out]


def reward(tokenizer, tokens: list[int], problem: Problem) -> float:
    numbers = re.findall(r"-?\d+", tokenizer.decode(tokens, skip_special_tokens=True))
    return float(bool(numbers) and int(numbers[-1]) == problem.answer)


def rl_datum(prompt: list[int], sequence: types.SampledSequence, advantage: float) -> types.Datum:
    """Prompt + sampled tokens; position i predicts token i + 1, so the prompt's positions but
    the last carry no logprob and no advantage."""
    tokens = prompt + list(sequence.tokens)
    pad = [0.0] * (len(prompt) - 1)
    return types.Datum(types.ModelInput.from_ints(tokens[:-1]), {
        "target_tokens": tokens[1:],
        "logprobs": pad + list(sequence.logprobs),
        "advantages": pad + [advantage] * len(sequence.tokens),
    })


class Run:
    def __init__(self, service: loraplex.ServiceClient, base_model: str, *, rank: int, seed: int, max_tokens: int,
                 temperature: float, group_size: int) -> None:
        self.training = service.create_lora_training_client(base_model, rank=rank, seed=seed)
        self.tokenizer = self.training.get_tokenizer()
        self.stop = [end_of_answer(self.tokenizer)]
        self.params = types.SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=self.stop)
        self.group_size = group_size
        self.sampler = self.training.save_weights_and_get_sampling_client()
        self.steps_applied = 0  # optimizer steps so far: the policy version of the newest snapshot

    def prompt(self, problem: Problem) -> list[int]:
        return chat_prompt(self.tokenizer, problem.question)

    def request_samples(self, problems: list[Problem], rng: random.Random) -> list:
        """Sample futures for every problem from the newest snapshot (answered while we go on), each
        request seeded from `rng`: a run with the same seed samples the same groups."""
        return [(p, self.prompt(p), self.sampler.sample(types.ModelInput.from_ints(self.prompt(p)), self.group_size,
                                                        replace(self.params, seed=rng.randrange(2**31))))
                for p in problems]

    def accuracy(self, problems: list[Problem]) -> float:
        greedy = types.SamplingParams(max_tokens=self.params.max_tokens, temperature=0.0, stop=self.stop)
        futures = [self.sampler.sample(types.ModelInput.from_ints(self.prompt(p)), 1, greedy) for p in problems]
        return statistics.mean(reward(self.tokenizer, f.result().sequences[0].tokens, p)
                               for p, f in zip(problems, futures))


def run(service: loraplex.ServiceClient, base_model: str, *, steps: int = 20, prompts_per_step: int = 8,
        group_size: int = 8, learning_rate: float = 2e-4, rank: int = 16, seed: int = 0,
        loss_fn: str = "importance_sampling", max_tokens: int = 16, temperature: float = 1.0,
        async_mode: bool = False, max_staleness: int = 1, eval_every: int = 5, held_out: int = 64,
        low: int = 1, high: int = 20, name: str = "rl", results: Path = RESULTS) -> dict:
    start = time.monotonic()
    rl = Run(service, base_model, rank=rank, seed=seed, max_tokens=max_tokens, temperature=temperature,
             group_size=group_size)
    train_problems, held_out_problems = problem_sets(seed, low, high, held_out)
    rng = random.Random(seed)
    log = RunLog(name, results, training=rl.training)
    first = rl.accuracy(held_out_problems)
    log.log(step=0, held_out_accuracy=first)

    pending = rl.request_samples(rng.sample(train_problems, prompts_per_step), rng)
    for step in range(1, steps + 1):
        waited = time.monotonic()
        groups = [(problem, prompt, future.result().sequences) for problem, prompt, future in pending]
        waited = time.monotonic() - waited
        staleness = max(rl.steps_applied - s.policy_version for _, _, group in groups for s in group)
        assert staleness <= max_staleness, f"a trajectory is {staleness} steps stale (bound {max_staleness})"
        if async_mode:  # the next step's samples come while this one trains
            pending = rl.request_samples(rng.sample(train_problems, prompts_per_step), rng)

        trained = time.monotonic()
        rewards, data, sampled_logprobs, offsets = [], [], [], []
        for problem, prompt, group in groups:
            scores = [reward(rl.tokenizer, s.tokens, problem) for s in group]
            rewards += scores
            baseline = statistics.mean(scores)
            for sequence, score in zip(group, scores):
                sampled_logprobs.append(sequence.logprobs)
                if score != baseline:  # a group where all agree has no advantage anywhere
                    data.append(rl_datum(prompt, sequence, score - baseline))
                    offsets.append((len(prompt) - 1, sequence.logprobs))
        gap = None
        if data:
            output = rl.training.forward_backward(data, loss_fn).result()
            rl.training.optim_step(types.AdamParams(learning_rate=learning_rate)).result()
            rl.steps_applied += 1
            rl.sampler = rl.training.save_weights_and_get_sampling_client()
            gap = float(np.mean(np.concatenate([
                np.abs(np.asarray(out["logprobs"])[first_position:] - np.asarray(logprobs))
                for out, (first_position, logprobs) in zip(output.loss_fn_outputs, offsets)])))
        trained = time.monotonic() - trained
        if not async_mode:
            pending = rl.request_samples(rng.sample(train_problems, prompts_per_step), rng)

        row = {"step": step, "reward": statistics.mean(rewards), "datums": len(data),
               "entropy": -float(np.mean(np.concatenate([np.asarray(lp) for lp in sampled_logprobs]))),
               "logprob_gap": gap, "staleness": staleness, "wait_seconds": waited, "train_seconds": trained}
        if step % eval_every == 0 or step == steps:
            row["held_out_accuracy"] = rl.accuracy(held_out_problems)
        log.log(**row)

    plot(log, ["reward", "held_out_accuracy", "entropy", "logprob_gap"])
    return {"name": name, "kind": "rl", "held_out_accuracy_start": first,
            "held_out_accuracy_end": log.rows[-1]["held_out_accuracy"], "seconds": time.monotonic() - start}


def main(base_model: str = "SmolLM2-135M-Instruct", steps: int = 20, prompts_per_step: int = 8, group_size: int = 8,
         learning_rate: float = 2e-4, rank: int = 16, seed: int = 0, loss_fn: str = "importance_sampling",
         async_mode: bool = False, base_url: str = typer.Option(None), api_key: str = typer.Option(None)) -> None:
    summary = run(loraplex.ServiceClient(base_url=base_url, api_key=api_key), base_model, steps=steps,
                  prompts_per_step=prompts_per_step, group_size=group_size, learning_rate=learning_rate, rank=rank,
                  seed=seed, loss_fn=loss_fn, async_mode=async_mode)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    typer.run(main)
