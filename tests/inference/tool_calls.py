"""The tool-calling setup the SDK tests share: a Hermes-style chat template (the tiny model's own renders no
tools), the `add` tool in the chat completions shape, and the SFT steps that teach a LoRA to answer
"What is 2 + 3?" with a call to it (the tiny model knows no tool format)."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex import types

from models.tiny import TOOLS_CHAT_TEMPLATE

HERMES_TEMPLATE = TOOLS_CHAT_TEMPLATE  # the tools template loraplex/tiny-qwen3 carries
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
QUESTION = "What is 2 + 3?"
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def sft_steps(training, tokens: list[int], first_trained: int, steps: int, lr: float) -> None:
    weights = [0.0] * (first_trained - 1) + [1.0] * (len(tokens) - first_trained)
    datum = types.Datum(types.ModelInput.from_ints(tokens[:-1]), {"target_tokens": tokens[1:], "weights": weights})
    for _ in range(steps):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=lr)).result()


@dataclass(frozen=True)
class ToolLora:
    """A LoRA trained to answer QUESTION, rendered with TOOLS by HERMES_TEMPLATE, with CALL then the end token."""

    api_key: str  # its tenant's: a tenant of the package's own, apart from every module's `api_key`
    model: str  # its `@latest` sampler path
    prompt: list[int]  # QUESTION with TOOLS, rendered by HERMES_TEMPLATE
    call: list[int]  # CALL's tokens (without the end token)
