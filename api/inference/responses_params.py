"""The request body of POST /oai/api/v1/responses (OpenAI Responses), and what is done with each parameter.

Every parameter of the `openai` package's ResponseCreateParams (plus `stream`; tests/inference checks
the list) is used, accepted only at a value that changes nothing (NEUTRAL), or refused with a 400
naming it, as params.py does for chat/completions. Extension: `top_k` (vLLM's name).

Input items become the chat template's (OpenAI chat-style) messages: a message item a message
("developer" rendered as "system", the role chat templates know), function_call items an assistant
message's tool_calls, function_call_output items "tool" messages. `instructions` is a system message
first; as on OpenAI, a previous response's instructions are not carried over.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.input_policy import INT32_MAX, OpenAIMetadata
from api.inference.errors import InferenceError
from api.inference.params import is_neutral, validation_message

PARAMETERS = frozenset({
    "access_programs", "background", "background_options", "context_management", "conversation", "image",
    "include", "input", "instructions", "max_output_tokens", "max_tool_calls", "metadata", "model", "moderation",
    "parallel_tool_calls", "previous_response_id", "prompt", "prompt_cache_key", "prompt_cache_options",
    "prompt_cache_retention", "reasoning", "safety_identifier", "service_tier", "store", "stream", "stream_options",
    "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p", "truncation", "user",
})
EXTENSIONS = frozenset({"top_k"})
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "background": (None, False), "parallel_tool_calls": (None, True), "service_tier": (None, "auto", "default"),
    "text": (None, {"format": {"type": "text"}}), "truncation": (None, "disabled"), "include": (None, []),
    "store": (None, True),  # every call is recorded in the rollout store (previous_response_id reads it)
    "prompt_cache_key": (None,), "safety_identifier": (None,),
}
WHY_NOT = {
    "store": "every call is recorded in the rollout store; store: false is not supported",
    "tool_choice": "\"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\"}",
    "conversation": "not supported; chain responses with previous_response_id",
}
_MESSAGE_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    model: str = Field(min_length=1, max_length=1000)
    input: str | list[Any]
    instructions: str | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=200)
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # extension; -1 or 0: no limit
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    metadata: OpenAIMetadata | None = None
    user: str | None = Field(None, max_length=1000)
    stream: bool = False


def parse(body: Any) -> ResponsesRequest:
    """The body as a ResponsesRequest, after refusing every parameter that is not used (400 naming it)."""
    if not isinstance(body, dict):
        raise InferenceError(400, "body: expected a JSON object")
    fields = ResponsesRequest.model_fields
    for name, value in body.items():
        if name in fields:
            continue
        if name not in PARAMETERS | EXTENSIONS:
            raise InferenceError(400, f"{str(name)[:64]}: not a parameter of this route (unsupported extensions "
                                      "are refused, never ignored)")
        if not any(is_neutral(value, neutral) for neutral in NEUTRAL.get(name, (None,))):
            raise InferenceError(400, f"{name}: {WHY_NOT.get(name, 'not supported by this server')}")
    try:
        parsed = ResponsesRequest.model_validate({k: v for k, v in body.items() if k in fields})
    except ValidationError as e:
        raise InferenceError(400, validation_message(e)) from None
    # a named choice is checked against the tools once they are (tool_grammar.py)
    if isinstance(parsed.tool_choice, str) and parsed.tool_choice not in ("auto", "none", "required"):
        raise InferenceError(400, f"tool_choice: {WHY_NOT['tool_choice']}")
    return parsed


def tool_choice(body: ResponsesRequest) -> str | dict[str, Any]:
    return body.tool_choice or "auto"


def is_strict(tool: dict) -> bool:
    """A Responses function tool is strict unless it says `strict: false` (OpenAI's default is true)."""
    return tool.get("strict") is not False


def _check_keys(item: dict, allowed: set[str], where: str) -> None:
    for key in item:
        if key not in allowed:
            raise InferenceError(400, f"{where}.{str(key)[:40]}: not supported by this server")


def _text(content: Any, where: str) -> str:
    """A string, or input_text/output_text parts joined by newlines (as the chat route joins text parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InferenceError(400, f"{where}: a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InferenceError(400, f"{where}[{j}].type: only input_text and output_text parts are supported, "
                                      f"got {str(kind)[:40]!r}")
        _check_keys(part, {"type", "text", "annotations", "logprobs"}, f"{where}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _arguments(text: Any, where: str) -> Any:
    """A function call's arguments as the template prints them (with `tojson`): parsed from their JSON."""
    if not isinstance(text, str):
        raise InferenceError(400, f"{where}: a string of JSON")
    try:
        return json.loads(text)
    except ValueError:
        return text  # a template gets the text as it came


def _append_call(messages: list[dict], call: dict) -> None:
    """Function calls join the assistant message right before them; else they are a message of their own."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def template_messages(items: list[Any], where: str = "input") -> list[dict]:
    """Input (or stored output) items as the chat template's messages."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise InferenceError(400, f"{at}: expected an item object")
        kind = item.get("type", "message")
        if kind == "message":
            _check_keys(item, {"type", "role", "content", "id", "status", "phase"}, at)
            role = _MESSAGE_ROLES.get(item.get("role"))
            if role is None:
                raise InferenceError(400, f"{at}.role: one of {', '.join(_MESSAGE_ROLES)}, got "
                                          f"{str(item.get('role'))[:40]!r}")
            messages.append({"role": role, "content": _text(item.get("content"), f"{at}.content")})
        elif kind == "function_call":
            _check_keys(item, {"type", "call_id", "name", "arguments", "id", "status"}, at)
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("name"), str):
                raise InferenceError(400, f"{at}: a function_call needs a call_id and a name")
            _append_call(messages, {"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": _arguments(item.get("arguments", "{}"), f"{at}.arguments")}})
        elif kind == "function_call_output":
            _check_keys(item, {"type", "call_id", "output", "id", "status"}, at)
            if not isinstance(item.get("call_id"), str):
                raise InferenceError(400, f"{at}.call_id: a string")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output"), f"{at}.output")})
        else:
            raise InferenceError(400, f"{at}.type: only message, function_call and function_call_output items are "
                                      f"supported, got {str(kind)[:40]!r}")
    return messages


def input_items(body_input: Any) -> list[Any]:
    """`input` as a list of items (a string is one user message)."""
    return [{"type": "message", "role": "user", "content": body_input}] if isinstance(body_input, str) else body_input


def template_tools(body: ResponsesRequest) -> list[dict] | None:
    """Responses' function tools (flat: name, description, parameters) as the chat template's tools
    (`strict` is the grammar's business, tool_grammar.py: grammar_tools)."""
    if not body.tools:
        return None
    out = []
    for i, tool in enumerate(body.tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise InferenceError(400, f"tools[{i}]: only {{\"type\": \"function\", \"name\", ...}} tools are "
                                      "supported")
        _check_keys(tool, {"type", "name", "description", "parameters", "strict"}, f"tools[{i}]")
        if not isinstance(tool.get("strict", False), bool) and tool.get("strict") is not None:
            raise InferenceError(400, f"tools[{i}].strict: true or false")
        function = {"name": tool["name"]}
        for key in ("description", "parameters"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def grammar_tools(body: ResponsesRequest, tools: list[dict] | None) -> list[dict] | None:
    """The template's tools with each one's `strict`, as tool_grammar.structural_tag takes them."""
    if not tools:
        return tools
    return [{**t, "function": {**t["function"], "strict": is_strict(raw)}} for t, raw in zip(tools, body.tools)]
