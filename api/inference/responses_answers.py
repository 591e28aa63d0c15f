"""OpenAI Responses answers, built as the `openai` package's own types (imported on first use, as
responses.py is, for the same reason)."""

from __future__ import annotations

import time

from openai.types.responses import (FunctionTool, Response, ResponseFunctionToolCall, ResponseOutputMessage,
                                    ResponseOutputText, ResponseUsage)
from openai.types.responses.response import IncompleteDetails
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails

from api.inference.rendering import Completion
from api.inference.responses_params import ResponsesRequest, is_strict
from loraplex.wire.codec import SampledSequenceWire


def output_items(response_id: str, done: Completion) -> list:
    """The answer's output: a message with the text (when there is any), then one item per function call."""
    items: list = []
    if done.text:
        items.append(ResponseOutputMessage(id=f"msg_{response_id}", type="message", role="assistant",
                                           status="completed",
                                           content=[ResponseOutputText(type="output_text", text=done.text,
                                                                       annotations=[])]))
    items += [ResponseFunctionToolCall(type="function_call", id=f"fc_{response_id}_{i}", call_id=call.id,
                                       name=call.name, arguments=call.arguments, status="completed")
              for i, call in enumerate(done.tool_calls)]
    return items


def skeleton(*, response_id: str, model: str, body: ResponsesRequest, tool_choice: str | dict) -> Response:
    """The response before its output: what a stream's response.created carries."""
    tools = [FunctionTool(type="function", name=t["name"], description=t.get("description"),
                          parameters=t.get("parameters"), strict=is_strict(t)) for t in body.tools or ()]
    return Response(
        id=f"resp_{response_id}", object="response", created_at=float(int(time.time())), model=model,
        status="in_progress", output=[], parallel_tool_calls=True, tool_choice=tool_choice, tools=tools,
        instructions=body.instructions, metadata=body.metadata, temperature=body.temperature, top_p=body.top_p,
        max_output_tokens=body.max_output_tokens, previous_response_id=body.previous_response_id, user=body.user)


def response(*, response_id: str, model: str, prompt_len: int, cached: int, seq: SampledSequenceWire,
             done: Completion, body: ResponsesRequest, tool_choice: str | dict) -> dict:
    generated = len(seq.tokens)
    usage = ResponseUsage(input_tokens=prompt_len,
                          input_tokens_details=InputTokensDetails(cached_tokens=cached, cache_write_tokens=0),
                          output_tokens=generated, output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
                          total_tokens=prompt_len + generated)
    incomplete = done.finish_reason == "length"
    answer = skeleton(response_id=response_id, model=model, body=body, tool_choice=tool_choice)
    answer.status = "incomplete" if incomplete else "completed"
    answer.incomplete_details = IncompleteDetails(reason="max_output_tokens") if incomplete else None
    answer.output = output_items(response_id, done)
    answer.usage = usage
    return answer.model_dump(mode="json", exclude_unset=True)
