"""Forced and strict tool calls: a grammar the sampler's vLLM holds the answer to (structured outputs).

The proxy reads tool calls in Hermes' format (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
rendering.py), so a call that must happen is constrained to exactly that text: xgrammar's own structural tag
for the format (its "qwen_3" builder, the Hermes layout), compiled by vLLM's xgrammar backend. The sampled
tokens stay the model's own tool-call format, so what is stored trains like an unforced call.

    tool_choice "required"         at least one call, of any of the tools (text may come before it)
    tool_choice named              exactly one call of that tool, nothing else, then the end token
    "auto" with strict tools       free text; a call, once begun, is one of the tools with valid arguments
    "auto", no parallel calls      the same, and nothing after the first call (Anthropic's
                                   disable_parallel_tool_use)
    "auto" otherwise               no grammar (the answer is sampled as it is)

A tool's arguments follow its JSON schema unless the tool says `strict: false` (then any JSON object);
xgrammar is imported only by calls that need it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from api.inference.errors import InferenceError

FORMAT = "qwen_3"  # xgrammar's builder for Hermes' <tool_call>{"name", "arguments"}</tool_call> layout
# JSON allows any whitespace between its tokens, and a model that knows no tool format (an untrained
# policy, early in RL) fills a forced call's arguments with it until max_tokens cuts the call open. A run
# of whitespace is capped: room for JSON pretty-printed four levels deep, never for a runaway.
MAX_WHITESPACE_RUN = 16


def named_tool(choice: Any, tools: list[dict], field: str = "tool_choice") -> str:
    """The name in a named choice ({"type": "function", "function": {"name"}} or Responses' flat
    {"type": "function", "name"}), checked against the tools (chat-template shape)."""
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise InferenceError(400, f"{field}: \"auto\", \"none\", \"required\" or {{\"type\": \"function\", ...}}")
    name = (choice.get("function") or {}).get("name") if "function" in choice else choice.get("name")
    if not isinstance(name, str):
        raise InferenceError(400, f"{field}: a named choice needs the function's name")
    if name not in [t["function"]["name"] for t in tools]:
        raise InferenceError(400, f"{field}: no tool is named {name[:64]!r}")
    return name


def structural_tag(tools: list[dict] | None, choice: str | dict, *, parallel: bool = True,
                   field: str = "tools") -> str | None:
    """The structural tag (JSON, vLLM's `structured_outputs.structural_tag`) that holds the answer to
    `choice` over `tools` (the chat template's function tools, each maybe with `strict`), or None when
    nothing is constrained. `choice`: "auto", "none", "required", or {"type": "function", "name"}."""
    if choice == "none" or (choice == "auto" and not tools):
        return None
    if not tools:
        raise InferenceError(400, "tool_choice: forcing a tool call needs tools")
    strict = [t["function"].get("strict") is True for t in tools]
    if choice == "auto" and not any(strict) and parallel:
        return None
    import xgrammar  # (vLLM's grammar backend; a few hundred ms the first time)

    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": named_tool(choice, tools)}}
    if choice == "auto":  # only strict tools are held to their schema; the others' arguments are any JSON
        tools = [t if is_strict else {**t, "function": {**t["function"], "strict": False}}
                 for t, is_strict in zip(tools, strict)]
    try:
        tag = xgrammar.get_model_structural_tag(FORMAT, tools=tools, tool_choice=choice, reasoning="disabled",
                                                parallel_tool_calls=parallel)
        text = json.dumps(_capped_whitespace(tag.model_dump(exclude_none=True)), separators=(",", ":"))
        xgrammar.Grammar.from_structural_tag(text)  # a schema xgrammar cannot compile: refused here, by name
    except Exception as e:  # xgrammar's message, without its log prefix ("[time] file.cc:line: ")
        why = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e)).strip()[:200]
        raise InferenceError(400, f"{field}: a tool's parameters are not a JSON schema the sampler's grammar "
                                  f"can hold: {why}") from None
    return text



def _capped_whitespace(node: Any) -> Any:
    """The structural tag's JSON arguments with whitespace runs capped at MAX_WHITESPACE_RUN."""
    if isinstance(node, dict):
        node = {key: _capped_whitespace(value) for key, value in node.items()}
        if node.get("type") == "json_schema":
            node["max_whitespace_cnt"] = MAX_WHITESPACE_RUN
        return node
    if isinstance(node, list):
        return [_capped_whitespace(item) for item in node]
    return node
