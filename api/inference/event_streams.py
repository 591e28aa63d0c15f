"""`stream: true` on the Anthropic Messages and OpenAI Responses APIs: one sample's GenerationStream
(generate.py) sent as named server-sent events (`event: <type>` + `data: <json>`), the way both APIs
stream; each API's events are built by its own builder (anthropic_stream.py, responses_stream.py).

As for the OpenAI chunks (streaming.py, whose ChoiceText is used here too), text goes out as the
engine makes it, less what may still turn out to be a stop sequence or a tool call; when the sample
ends, the whole answer is built and recorded exactly as a non-streamed call's (the stored tokens are
the streamed ones), and the last events are built from it. A failure after the stream began is sent
as the API's own error event.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, Protocol

from fastapi import HTTPException, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from api.deps import TenantRef
from api.inference import calls, rendering
from api.inference.chunks import ChoiceText
from api.inference.generate import Generation, GenerationStream, generate_stream
from api.inference.rendering import Completion
from contract.sampling import SampleDelta
from db.models import new_id

log = logging.getLogger(__name__)


def sse(event: Any) -> bytes:
    """One named event: an SDK event type (or its dict), named by its `type`."""
    data = event if isinstance(event, dict) else event.model_dump(mode="json", exclude_unset=True)
    return f"event: {data['type']}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class EventBuilder(Protocol):
    def start(self) -> list[bytes]: ...

    def text(self, text: str) -> list[bytes]: ...

    def end(self, rest: str, answer: dict, completion: Completion) -> list[bytes]:
        """The last events: `rest` of the text, then the rest of `answer` (as recorded)."""

    def error(self, request: Request, error: HTTPException) -> bytes: ...


def _push(text: ChoiceText, deltas: list[SampleDelta]) -> str:
    return "".join(text.push(delta.tokens) for delta in deltas)  # one sample: every delta is index 0


async def _events(request: Request, stream: GenerationStream, events: EventBuilder, text: ChoiceText,
                  finish: Callable[[Generation], tuple[dict, Completion]]) -> AsyncIterator[bytes]:
    try:
        async with stream:
            yield b"".join(events.start())
            async for item in stream:
                if isinstance(item, Generation):
                    answer, completion = await run_in_threadpool(finish, item)  # recorded before the end goes out
                    yield b"".join(events.end(text.finish(completion.text), answer, completion))
                    continue
                new = await run_in_threadpool(_push, text, item)  # decoding takes the tokenizer's lock
                if new:
                    yield b"".join(events.text(new))
    except HTTPException as e:
        yield events.error(request, e)
    except Exception:  # the stream already began: the client gets an error event, not a cut connection
        log.exception("streaming %s failed", stream.request_id)
        yield events.error(request, HTTPException(500, "the server failed while streaming the answer"))


async def stream_and_record(request: Request, tenant: TenantRef, call: calls.Call, build: Callable[..., dict],
                            events_of: Callable[[str], EventBuilder]) -> StreamingResponse:
    """calls.sample_and_record for one sample, streamed: `events_of(turn_id)` builds the API's events; the
    turn recorded is `build`'s whole answer. The headers go out before the turn exists: they name its
    session (a fresh one if the call named none) and policy version, not its turn number."""
    call = replace(call, session=call.session or new_id())
    stream = await generate_stream(request, tenant.id, call.target, call.prompt, call.n, call.options, call.topk)
    info = call.target.served.info
    text = ChoiceText(rendering.tokenizer_of(str(info.path)), str(info.path), call.options.stop_strings,
                      call.parse_tools)
    turn_id = new_id()

    def finish(generation: Generation) -> tuple[dict, Completion]:
        completions: list[Completion] = []

        def keep_completion(**common) -> dict:
            completions.extend(common["completions"])
            return build(**common)

        answer, _, _ = calls.record(request, tenant, call, generation, turn_id, keep_completion)
        return answer, completions[0]

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", calls.SESSION_HEADER: call.session,
               "X-Loraplex-Policy-Version": call.target.version_label}
    return StreamingResponse(_events(request, stream, events_of(turn_id), text, finish),
                             media_type="text/event-stream", headers=headers)
