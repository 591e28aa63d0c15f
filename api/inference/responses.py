"""The answers, built as the `openai` package's own response types (so their shape is OpenAI's by
construction) and sent as their JSON. Imported by the routes on first use: `openai` takes most of a
second to import, which an API replica that never serves these routes should not pay.

`logprobs` has one entry per sampled token, the stop token included: exactly the tokens the rollout
store keeps and a datum built from it trains.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from loraplex.wire.codec import SampledSequenceWire
from openai.types import Completion as CompletionResponse
from openai.types import CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionMessage, ChatCompletionTokenLogprob
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_message_function_tool_call import ChatCompletionMessageFunctionToolCall, Function
from openai.types.chat.chat_completion_token_logprob import TopLogprob
from openai.types.completion_choice import Logprobs
from openai.types.completion_usage import PromptTokensDetails

from api.inference.rendering import Completion, token_strings
from api.inference.targets import ListedModel


def completion_usage(prompt_len: int, sequences: Sequence[SampledSequenceWire], cached: int) -> CompletionUsage:
    generated = sum(len(s.tokens) for s in sequences)
    return CompletionUsage(prompt_tokens=prompt_len, completion_tokens=generated, total_tokens=prompt_len + generated,
                           prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def dump_response(response) -> dict:
    return response.model_dump(mode="json", exclude_unset=True)


def chat_logprobs(tokenizer, seq: SampledSequenceWire, top: int, as_ids: bool) -> ChoiceLogprobs:
    names = token_strings(tokenizer, list(seq.tokens), as_ids)
    rows = seq.topk_logprobs or [None] * len(names)
    entries = []
    for name, logprob, row in zip(names, seq.logprobs, rows):
        alternatives = row[:top] if row else []
        top_names = token_strings(tokenizer, [t for t, _ in alternatives], as_ids)
        entries.append(ChatCompletionTokenLogprob(
            token=name, bytes=list(name.encode()), logprob=logprob,
            top_logprobs=[TopLogprob(token=n, bytes=list(n.encode()), logprob=lp)
                          for n, (_, lp) in zip(top_names, alternatives)]))
    return ChoiceLogprobs(content=entries)


def chat_completion(*, response_id: str, model: str, fingerprint: str, prompt_len: int, cached: int,
                    sequences: Sequence[SampledSequenceWire], completions: Sequence[Completion], tokenizer,
                    logprobs: bool, top_logprobs: int, as_ids: bool) -> dict:
    choices = []
    for i, (seq, done) in enumerate(zip(sequences, completions, strict=True)):
        calls = [ChatCompletionMessageFunctionToolCall(id=c.id, type="function",
                                                       function=Function(name=c.name, arguments=c.arguments))
                 for c in done.tool_calls]
        message = ChatCompletionMessage(role="assistant", content=done.text, **({"tool_calls": calls} if calls else {}))
        choices.append(Choice(index=i, finish_reason=done.finish_reason, message=message,
                              logprobs=chat_logprobs(tokenizer, seq, top_logprobs, as_ids) if logprobs else None))
    return dump_response(ChatCompletion(id=f"chatcmpl-{response_id}", object="chat.completion", created=int(time.time()),
                                model=model, choices=choices, system_fingerprint=fingerprint,
                                usage=completion_usage(prompt_len, sequences, cached)))


def completion_logprobs(tokenizer, seq: SampledSequenceWire, top: int | None, as_ids: bool) -> Logprobs:
    names = token_strings(tokenizer, list(seq.tokens), as_ids)
    offsets, at = [], 0
    for name in names:
        offsets.append(at)
        at += len(name)
    tops = None
    if top:
        tops = []
        for row in seq.topk_logprobs or [None] * len(names):
            alternatives = row[:top] if row else []
            tops.append(dict(zip(token_strings(tokenizer, [t for t, _ in alternatives], as_ids),
                                 (lp for _, lp in alternatives))))
    return Logprobs(tokens=names, token_logprobs=list(seq.logprobs), text_offset=offsets, top_logprobs=tops)


def text_completion(*, response_id: str, model: str, fingerprint: str, prompt_len: int, cached: int,
                    sequences: Sequence[SampledSequenceWire], completions: Sequence[Completion], tokenizer,
                    logprobs: int | None, as_ids: bool) -> dict:
    choices = [CompletionChoice(index=i, text=done.text or "", finish_reason=done.finish_reason,
                                logprobs=completion_logprobs(tokenizer, seq, logprobs, as_ids)
                                if logprobs is not None else None)
               for i, (seq, done) in enumerate(zip(sequences, completions, strict=True))]
    return dump_response(CompletionResponse(id=f"cmpl-{response_id}", object="text_completion", created=int(time.time()),
                                    model=model, choices=choices, system_fingerprint=fingerprint,
                                    usage=completion_usage(prompt_len, sequences, cached)))


def model_list(models: Sequence[ListedModel]) -> dict:
    from openai.types import Model

    return {"object": "list", "data": [Model(id=m.id, created=int(m.created_at.timestamp()), object="model",
                                             owned_by="loraplex").model_dump(mode="json") for m in models]}