"""`stream: true`: a GenerationStream (api/inference/generate.py) sent as server-sent events.

Each engine step's new tokens go out as chunks at once (api/inference/chunks.py builds them). When the
samples end, `finish` builds the whole answer and records the turn (the stored tokens are the streamed
ones), then the last chunks go out: the rest of the text, tool calls, finish reasons, usage, [DONE].
A failure after the stream began is sent as an error event in OpenAI's shape (the `openai` SDK raises
it). A client that goes away cancels the response, which aborts its sample in the engine.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

from fastapi import HTTPException, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from api.deps import TenantRef
from api.inference import calls, rendering
from api.inference.chunks import DONE, ChoiceText
from api.inference.errors import error_response
from api.inference.generate import Generation, GenerationStream, generate_stream
from api.inference.rendering import Completion
from contract.sampling import SampleDelta
from db.models import new_id

log = logging.getLogger(__name__)


def _error_event(request: Request, error: HTTPException) -> bytes:
    return b"data: " + error_response(request.app.state.settings, error).body + b"\n\n"


def _step_events(chunks, texts: Sequence[ChoiceText], deltas: list[SampleDelta]) -> bytes:
    """One engine step's chunks (off the event loop: decoding takes the tokenizer's lock)."""
    out = []
    for delta in deltas:
        chunk = chunks.step(delta, texts[delta.index].push(delta.tokens))
        if chunk is not None:
            out.append(chunk)
    return b"".join(out)


async def _events(request: Request, stream: GenerationStream, chunks, texts: Sequence[ChoiceText], prompt_len: int,
                  finish: Callable[[Generation], list[Completion]]) -> AsyncIterator[bytes]:
    try:
        async with stream:
            yield b"".join(chunks.start(len(texts)))
            async for item in stream:
                if not isinstance(item, Generation):
                    events = await run_in_threadpool(_step_events, chunks, texts, item)
                    if events:
                        yield events
                    continue
                completions = await run_in_threadpool(finish, item)  # recorded before the last chunks go out
                last = [line for i, done in enumerate(completions)
                        for line in chunks.end(i, texts[i].finish(done.text), done)]
                last += chunks.usage(prompt_len, item.sequences, item.cached_prompt_tokens)
                yield b"".join(last) + DONE
    except HTTPException as e:
        yield _error_event(request, e)
    except Exception:  # the stream already began: the client gets an error event, not a cut connection
        log.exception("streaming %s failed", stream.request_id)
        yield _error_event(request, HTTPException(500, "the server failed while streaming the answer"))


def sse_response(request: Request, stream: GenerationStream, chunks, texts: Sequence[ChoiceText], prompt_len: int,
                 finish: Callable[[Generation], list[Completion]], headers: dict[str, str]) -> StreamingResponse:
    """The stream as a text/event-stream response. `finish(generation)` (run in a thread) builds the whole
    answer, records it, and returns each choice's Completion (text, tool calls, finish reason)."""
    return StreamingResponse(_events(request, stream, chunks, texts, prompt_len, finish),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})


async def stream_and_record(request: Request, tenant: TenantRef, call: calls.Call, build: Callable[..., dict],
                            chunks_of: Callable[[str], object]) -> StreamingResponse:
    """calls.sample_and_record, streamed: `chunks_of(response_id)` builds the API's chunks
    (api/inference/chunks.py); the turn recorded is `build`'s whole answer, as a non-streamed call's.
    The headers go out before the turn exists: they name its session (a fresh one if the call named
    none) and policy version, not its turn number."""
    call = replace(call, session=call.session or new_id())
    stream = await generate_stream(request, tenant.id, call.target, call.prompt, call.n, call.options, call.topk)
    info = call.target.served.info
    tokenizer = rendering.tokenizer_of(str(info.path))
    texts = [ChoiceText(tokenizer, str(info.path), call.options.stop_strings, call.parse_tools) for _ in range(call.n)]
    turn_id = new_id()

    def finish(generation: Generation) -> list[Completion]:
        built: dict = {}

        def keep_completions(**common) -> dict:
            built.update(common)
            return build(**common)

        calls.record(request, tenant, call, generation, turn_id, keep_completions)
        return built["completions"]

    headers = {calls.SESSION_HEADER: call.session, "X-Loraplex-Policy-Version": call.target.version_label}
    return sse_response(request, stream, chunks_of(turn_id), texts, len(call.prompt), finish, headers)
