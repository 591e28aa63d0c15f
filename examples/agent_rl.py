"""RL on an agent with zero changes to it: a calculator agent written only against the `openai` SDK,
pointed at a policy alias, trained with GRPO from what the server's rollout store recorded.

    .venv/bin/python -m examples.agent_rl --base-model SmolLM2-135M-Instruct --steps 12
    .venv/bin/python -m examples.agent_rl --base-model loraplex/tiny-qwen3 --protocol tools --steps 2
    (server and key from LORAPLEX_BASE_URL / LORAPLEX_API_KEY, or --base-url / --api-key)

The agent (`CalculatorAgent`) knows nothing of Loraplex: it gets an `openai.OpenAI` client and a model
name, and solves an arithmetic word problem in up to `max_turns` chat.completions calls. It may use a
calculator (a tool call or a `CALC: <expression>` reply, below); it evaluates the expression, sends the
result back as the next message and asks again; an answer without a call is its final one (the number
after `ANSWER:`, else its last number). A worked example sits in the chat before the question. The
only thing it passes per episode is OpenAI's own `user` field, which the server reads as the trajectory
id (any harness that tags its users works the same way).

Two ways to reach the calculator (`--protocol`, `auto` by default):
- `tools`: OpenAI tool calls (`tools=[calculate]`). The server renders them with the base model's chat
  template and parses Hermes-style <tool_call> output (docs/inference-proxy.md), so this needs a model
  whose template renders tools (`loraplex/tiny-qwen3`, Qwen3). The first turn's call is forced
  (`tool_choice` naming the tool, held by the sampler's grammar, the expression's characters limited
  to arithmetic by its JSON schema): RL then learns what to compute, not the call format; middle
  turns choose freely, and the last may not call.
- `text`: the reply `CALC: <expression>`, taught by the system prompt and a worked example. For models
  whose template renders no tools (`tiny`, SmolLM2-135M-Instruct): the server refuses `tools` for them
  with a 400 naming the field, which is how `auto` tells the two apart.

Each GRPO step:
1. `group_size` episodes of each of `prompts_per_step` problems, concurrently, all through the policy
   alias `tinker://<run>/sampler_weights/@latest` (so the sampler batches them);
2. each trajectory's reward (1 for the right answer, plus `tool_bonus` when it gave the calculator an
   expression worth the answer) attached in the store (`RolloutsClient.set_reward`);
3. advantages: reward minus its group's mean (groups that all agree carry no signal and are skipped);
   the datums come from the store (`RolloutsClient.datums`: the exact sampled tokens and the sampler's
   logprobs, one datum per trajectory when its turns extend each other, else one per turn);
4. forward_backward (`importance_sampling`), optim_step, then save_weights_for_sampler: the alias now
   names the new weights, and the agent's next calls use them without being told.
Held-out success (greedy) is measured before training and every `eval_every` steps; the policy version
every trajectory was sampled with is read back from the store and must be the newest.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import openai
import typer

import loraplex
from examples.common import RESULTS, RunLog, plot
from loraplex import types

# --- the agent: only the `openai` SDK ---------------------------------------------------------------

SYSTEM = ("You solve arithmetic word problems with a calculator. To use it, reply with only CALC: followed by "
          "the expression. Once you know the result, reply with ANSWER: followed by the number.")
# One worked example, as earlier turns of the chat: the format is shown, not only described.
EXAMPLE = [{"role": "user", "content": "Ann has 3 bags with 4 apples in each. How many apples does she have?"},
           {"role": "assistant", "content": "CALC: 3 * 4"},
           {"role": "user", "content": "Calculator: 12"},
           {"role": "assistant", "content": "ANSWER: 12"}]
CALL = re.compile(r"CALC:\s*([0-9+\-*/(). ]+)")
ANSWER = re.compile(r"ANSWER:\s*(-?\d+(?:\.\d+)?)")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.USub: operator.neg}


def calculate(expression: str) -> float:
    """+ - * / and parentheses on numbers, nothing else (never `eval`). Raises ValueError."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")
    try:
        return value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ZeroDivisionError) as e:
        raise ValueError(str(e)) from None


