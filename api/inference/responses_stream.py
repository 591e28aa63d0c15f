"""A streamed Responses answer's events, as the `openai` package's own event types: response.created and
response.in_progress, then the message item once there is text (output_item.added, content_part.added,
output_text.delta per engine step, output_text.done, content_part.done, output_item.done), then one
function_call item per call (its arguments as one delta), and response.completed carrying the recorded
answer, whose status says whether it stopped at max_output_tokens ("incomplete"). That is vLLM's choice too:
the `openai` SDK's stream accumulator (`get_final_response`) takes no other end event, and a stream ending in
response.incomplete makes it raise. Each event has its sequence_number, from 0.
"""

from __future__ import annotations

import json

from fastapi import HTTPException, Request
from openai.types.responses import (Response, ResponseCompletedEvent, ResponseContentPartAddedEvent,
                                    ResponseContentPartDoneEvent, ResponseCreatedEvent, ResponseErrorEvent,
                                    ResponseFunctionCallArgumentsDeltaEvent, ResponseFunctionCallArgumentsDoneEvent,
                                    ResponseInProgressEvent, ResponseOutputItemAddedEvent,
                                    ResponseOutputItemDoneEvent, ResponseOutputMessage, ResponseOutputText,
                                    ResponseTextDeltaEvent, ResponseTextDoneEvent)

from api.inference.errors import error_response
from api.inference.event_streams import sse
from api.inference.rendering import Completion


class ResponseEvents:
    def __init__(self, skeleton: Response) -> None:
        self.skeleton = skeleton
        self.message_id = skeleton.id.replace("resp_", "msg_", 1)
        self.sequence = 0
        self.text_sent = ""
        self.message_open = False

    def _event(self, kind, **fields) -> bytes:
        event = sse(kind(sequence_number=self.sequence, **fields))
        self.sequence += 1
        return event

    def start(self) -> list[bytes]:
        return [self._event(ResponseCreatedEvent, type="response.created", response=self.skeleton),
                self._event(ResponseInProgressEvent, type="response.in_progress", response=self.skeleton)]

    def _text_part(self, text: str) -> ResponseOutputText:
        return ResponseOutputText(type="output_text", text=text, annotations=[])

    def text(self, text: str) -> list[bytes]:
        out = []
        where = dict(item_id=self.message_id, output_index=0)
        if not self.message_open:
            self.message_open = True
            item = ResponseOutputMessage(id=self.message_id, type="message", role="assistant", status="in_progress",
                                         content=[])
            out += [self._event(ResponseOutputItemAddedEvent, type="response.output_item.added", output_index=0,
                                item=item),
                    self._event(ResponseContentPartAddedEvent, type="response.content_part.added", content_index=0,
                                part=self._text_part(""), **where)]
        self.text_sent += text
        out.append(self._event(ResponseTextDeltaEvent, type="response.output_text.delta", content_index=0, delta=text,
                               logprobs=[], **where))
        return out

    def end(self, rest: str, answer: dict, completion: Completion) -> list[bytes]:
        out = self.text(rest) if rest else []
        final = Response.model_validate(answer)
        for index, item in enumerate(final.output):
            if item.type == "message":
                where = dict(item_id=item.id, output_index=index)
                out += [self._event(ResponseTextDoneEvent, type="response.output_text.done", content_index=0,
                                    text=self.text_sent, logprobs=[], **where),
                        self._event(ResponseContentPartDoneEvent, type="response.content_part.done", content_index=0,
                                    part=self._text_part(self.text_sent), **where)]
            else:  # a function call: its arguments in one delta
                where = dict(item_id=item.id, output_index=index)
                started = item.model_copy(update={"arguments": "", "status": "in_progress"})
                out += [self._event(ResponseOutputItemAddedEvent, type="response.output_item.added",
                                    output_index=index, item=started),
                        self._event(ResponseFunctionCallArgumentsDeltaEvent,
                                    type="response.function_call_arguments.delta", delta=item.arguments, **where),
                        self._event(ResponseFunctionCallArgumentsDoneEvent,
                                    type="response.function_call_arguments.done", arguments=item.arguments, **where)]
            out.append(self._event(ResponseOutputItemDoneEvent, type="response.output_item.done", output_index=index,
                                   item=item))
        out.append(self._event(ResponseCompletedEvent, type="response.completed", response=final))
        return out

    def error(self, request: Request, error: HTTPException) -> bytes:
        body = json.loads(error_response(request.app.state.settings, error).body)["error"]
        return self._event(ResponseErrorEvent, type="error", code=body["code"] or body["type"],
                           message=body["message"], param=body["param"])
