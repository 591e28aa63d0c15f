"""A streamed Messages answer's events, as the `anthropic` package's own event types: message_start,
then a text block (content_block_start, text_delta per engine step, content_block_stop) once there is
text, then one tool_use block per call (its input as one input_json_delta), message_delta (stop reason,
usage) and message_stop. Accumulated, as the SDK's `messages.stream()` does, they are the recorded answer.
"""

from __future__ import annotations

import json

from anthropic.types import (InputJSONDelta, Message, MessageDeltaUsage, RawContentBlockDeltaEvent,
                             RawContentBlockStartEvent, RawContentBlockStopEvent, RawMessageDeltaEvent,
                             RawMessageStartEvent, RawMessageStopEvent, TextBlock, TextDelta, ToolUseBlock, Usage)
from anthropic.types.raw_message_delta_event import Delta
from fastapi import HTTPException, Request

from api.inference.anthropic_api import anthropic_error
from api.inference.event_streams import sse
from api.inference.rendering import Completion


class MessageEvents:
    def __init__(self, *, response_id: str, model: str, prompt_len: int) -> None:
        self.id, self.model, self.prompt_len = f"msg_{response_id}", model, prompt_len
        self.text_open = False

    def start(self) -> list[bytes]:
        # input_tokens here is the whole prompt: what the prompt cache held is known at the end (message_delta)
        message = Message(id=self.id, type="message", role="assistant", model=self.model, content=[],
                          stop_reason=None, stop_sequence=None,
                          usage=Usage(input_tokens=self.prompt_len, output_tokens=0))
        return [sse(RawMessageStartEvent(type="message_start", message=message))]

    def text(self, text: str) -> list[bytes]:
        out = []
        if not self.text_open:
            self.text_open = True
            out.append(sse(RawContentBlockStartEvent(type="content_block_start", index=0,
                                                     content_block=TextBlock(type="text", text=""))))
        out.append(sse(RawContentBlockDeltaEvent(type="content_block_delta", index=0,
                                                 delta=TextDelta(type="text_delta", text=text))))
        return out

    def end(self, rest: str, answer: dict, completion: Completion) -> list[bytes]:
        out = self.text(rest) if rest else []
        if self.text_open:
            out.append(sse(RawContentBlockStopEvent(type="content_block_stop", index=0)))
        index = int(self.text_open)
        for block in answer["content"]:
            if block["type"] != "tool_use":
                continue
            start = ToolUseBlock(type="tool_use", id=block["id"], name=block["name"], input={})
            out += [sse(RawContentBlockStartEvent(type="content_block_start", index=index, content_block=start)),
                    sse(RawContentBlockDeltaEvent(type="content_block_delta", index=index, delta=InputJSONDelta(
                        type="input_json_delta", partial_json=json.dumps(block["input"])))),
                    sse(RawContentBlockStopEvent(type="content_block_stop", index=index))]
            index += 1
        usage = answer["usage"]
        out += [sse(RawMessageDeltaEvent(
                    type="message_delta",
                    delta=Delta(stop_reason=answer["stop_reason"], stop_sequence=answer.get("stop_sequence")),
                    usage=MessageDeltaUsage(output_tokens=usage["output_tokens"], input_tokens=usage["input_tokens"],
                                            cache_read_input_tokens=usage.get("cache_read_input_tokens"),
                                            cache_creation_input_tokens=usage.get("cache_creation_input_tokens")))),
                sse(RawMessageStopEvent(type="message_stop"))]
        return out

    def error(self, request: Request, error: HTTPException) -> bytes:
        return sse(json.loads(anthropic_error(request.app.state.settings, error).body))