def final_answer(reply: str) -> float | None:
    """The number after the reply's last "ANSWER:", else its last number."""
    numbers = [m[1] for m in ANSWER.finditer(reply)] or re.findall(r"-?\d+(?:\.\d+)?", reply)
    return float(numbers[-1]) if numbers else None


@dataclass(frozen=True)
class Episode:
    final: str  # the last reply
    answer: float | None  # its number after "ANSWER:", else its last number; None: there was none
    results: tuple[float, ...]  # what the calculator answered, call by call
    turns: int


class CalculatorAgent:
    def __init__(self, client: openai.OpenAI, model: str, *, max_turns: int = 3, max_tokens: int = 32,
                 temperature: float = 1.0) -> None:
        self.client, self.model = client, model
        self.max_turns, self.max_tokens, self.temperature = max_turns, max_tokens, temperature

    def solve(self, question: str, user: str) -> Episode:
        """One episode with the calculator reached by `CALC:` replies."""
        messages = [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": question}]
        results: list[float] = []
        for turn in range(1, self.max_turns + 1):
            reply = self.client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=self.max_tokens, temperature=self.temperature,
                user=user).choices[0].message.content or ""
            messages.append({"role": "assistant", "content": reply})
            call = CALL.search(reply)
            if call is None or turn == self.max_turns:
                return Episode(reply, final_answer(reply), tuple(results), turn)
            try:
                results.append(calculate(call[1]))
                answer = f"Calculator: {results[-1]:g}"
            except ValueError as e:
                answer = f"Calculator error: {e}"
            messages.append({"role": "user", "content": answer})
        raise AssertionError("unreachable")


TOOLS_SYSTEM = ("You solve arithmetic word problems. Use the calculate tool to compute, then reply with ANSWER: "
                "followed by the number.")
CALCULATE = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression: numbers, + - * / and parentheses.",
    "parameters": {"type": "object", "required": ["expression"], "properties": {
        "expression": {"type": "string", "pattern": "^[0-9+*/(). -]{1,40}$"}}}}}
FORCED = {"type": "function", "function": {"name": "calculate"}}
TOOLS_EXAMPLE = [
    {"role": "user", "content": EXAMPLE[0]["content"]},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": {
        "name": "calculate", "arguments": json.dumps({"expression": "3 * 4"})}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "12"},
    {"role": "assistant", "content": "ANSWER: 12"}]


class ToolCallingAgent(CalculatorAgent):
    """The same agent with the calculator as an OpenAI tool: the first turn must call it, later turns may."""

    def solve(self, question: str, user: str) -> Episode:
        messages = [{"role": "system", "content": TOOLS_SYSTEM}, *TOOLS_EXAMPLE, {"role": "user", "content": question}]
        results: list[float] = []
        for turn in range(1, self.max_turns + 1):
            last = turn == self.max_turns
            choice = FORCED if turn == 1 else "none" if last else "auto"
            message = self.client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=self.max_tokens, temperature=self.temperature,
                user=user, tools=[CALCULATE], tool_choice=choice).choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls or last:
                reply = message.content or ""
                return Episode(reply, final_answer(reply), tuple(results), turn)
            for call in message.tool_calls:
                try:
                    results.append(calculate(json.loads(call.function.arguments)["expression"]))
                    answer = f"{results[-1]:g}"
                except (ValueError, KeyError, TypeError) as e:  # (JSONDecodeError is a ValueError)
                    answer = f"error: {e}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
        raise AssertionError("unreachable")


PROTOCOLS = {"tools": ToolCallingAgent, "text": CalculatorAgent}


def accepts_tools(client: openai.OpenAI, model: str, user: str) -> bool:
    """Whether the server takes `tools` for this model: it answers a 400 naming `tools` where the model's
    chat template renders none. (An accepted probe is one short call, recorded under `user`.)"""
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "2 + 2?"}], max_tokens=1,
                                       tools=[CALCULATE], user=user)
    except openai.BadRequestError as e:
        if "tools" in str(e):
            return False
        raise
    return True


# --- the task ----------------------------------------------------------------------------------------

