"""Streamed answers (`stream: true`): OpenAI's chunks, built as the `openai` package's own types
(ChatCompletionChunk; Completion for /completions, as OpenAI streams it) from the engine's deltas.

Text goes out as the tokens come, less what could still turn out to be part of a stop string (or,
when tools were passed, of a `<tool_call>`: tool calls are parsed from the whole text at the end,
with the same parser as a non-streamed answer, and sent as one tool_calls delta before the finish)
and an unfinished UTF-8 character. Logprobs go out with their tokens, the stop token included, as
in a non-streamed answer: joined, a stream's chunks are that answer.
"""

from __future__ import annotations

import json
import time

from openai.types import Completion as CompletionChunk
from openai.types import CompletionChoice
from openai.types.chat import ChatCompletionChunk
from openai.types.chat.chat_completion_chunk import (
    Choice,
    ChoiceDelta,
    ChoiceDeltaToolCall,
    ChoiceDeltaToolCallFunction,
    ChoiceLogprobs,
)

from api.inference import rendering
from api.inference.responses import chat_logprobs, completion_logprobs, completion_usage, dump_response
from contract.sampling import SampleDelta

TOOL_CALL_START = "<tool_call>"  # the Hermes format's (rendering.tool_parser_name)
DONE = b"data: [DONE]\n\n"


def event(payload: dict) -> bytes:
    """One server-sent event, as OpenAI sends them."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class ChoiceText:
    """One choice's text as its tokens arrive: `push` the new tokens, get the text that is safe to
    send; `finish` with the whole answer's text, get what is left of it. Joined, what they return is
    the non-streamed answer's text (one caveat: a tokenizer whose text of the whole differs from the
    text grown piece by piece; then the rest is sent from where the two agree, at most nothing).

    Decoding is incremental, as text-generation servers do it: each push decodes only a few tokens
    before the new ones (their text is cut from the result), so a long answer costs linear time."""

    def __init__(self, tokenizer, model_path: str, stop_strings: tuple[str, ...], parse_tools: bool) -> None:
        self.tokenizer, self.parse_tools = tokenizer, parse_tools
        self.end_ids = rendering.end_token_ids(model_path)
        self.held = stop_strings + ((TOOL_CALL_START,) if parse_tools else ())
        self.tokens: list[int] = []
        self.text = ""  # the decoded text so far (without a trailing unfinished character)
        self._prefix = self._read = 0  # token offsets: the decode window starts at _prefix; _read is decoded
        self.sent = ""
        self.closed = False  # a stop string or a tool call began: the rest waits for the end

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=not self.parse_tools)

    def _grow(self) -> None:
        """Add the text of the tokens past `_read` (an end token is never text: the answer leaves it out)."""
        body = self.tokens[:-1] if self.tokens and self.tokens[-1] in self.end_ids else self.tokens
        with rendering._USE:
            before = self._decode(body[self._prefix:self._read])
            now = self._decode(body[self._prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):  # else: a character still unfinished
            self.text += now[len(before):]
            self._prefix, self._read = self._read, len(body)

    def push(self, tokens: tuple[int, ...]) -> str:
        self.tokens.extend(tokens)
        if self.closed:
            return ""
        self._grow()
        text = self.text
        cut = min((i for i in (text.find(s) for s in self.held) if i >= 0), default=-1)
        if cut >= 0:
            text, self.closed = text[:cut], True
        else:
            text = text[:len(text) - self._partial_suffix(text)]
        if len(text) <= len(self.sent):
            return ""
        new, self.sent = text[len(self.sent):], text
        return new

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest end of `text` that may be the start of a held string."""
        return max((n for s in self.held for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if s.startswith(text[-n:])), default=0)

    def finish(self, final_text: str | None) -> str:
        final = final_text or ""
        rest = final[len(self.sent):] if final.startswith(self.sent) else ""
        self.sent = final
        return rest


