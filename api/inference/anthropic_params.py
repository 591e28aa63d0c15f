"""The request body of POST /anthropic/v1/messages, and what is done with each Anthropic parameter.

Every parameter of the Messages API (the `anthropic` package's MessageCreateParams, plus temperature,
top_p and top_k, which older models take and harnesses still send; tests/inference checks the list) is
used, accepted only at a value that changes nothing (NEUTRAL), or refused with a 400 naming it, as
params.py does for OpenAI's. Content blocks other than text, tool_use and tool_result are refused too.

The messages become the chat template's (OpenAI-style) messages: `system` a system message first,
tool_use blocks an assistant message's tool_calls, tool_result blocks "tool" messages before the rest
of their user turn. The trajectory: the X-Loraplex-Session header, else metadata.user_id.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.input_policy import INT32_MAX, Label, StopStrings
from api.inference.errors import InferenceError
from api.inference.params import is_neutral, validation_message

PARAMETERS = frozenset({
    "cache_control", "container", "diagnostics", "inference_geo", "max_tokens", "messages", "metadata", "model",
    "output_config", "service_tier", "speed", "stop_sequences", "stream", "system", "temperature", "thinking",
    "tool_choice", "tools", "top_k", "top_p", "user_profile_id", "workspace_id",
})
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "service_tier": (None, "auto", "standard_only"), "thinking": (None, {"type": "disabled"}),
    "cache_control": (None, {"type": "ephemeral"}),  # the sampler caches prompt prefixes anyway
}
WHY_NOT = {
    "tool_choice": "auto, none, any or tool",
    "thinking": "not supported by this server; only {'type': 'disabled'} is accepted",
}
# Block keys that change nothing here: cache hints, and citations (none are produced).
_IGNORABLE_BLOCK_KEYS = {"cache_control", "citations"}


# POST /v1/messages/count_tokens: the `anthropic` package's MessageCountTokensParams
COUNT_PARAMETERS = frozenset({
    "cache_control", "messages", "model", "output_config", "speed", "system", "thinking", "tool_choice", "tools",
    "user_profile_id", "workspace_id",
})


class Conversation(BaseModel):
    """What a Messages request and a count_tokens request share: the prompt."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    model: str = Field(min_length=1, max_length=1000)
    messages: list[Any] = Field(min_length=1)
    system: str | list[Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


class MessagesRequest(Conversation):
    max_tokens: int = Field(ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=1.0)  # Anthropic's range
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)  # 0: no limit
    stop_sequences: StopStrings | None = None
    metadata: dict[Label, Label | None] | None = None  # only user_id (checked in parse)
    stream: bool = False


def parse(body: Any, cls: type[Conversation] = MessagesRequest, known: frozenset[str] = PARAMETERS) -> Any:
    """The body as `cls`, after refusing every parameter that is not used (400 naming it)."""
    if not isinstance(body, dict):
        raise InferenceError(400, "body: expected a JSON object")
    fields = cls.model_fields
    for name, value in body.items():
        if name in fields:
            continue
        if name not in known:
            raise InferenceError(400, f"{str(name)[:64]}: not a parameter of the Messages API (unsupported "
                                      "extensions are refused, never ignored)")
        if not any(is_neutral(value, neutral) for neutral in NEUTRAL.get(name, (None,))):
            raise InferenceError(400, f"{name}: {WHY_NOT.get(name, 'not supported by this server')}")
    try:
        parsed = cls.model_validate({k: v for k, v in body.items() if k in fields})
    except ValidationError as e:
        raise InferenceError(400, validation_message(e)) from None
    for i, stop in enumerate(getattr(parsed, "stop_sequences", None) or ()):
        if not stop:
            raise InferenceError(400, f"stop_sequences[{i}]: an empty stop sequence would stop at once")
    for key in getattr(parsed, "metadata", None) or {}:
        if key != "user_id":
            raise InferenceError(400, f"metadata.{key[:40]}: not supported (only user_id)")
    tool_choice(parsed)  # refused here, with the rest of the body's fields
    return parsed


def _check_block_keys(block: dict, allowed: set[str], where: str) -> None:
    for key in block:
        if key not in allowed | _IGNORABLE_BLOCK_KEYS:
            raise InferenceError(400, f"{where}.{str(key)[:40]}: not supported by this server")