TEMPLATES = (
    ("{a} boxes hold {b} pens each. How many pens are there?", operator.mul),
    ("Tom has {a} apples and buys {b} more. How many apples does he have?", operator.add),
    ("A shelf has {a} books and {b} are taken away. How many books are left?", operator.sub),
    ("Each of {a} children gets {b} stickers. How many stickers is that?", operator.mul),
)


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int


def problem_sets(seed: int, held_out: int, low: int = 3, high: int = 19) -> tuple[list[Problem], list[Problem]]:
    """(train, held out): every template with every a > b in [low, high], a fixed share never trained on."""
    everything = [Problem(text.format(a=a, b=b), op(a, b)) for text, op in TEMPLATES
                  for a in range(low, high + 1) for b in range(low, a)]
    random.Random(seed).shuffle(everything)
    return everything[held_out:], everything[:held_out]


def success(problem: Problem, episode: Episode) -> bool:
    return episode.answer is not None and abs(episode.answer - problem.answer) < 1e-6


def right_call(problem: Problem, episode: Episode) -> bool:
    """The agent gave the calculator an expression whose value is the answer."""
    return any(abs(result - problem.answer) < 1e-6 for result in episode.results)


def score(problem: Problem, episode: Episode, tool_bonus: float) -> float:
    """1 for the right final answer; `tool_bonus` more for a right calculator call (the skill the
    calculator cannot do for the model: turning the words into the expression). A call alone earns
    nothing: an earlier version paid for any well-formed call, and the model learned to call without
    getting answers right."""
    return float(success(problem, episode)) + (tool_bonus if right_call(problem, episode) else 0.0)


# --- the trainer: Loraplex's SDK and rollout store ----------------------------------------------------


class Run:
    def __init__(self, service: loraplex.ServiceClient, base_model: str, *, rank: int, seed: int,
                 max_turns: int, max_tokens: int, temperature: float, workers: int, protocol: str = "auto") -> None:
        self.training = service.create_lora_training_client(base_model, rank=rank, seed=seed)
        self.store = loraplex.RolloutsClient(service)
        self.version = 0  # optimizer steps behind the alias's newest weights
        self.training.save_weights_for_sampler("step-0").result()
        self.alias = f"tinker://{self.training.model_id}/sampler_weights/@latest"
        client = openai.OpenAI(base_url=f"{service.config.base_url}/oai/api/v1", api_key=service.config.api_key,
                               max_retries=3, timeout=600)
        self.tag = uuid.uuid4().hex[:8]  # trajectory ids of this run
        if protocol == "auto":
            probe = f"{self.tag}-probe"
            protocol = "tools" if accepts_tools(client, self.alias, probe) else "text"
            if protocol == "tools":
                self.store.delete_trajectory(probe)  # not an episode
        self.protocol = protocol
        agent = PROTOCOLS[protocol]
        self.explore = agent(client, self.alias, max_turns=max_turns, max_tokens=max_tokens, temperature=temperature)
        self.greedy = agent(client, self.alias, max_turns=max_turns, max_tokens=max_tokens, temperature=0.0)
        self.pool = ThreadPoolExecutor(workers)

    def episodes(self, agent: CalculatorAgent, problems: list[Problem], prefix: str) -> list[tuple[str, Episode]]:
        users = [f"{self.tag}-{prefix}-{i}" for i in range(len(problems))]
        return list(zip(users, self.pool.map(lambda pu: agent.solve(pu[0].question, pu[1]), zip(problems, users))))

    def held_out_success(self, problems: list[Problem], label: str) -> float:
        done = self.episodes(self.greedy, problems, f"eval{label}")
        for user, _ in done:  # not trained on: keep the store to what is
            self.store.delete_trajectory(user)
        return statistics.mean(success(p, e) for p, (_, e) in zip(problems, done))

    def stale_turns(self, users: list[str]) -> int:
        """Turns the store says were sampled with other weights than the newest (should be none)."""
        return sum(turn.policy_version != self.version for user in users
                   for turn in self.store.get_trajectory(user).turns)


