"""The request bodies of /chat/completions and /completions, and what is done with each OpenAI parameter.

Every parameter of OpenAI's requests (the `openai` package's CompletionCreateParams, mirrored in
CHAT_PARAMETERS and COMPLETION_PARAMETERS; tests/inference checks they match) is either used, accepted
only at the value that changes nothing (NEUTRAL), or refused with a 400 naming it. A parameter OpenAI
does not have is refused too, except the extensions below. Nothing is silently ignored.

Extensions (vLLM's names): `top_k`; `return_tokens_as_token_ids` (logprob tokens as "token_id:<id>").
The trajectory a call belongs to: the `X-Loraplex-Session` header, else `metadata["session_id"]`,
else `user`; none of them: the call is a trajectory of its own.
"""

from __future__ import annotations

import math
import re
from typing import Any

from loraplex.types import SAMPLING_DEFAULTS
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.input_policy import INT32_MAX, Label, OpenAIMetadata, Seed, StopStrings
from api.inference.errors import InferenceError
from api.routes.sampling import MAX_TOPK
from contract.sampling import SamplingOptions

CHAT_PARAMETERS = frozenset({
    "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs", "max_completion_tokens",
    "max_tokens", "messages", "metadata", "modalities", "model", "moderation", "n", "parallel_tool_calls",
    "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
    "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
    "web_search_options",
})
COMPLETION_PARAMETERS = frozenset({
    "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "model", "n", "presence_penalty",
    "prompt", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
})
# Accepted at these values only (they change nothing here); any other value is a 400 naming the parameter.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "logit_bias": (None, {}),
    "parallel_tool_calls": (None, True), "service_tier": (None, "auto", "default"), "modalities": (None, ["text"]),
    "response_format": (None, {"type": "text"}), "best_of": (None, 1), "echo": (None, False),
    # every call is recorded in the rollout store: asking for that is fine, asking not to is refused
    "store": (None, True),
}
WHY_NOT = {
    "store": "every call is recorded in the rollout store; store: false is not supported",
    "tool_choice": "\"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\"}}",
}

_SESSION = re.compile(r"^[A-Za-z0-9._:@+=-]{1,200}$")


def _refuse_parameter(name: str, value: Any, known: frozenset[str]) -> None:
    if name not in known:
        raise InferenceError(400, f"{name[:64]}: not a parameter of this route (unsupported extensions are refused, "
                                  "never ignored)")
    allowed = NEUTRAL.get(name, (None,))
    if any(is_neutral(value, a) for a in allowed):
        return
    why = WHY_NOT.get(name) or "not supported by this server" + (
        f"; only {' or '.join(repr(a) for a in allowed if a is not None)} is accepted" if len(allowed) > 1 else "")
    raise InferenceError(400, f"{name}: {why}")


def is_neutral(value: Any, neutral: Any) -> bool:
    """`value` is `neutral` (0 and 0.0 alike, but never True for 1 or False for 0)."""
    if isinstance(value, bool) or isinstance(neutral, bool) or neutral is None:
        return value is neutral
    if isinstance(neutral, (int, float)):
        return isinstance(value, (int, float)) and value == neutral
    return type(value) is type(neutral) and value == neutral


def validation_message(error: ValidationError) -> str:
    problems = []
    for e in error.errors():
        where = ".".join(str(part)[:64] for part in e.get("loc", ())) or "body"
        problems.append(f"{where}: {e.get('msg', 'invalid')}")
    return "; ".join(problems)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = None  # a last chunk with the usage and no choices
    include_obfuscation: bool | None = None  # only false/absent: chunks carry no padding here