def _text_block(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind != "text" or not isinstance(block.get("text"), str):
        raise InferenceError(400, f"{where}.type: only text blocks are supported here, got {str(kind)[:40]!r}")
    _check_block_keys(block, {"type", "text"}, where)
    return block["text"]


def _text_of(content: Any, where: str) -> str:
    """A string, or text blocks joined by newlines (as the openai route joins text parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InferenceError(400, f"{where}: a string or a list of text blocks")
    return "\n".join(_text_block(block, f"{where}[{j}]") for j, block in enumerate(content))


def _tool_use(block: dict, where: str) -> dict:
    _check_block_keys(block, {"type", "id", "name", "input"}, where)
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise InferenceError(400, f"{where}: a tool_use block needs an id and a name")
    if not isinstance(block.get("input"), dict):
        raise InferenceError(400, f"{where}.input: an object")
    # arguments as an object: templates print them with `tojson`, as the openai route hands them over
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": block["input"]}}


def _tool_result(block: dict, where: str) -> dict:
    # is_error has no place in a chat template (nor in OpenAI's tool message): the model reads the text
    _check_block_keys(block, {"type", "tool_use_id", "content", "is_error"}, where)
    if not isinstance(block.get("tool_use_id"), str):
        raise InferenceError(400, f"{where}.tool_use_id: a string")
    content = block.get("content", "")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": _text_of(content, f"{where}.content")}


def _message(message: Any, where: str) -> list[dict]:
    if not isinstance(message, dict):
        raise InferenceError(400, f"{where}: expected an object with a role and content")
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise InferenceError(400, f"{where}.role: user or assistant, got {str(role)[:40]!r}")
    for key in message:
        if key not in ("role", "content"):
            raise InferenceError(400, f"{where}.{str(key)[:40]}: not supported by this server")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InferenceError(400, f"{where}.content: a string or a list of content blocks")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, at))
        else:
            other = "tool_use" if role == "assistant" else "tool_result"
            raise InferenceError(400, f"{at}.type: {role} messages take text and {other} blocks here, got "
                                      f"{str(kind)[:40]!r}")
    out = list(results)
    if role == "assistant" and calls:
        out.append({"role": "assistant", "content": "\n".join(texts) if texts else None, "tool_calls": calls})
    elif texts or not results:
        out.append({"role": role, "content": "\n".join(texts)})
    return out


def template_messages(body: Conversation) -> list[dict]:
    """The conversation as the chat template takes it."""
    out = [] if body.system is None else [{"role": "system", "content": _text_of(body.system, "system")}]
    for i, message in enumerate(body.messages):
        out.extend(_message(message, f"messages[{i}]"))
    return out


def template_tools(body: Conversation) -> list[dict] | None:
    """Anthropic's tools (name, description, input_schema) as the chat template's function tools."""
    if not body.tools:
        return None
    out = []
    for i, tool in enumerate(body.tools):
        if tool.get("type") not in (None, "custom"):
            raise InferenceError(400, f"tools[{i}].type: only custom tools (name, description, input_schema) are "
                                      f"supported, got {str(tool.get('type'))[:40]!r}")
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise InferenceError(400, f"tools[{i}]: a tool needs a name and an input_schema object")
        for key in tool:
            if key not in ("type", "name", "description", "input_schema", "cache_control"):
                raise InferenceError(400, f"tools[{i}].{str(key)[:40]}: not supported by this server")
        # keys in the order of OpenAI's function tools: templates print a tool with `tojson`, as it is
        function = {"name": tool["name"], **({"description": tool["description"]} if "description" in tool else {}),
                    "parameters": tool["input_schema"]}
        out.append({"type": "function", "function": function})
    return out


def tool_choice(body: Conversation) -> tuple[str | dict, bool]:
    """(the choice in OpenAI's terms, whether several calls may come), from Anthropic's tool_choice: auto,
    none (calls are not parsed out of the text), any (at least one call: "required"), tool (that one)."""
    choice = body.tool_choice or {"type": "auto"}
    kind = choice.get("type")
    if kind not in ("auto", "none", "any", "tool"):
        raise InferenceError(400, f"tool_choice: {WHY_NOT['tool_choice']}; got {str(kind)[:40]!r}")
    for key in choice:
        if key not in ("type", "disable_parallel_tool_use", *(("name",) if kind == "tool" else ())):
            raise InferenceError(400, f"tool_choice.{str(key)[:40]}: not supported by this server")
    if not isinstance(choice.get("disable_parallel_tool_use", False), bool):
        raise InferenceError(400, "tool_choice.disable_parallel_tool_use: true or false")
    parallel = not choice.get("disable_parallel_tool_use")
    if kind == "tool":
        return {"type": "function", "name": choice.get("name")}, parallel
    return {"any": "required"}.get(kind, kind), parallel
