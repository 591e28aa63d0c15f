"""Anthropic Messages answers and errors, built as the `anthropic` package's own types (so their shape is
Anthropic's by construction). Imported on first use, as responses.py is: the SDK takes a while to import.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from anthropic.types import Message, MessageTokensCount, ModelInfo, TextBlock, ToolUseBlock, Usage

from api.inference.rendering import Completion
from api.inference.targets import ListedModel
from loraplex.wire.codec import SampledSequenceWire


def stop_reason(done: Completion, seq: SampledSequenceWire, end_tokens: frozenset[int], full_text: str | None,
                stop_strings: Sequence[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a sample: a tool call, the length limit, one of the caller's stop
    sequences (the first in the text, as the text was cut there), or the model's own end of turn."""
    if done.finish_reason == "tool_calls":
        return "tool_use", None
    if done.finish_reason == "length":
        return "max_tokens", None
    if seq.tokens and seq.tokens[-1] in end_tokens or not stop_strings or full_text is None:
        return "end_turn", None
    found = [(at, stop) for stop in stop_strings if (at := full_text.find(stop)) >= 0]
    return ("stop_sequence", min(found)[1]) if found else ("end_turn", None)


def _tool_input(arguments: str) -> dict:
    """The call's arguments as tool_use's `input` object (the parser hands them over as JSON text)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = arguments
    return parsed if isinstance(parsed, dict) else {"arguments": parsed}


def message(*, response_id: str, model: str, prompt_len: int, cached: int, seq: SampledSequenceWire,
            done: Completion, reason: tuple[str, str | None]) -> dict:
    content: list = [TextBlock(type="text", text=done.text)] if done.text else []
    content += [ToolUseBlock(type="tool_use", id=call.id, name=call.name, input=_tool_input(call.arguments))
                for call in done.tool_calls]
    usage = Usage(input_tokens=prompt_len - cached, cache_read_input_tokens=cached, cache_creation_input_tokens=0,
                  output_tokens=len(seq.tokens))
    answer = Message(id=f"msg_{response_id}", type="message", role="assistant", model=model, content=content,
                     stop_reason=reason[0], stop_sequence=reason[1], usage=usage)
    return answer.model_dump(mode="json", exclude_unset=True)


def token_count(prompt_len: int) -> dict:
    return MessageTokensCount(input_tokens=prompt_len).model_dump(mode="json")


def model_page(models: Sequence[ListedModel], *, limit: int, after_id: str | None, before_id: str | None) -> dict:
    """One page of GET /v1/models, in the order listed (base model first), cut at the cursor: `limit`
    models after `after_id`, or the last `limit` before `before_id` (None: from the start)."""
    ids = [m.id for m in models]
    if after_id is not None:
        models = models[ids.index(after_id) + 1:][:limit]
    elif before_id is not None:
        models = models[:ids.index(before_id)][-limit:]
    else:
        models = models[:limit]
    data = [ModelInfo(id=m.id, created_at=m.created_at, display_name=m.id, type="model", lifecycle="active")
            for m in models]
    more = bool(models) and (models[-1].id != ids[-1] if before_id is None else models[0].id != ids[0])
    return {"data": [m.model_dump(mode="json", exclude_none=True) for m in data], "has_more": more,
            "first_id": data[0].id if data else None, "last_id": data[-1].id if data else None}