class InferenceRequest(BaseModel):
    """What /chat/completions and /completions share."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    model: str = Field(min_length=1, max_length=1000)
    n: int = Field(1, ge=1, le=INT32_MAX)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # extension; -1 or 0: no limit
    seed: Seed | None = None
    stop: Label | StopStrings | None = None
    user: str | None = Field(None, max_length=1000)
    metadata: OpenAIMetadata | None = None
    return_tokens_as_token_ids: bool = False  # extension
    stream: bool | None = None  # server-sent events as the engine makes the tokens (api/inference/chunks.py)
    stream_options: StreamOptions | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatRequest(InferenceRequest):
    messages: list[Any] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOPK)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class CompletionRequest(InferenceRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_TOPK)  # top-k width; the sampled token's logprob always


EXTENSIONS = frozenset({"top_k", "return_tokens_as_token_ids"})


def parse(cls: type[InferenceRequest], body: Any, known: frozenset[str]) -> InferenceRequest:
    """The body as `cls`, after refusing every parameter that is not used (400 naming it)."""
    if not isinstance(body, dict):
        raise InferenceError(400, "body: expected a JSON object")
    fields = cls.model_fields
    for name, value in body.items():
        if name not in fields:
            _refuse_parameter(name, value, known | EXTENSIONS)
    try:
        parsed = cls.model_validate({k: v for k, v in body.items() if k in fields})
    except ValidationError as e:
        raise InferenceError(400, validation_message(e)) from None
    for i, stop in enumerate(parsed.stop_strings):
        if not stop:
            raise InferenceError(400, f"stop[{i}]: an empty stop string would stop at once")
    if parsed.stream_options is not None:
        if not parsed.stream:
            raise InferenceError(400, "stream_options: only allowed when stream is true")
        if parsed.stream_options.include_obfuscation:
            raise InferenceError(400, "stream_options.include_obfuscation: not supported by this server; send false")
    if isinstance(parsed, ChatRequest):
        _check_chat(parsed)
    return parsed


def _check_chat(body: ChatRequest) -> None:
    if body.top_logprobs and not body.logprobs:
        raise InferenceError(400, "top_logprobs: needs logprobs: true")
    choice = body.tool_choice  # a named one is checked against the tools once they are (tool_grammar.py)
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        raise InferenceError(400, f"tool_choice: {WHY_NOT['tool_choice']}")


def max_tokens_of(body: InferenceRequest) -> tuple[int | None, str]:
    """(the limit asked for, the field that asked): max_completion_tokens wins over max_tokens."""
    if isinstance(body, ChatRequest) and body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


def sampling_options(body: InferenceRequest, prompt_len: int, max_context: int,
                     max_samples: int) -> SamplingOptions:
    if body.n > max_samples:
        raise InferenceError(400, f"n: at most {max_samples}, got {body.n}")
    room = max_context - prompt_len
    if room < 1:
        field = "messages" if isinstance(body, ChatRequest) else "prompt"
        raise InferenceError(400, f"{field}: the prompt is {prompt_len} tokens; the model's context is {max_context}")
    asked, field = max_tokens_of(body)
    if asked is not None and asked > room:
        raise InferenceError(400, f"{field}: prompt ({prompt_len}) + {field} ({asked}) exceed the model's context of "
                                  f"{max_context} tokens")
    temperature = SAMPLING_DEFAULTS.temperature if body.temperature is None else body.temperature
    top_p = SAMPLING_DEFAULTS.top_p if body.top_p is None else body.top_p
    if not math.isfinite(temperature) or not math.isfinite(top_p):
        raise InferenceError(400, "temperature: must be finite")
    top_k = SAMPLING_DEFAULTS.top_k if body.top_k in (None, 0, -1) else body.top_k
    return SamplingOptions(max_tokens=asked if asked is not None else room, temperature=temperature, top_k=top_k,
                           top_p=top_p, seed=body.seed, stop_strings=body.stop_strings)


def session_of(header: str | None, body: InferenceRequest) -> str | None:
    """The trajectory the call belongs to, by the caller's name for it; None: a trajectory of its own."""
    named = (("X-Loraplex-Session", header), ("metadata.session_id", (body.metadata or {}).get("session_id")),
             ("user", body.user))
    for field, value in named:
        if value is None:
            continue
        if not _SESSION.match(value):
            raise InferenceError(400, f"{field}: a session id is 1-200 letters, digits or ._:@+=- characters")
        return value
    return None