class ChatChunks:
    """chat.completion.chunk events of one call."""

    def __init__(self, *, response_id: str, model: str, fingerprint: str, tokenizer, logprobs: bool,
                 top_logprobs: int, as_ids: bool, include_usage: bool) -> None:
        self.id, self.model, self.fingerprint = f"chatcmpl-{response_id}", model, fingerprint
        self.tokenizer, self.logprobs, self.top, self.as_ids = tokenizer, logprobs, top_logprobs, as_ids
        self.include_usage = include_usage
        self.created = int(time.time())

    def _chunk(self, choices: list[Choice], **usage) -> bytes:
        extra = {"usage": usage.get("usage")} if self.include_usage else {}
        return event(dump_response(ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                                               model=self.model, system_fingerprint=self.fingerprint,
                                               choices=choices, **extra)))

    def start(self, n: int) -> list[bytes]:
        return [self._chunk([Choice(index=i, delta=ChoiceDelta(role="assistant", content=""), finish_reason=None)])
                for i in range(n)]

    def step(self, delta: SampleDelta, text: str) -> bytes | None:
        if not text and not self.logprobs:
            return None
        logprobs = None
        if self.logprobs:  # the chunk's own ChoiceLogprobs type, of the same entries
            logprobs = ChoiceLogprobs(content=chat_logprobs(self.tokenizer, delta, self.top, self.as_ids).content)
        return self._chunk([Choice(index=delta.index, delta=ChoiceDelta(content=text), finish_reason=None,
                                   logprobs=logprobs)])

    def end(self, index: int, text: str, completion: rendering.Completion) -> list[bytes]:
        out = [self._chunk([Choice(index=index, delta=ChoiceDelta(content=text), finish_reason=None)])] if text else []
        if completion.tool_calls:
            calls = [ChoiceDeltaToolCall(index=j, id=c.id, type="function",
                                         function=ChoiceDeltaToolCallFunction(name=c.name, arguments=c.arguments))
                     for j, c in enumerate(completion.tool_calls)]
            out.append(self._chunk([Choice(index=index, delta=ChoiceDelta(tool_calls=calls), finish_reason=None)]))
        out.append(self._chunk([Choice(index=index, delta=ChoiceDelta(), finish_reason=completion.finish_reason)]))
        return out

    def usage(self, prompt_len: int, sequences, cached: int) -> list[bytes]:
        return [self._chunk([], usage=completion_usage(prompt_len, sequences, cached))] if self.include_usage else []


class TextChunks:
    """text_completion events of one /completions call (OpenAI streams them as Completion objects)."""

    def __init__(self, *, response_id: str, model: str, fingerprint: str, tokenizer, logprobs: int | None,
                 as_ids: bool, include_usage: bool) -> None:
        self.id, self.model, self.fingerprint = f"cmpl-{response_id}", model, fingerprint
        self.tokenizer, self.logprobs, self.as_ids = tokenizer, logprobs, as_ids
        self.include_usage = include_usage
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # text_offset of each choice's next logprob token

    def _chunk(self, choices: list[CompletionChoice], **usage) -> bytes:
        extra = {"usage": usage.get("usage")} if self.include_usage else {}
        return event(dump_response(CompletionChunk(id=self.id, object="text_completion", created=self.created,
                                           model=self.model, system_fingerprint=self.fingerprint,
                                           choices=choices, **extra)))

    def _choice(self, index: int, text: str, finish_reason: str | None, logprobs=None) -> CompletionChoice:
        # model_construct: the type says finish_reason is always set, but a stream's chunks before the
        # last carry null, as OpenAI's do
        return CompletionChoice.model_construct(index=index, text=text, finish_reason=finish_reason,
                                                logprobs=logprobs)

    def start(self, n: int) -> list[bytes]:
        return []

    def step(self, delta: SampleDelta, text: str) -> bytes | None:
        if not text and self.logprobs is None:
            return None
        logprobs = None
        if self.logprobs is not None:
            logprobs = completion_logprobs(self.tokenizer, delta, self.logprobs, self.as_ids)
            at = self._offsets.get(delta.index, 0)
            logprobs.text_offset = [at + o for o in logprobs.text_offset]
            self._offsets[delta.index] = at + sum(len(t) for t in logprobs.tokens)
        return self._chunk([self._choice(delta.index, text, None, logprobs)])

    def end(self, index: int, text: str, completion: rendering.Completion) -> list[bytes]:
        return [self._chunk([self._choice(index, text, completion.finish_reason)])]

    def usage(self, prompt_len: int, sequences, cached: int) -> list[bytes]:
        return [self._chunk([], usage=completion_usage(prompt_len, sequences, cached))] if self.include_usage else []