def run(service: loraplex.ServiceClient, base_model: str, *, steps: int = 12, prompts_per_step: int = 8,
        group_size: int = 6, learning_rate: float = 1e-4, rank: int = 16, seed: int = 0, max_turns: int = 3,
        max_tokens: int = 32, temperature: float = 1.0, tool_bonus: float = 0.5, eval_every: int = 4,
        held_out: int = 48, name: str = "agent_rl", results: Path = RESULTS, protocol: str = "auto") -> dict:
    start = time.monotonic()
    rl = Run(service, base_model, rank=rank, seed=seed, max_turns=max_turns, max_tokens=max_tokens,
             temperature=temperature, workers=max(prompts_per_step * group_size, held_out), protocol=protocol)
    train, evaluation = problem_sets(seed, held_out)
    rng = random.Random(seed)
    log = RunLog(name, results, training=rl.training)
    first = rl.held_out_success(evaluation, "0")
    log.log(step=0, held_out_success=first)

    for step in range(1, steps + 1):
        sampled = time.monotonic()
        problems = [p for p in rng.sample(train, prompts_per_step) for _ in range(group_size)]
        done = rl.episodes(rl.explore, problems, f"s{step}")
        sampled = time.monotonic() - sampled
        users = [user for user, _ in done]
        stale = rl.stale_turns(users)

        trained = time.monotonic()
        rewards = [score(p, e, tool_bonus) for p, (_, e) in zip(problems, done)]
        data, merged = [], 0
        for g in range(prompts_per_step):
            group = range(g * group_size, (g + 1) * group_size)
            baseline = statistics.mean(rewards[i] for i in group)
            for i in group:
                rl.store.set_reward(users[i], rewards[i])
                if rewards[i] != baseline:  # a group that all agrees has no advantage anywhere
                    built = rl.store.datums(users[i], advantage=rewards[i] - baseline)
                    data += built.datums
                    merged += built.per_trajectory
        if data:
            rl.training.forward_backward(data, "importance_sampling").result()
            rl.training.optim_step(types.AdamParams(learning_rate=learning_rate)).result()
            rl.version += 1
            rl.training.save_weights_for_sampler(f"step-{step}").result()  # the alias moves
        trained = time.monotonic() - trained

        row = {"step": step, "reward": statistics.mean(rewards),
               "success": statistics.mean(success(p, e) for p, (_, e) in zip(problems, done)),
               "tool_use": statistics.mean(bool(e.results) for _, e in done),
               "right_calls": statistics.mean(right_call(p, e) for p, (_, e) in zip(problems, done)),
               "turns": statistics.mean(e.turns for _, e in done), "datums": len(data),
               "one_datum_trajectories": merged, "stale_turns": stale, "policy_version": rl.version,
               "sample_seconds": sampled, "train_seconds": trained}
        if step % eval_every == 0 or step == steps:
            row["held_out_success"] = rl.held_out_success(evaluation, str(step))
        log.log(**row)

    plot(log, ["reward", "tool_use", "right_calls", "held_out_success"])
    rl.pool.shutdown()
    return {"name": name, "kind": "agent_rl", "base_model": base_model, "steps": steps,
            "protocol": rl.protocol, "held_out_success_start": first, "held_out_success_end": log.rows[-1]["held_out_success"],
            "policy_alias": rl.alias, "seconds": time.monotonic() - start}


class Protocol(str, Enum):
    auto = "auto"
    tools = "tools"
    text = "text"


def main(base_model: str = "SmolLM2-135M-Instruct", steps: int = 12, prompts_per_step: int = 8, group_size: int = 6,
         learning_rate: float = 1e-4, rank: int = 16, seed: int = 0, max_turns: int = 3, max_tokens: int = 32,
         temperature: float = 1.0, tool_bonus: float = 0.5, eval_every: int = 4, held_out: int = 48,
         protocol: Protocol = Protocol.auto,
         base_url: str = typer.Option(None), api_key: str = typer.Option(None)) -> None:
    summary = run(loraplex.ServiceClient(base_url=base_url, api_key=api_key), base_model, steps=steps,
                  prompts_per_step=prompts_per_step, group_size=group_size, learning_rate=learning_rate, rank=rank,
                  seed=seed, max_turns=max_turns, max_tokens=max_tokens, temperature=temperature, tool_bonus=tool_bonus,
                  eval_every=eval_every, held_out=held_out, protocol=protocol.value)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    typer.run(main)
