"""What every inference API (OpenAI's, Anthropic's, OpenAI Responses) does around its own request and
answer shapes: authenticate the tenant's key, resolve `model`, read the JSON body, answer refusals in
the API's own error shape, and sample a prompt and record it as the next turn of its trajectory.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse, Response
from loraplex.types import SAMPLING_DEFAULTS
from starlette.concurrency import run_in_threadpool

from api import input_policy
from api.deps import TenantRef, tenant_of_key
from api.inference import params, rendering, targets
from api.inference.errors import InferenceError, error_response
from api.inference.generate import Generation, generate
from api.inference.keys import api_key
from api.served_models import served
from contract.sampling import SamplingOptions
from db import rollouts
from db.models import new_id

SESSION_HEADER = "X-Loraplex-Session"
# (settings, the refusal) -> the response in an API's error shape
ErrorShaper = Callable[[Any, HTTPException], Response]


def authenticate(request: Request) -> TenantRef:
    """The tenant of the call's key (blocking: run it in the thread pool)."""
    key = api_key(request.headers)
    if not key:
        raise InferenceError(401, "api_key: missing: send Authorization: Bearer <key> or x-api-key",
                             code="invalid_api_key")
    with request.app.state.sessions() as db:
        tenant = tenant_of_key(db, key)
    if tenant is None:
        raise InferenceError(401, "api_key: invalid, revoked or disabled", code="invalid_api_key")
    return tenant


def resolve(request: Request, tenant: TenantRef, model: str) -> targets.Target:
    with request.app.state.sessions() as db:
        return targets.resolve(request, db, tenant.id, model)


async def json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError as e:
        raise InferenceError(400, f"body: not valid JSON ({e})") from None
    except RecursionError:  # the request guard refuses such a body first (api/input_policy.py)
        raise InferenceError(400, f"body: nested deeper than {input_policy.MAX_JSON_DEPTH} levels") from None


async def check_prompt_size(request: Request, raw: Any, token_prompt: str | None = None) -> None:
    """Refuse a body with more text than the model's context could hold, before anything is tokenised:
    a 10 MB prompt took 8-13 s of CPU and 1.9 GB to tokenise only to be refused for its length. Every
    string of the body counts (messages, system, tools, stop: all of them are stored with the call, and
    what is rendered is at least what they say), against input_policy.prompt_byte_limit. `token_prompt`
    names a field that may hold token ids (/completions' prompt): more ids than the context, refused too."""
    if not isinstance(raw, dict):
        return  # the route's parse refuses it
    # `model` is resolved after this check: the base model it names, else (a checkpoint's) the largest bound
    named = served(request).find(raw["model"]) if isinstance(raw.get("model"), str) else None
    infos = [named.info] if named is not None else [model.info for model in served(request).all]
    max_context = max(info.max_context for info in infos)
    if token_prompt is not None:
        prompt = raw.get(token_prompt)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list) and len(prompt) > max_context and all(type(t) is int for t in prompt[:16]):
            raise InferenceError(400, f"{token_prompt}: {len(prompt)} token ids; the model's context is "
                                      f"{max_context}")
    limit = 0
    for info in infos:
        per_token = await run_in_threadpool(rendering.max_token_bytes, str(info.path))
        limit = max(limit, input_policy.prompt_byte_limit(info.max_context, per_token))
    field, size = input_policy.largest_text_field(raw)
    if size > limit:
        raise InferenceError(400, f"{field}: {size} bytes of text in the request; no more than {limit} can fit "
                                  f"the model's context of {max_context} tokens")


async def answer(request: Request, work: Callable[[], Awaitable[Response]],
                 shape: ErrorShaper = error_response) -> Response:
    """`work`'s response, or its refusal in the API's error shape (OpenAI's unless `shape` says otherwise)."""
    try:
        return await work()
    except HTTPException as e:
        return shape(request.app.state.settings, e)


@dataclass(frozen=True)
class Call:
    """One inference call, parsed and rendered: what is sampled and how it is recorded."""

    api: str  # the rollout store's name for the API ("chat.completions", "anthropic.messages", ...)
    model: str  # as the request named it
    raw: dict  # the request body as it came, stored with the turn
    target: targets.Target
    prompt: list[int]
    n: int
    options: SamplingOptions
    session: str | None  # the trajectory, by the caller's name; None: one of its own
    topk: int  # top-k logprobs width per sampled token
    parse_tools: bool  # take tool calls out of the text (the call passed tools)


async def render_for(request: Request, tenant: TenantRef, model: str, messages: list[dict],
                     tools: list[dict] | None) -> tuple[targets.Target, list[int]]:
    """(the target `model` names, the prompt's tokens): messages and tools in the template's shape,
    rendered with the base model's chat template; a template that renders no tools refuses them."""
    target = await run_in_threadpool(resolve, request, tenant, model)
    info = target.served.info
    tokenizer = await run_in_threadpool(rendering.tokenizer_of, str(info.path))
    if tools:
        rendering.check_tools(tokenizer, tools, info.name)
    prompt = await run_in_threadpool(rendering.render_chat, tokenizer, messages, tools, info.name)
    return target, prompt


def openai_call(request: Request, body: params.InferenceRequest, raw: dict, api: str, target: targets.Target,
                prompt: list[int], topk: int, parse_tools: bool, structural_tag: str | None = None) -> Call:
    """A Call from an OpenAI chat/completions body (its session and sampling fields; `structural_tag`: the
    grammar of its forced or strict tool calls, tool_grammar.py)."""
    info, settings = target.served.info, request.app.state.settings
    options = params.sampling_options(body, len(prompt), info.max_context, settings.sampler_max_samples)
    return Call(api=api, model=body.model, raw=raw, target=target, prompt=prompt, n=body.n,
                options=dataclasses.replace(options, structural_tag=structural_tag),
                session=params.session_of(request.headers.get(SESSION_HEADER), body), topk=topk,
                parse_tools=parse_tools)


def sampling_options(target: targets.Target, prompt_len: int, *, max_tokens: int | None, max_tokens_field: str,
                     prompt_field: str, temperature: float | None, top_p: float | None, top_k: int | None,
                     stop: tuple[str, ...] = (), seed: int | None = None,
                     structural_tag: str | None = None) -> SamplingOptions:
    """One sample's options from an API's own fields, refusing in their names what the context cannot hold
    (params.sampling_options does the same for OpenAI's chat/completions bodies)."""
    max_context = target.served.info.max_context
    room = max_context - prompt_len
    if room < 1:
        raise InferenceError(400, f"{prompt_field}: the prompt is {prompt_len} tokens; the model's context is "
                                  f"{max_context}")
    if max_tokens is not None and max_tokens > room:
        raise InferenceError(400, f"{max_tokens_field}: prompt ({prompt_len}) + {max_tokens_field} ({max_tokens}) "
                                  f"exceed the model's context of {max_context} tokens")
    return SamplingOptions(max_tokens=room if max_tokens is None else max_tokens,
                           temperature=SAMPLING_DEFAULTS.temperature if temperature is None else temperature,
                           top_k=SAMPLING_DEFAULTS.top_k if top_k in (None, 0, -1) else top_k,
                           top_p=SAMPLING_DEFAULTS.top_p if top_p is None else top_p,
                           seed=seed, stop_strings=stop, structural_tag=structural_tag)


def session_named(*named: tuple[str, str | None]) -> str | None:
    """The first (field, value) that names a trajectory, checked as params.session_of checks it; None: the
    call is a trajectory of its own."""
    for field, value in named:
        if value is None:
            continue
        if not isinstance(value, str) or not params._SESSION.match(value):
            raise InferenceError(400, f"{field}: a session id is 1-200 letters, digits or ._:@+=- characters")
        return value
    return None


def record(request: Request, tenant: TenantRef, call: Call, generation: Generation, turn_id: str,
           build: Callable[..., dict]) -> tuple[dict, str, int]:
    """Build the answer from the generation and store it as the trajectory's next turn (blocking):
    (the answer, the trajectory's session id, the turn's number)."""
    info = call.target.served.info
    tokenizer, model_path = rendering.tokenizer_of(str(info.path)), str(info.path)
    completions = [rendering.completion_of(tokenizer, model_path, list(seq.tokens), seq.stop_reason,
                                           call.options.stop_strings, call.parse_tools)
                   for seq in generation.sequences]
    built = build(response_id=turn_id, model=call.model, fingerprint=f"loraplex-{call.target.version_label}",
                  prompt_len=len(call.prompt), cached=generation.cached_prompt_tokens,
                  sequences=generation.sequences, completions=completions, tokenizer=tokenizer)
    choices = [rollouts.SampledChoice(seq.tokens, seq.logprobs, done.finish_reason)
               for seq, done in zip(generation.sequences, completions)]
    target = call.target
    stored = rollouts.NewTurn(
        id=turn_id, api=call.api, model=call.model, sampler_path=target.sampler_path,
        adapter_path=target.adapter_path, policy_version=target.policy_version, request_id=generation.request_id,
        prompt=call.prompt, choices=choices, request_body=call.raw, response_body=built)
    return (built, *rollouts.record_turn(request.app.state.sessions, tenant.id, call.session, stored))


def turn_headers(session_id: str, turn: int, target: targets.Target) -> dict[str, str]:
    """Where the call was recorded, on every answer."""
    return {SESSION_HEADER: session_id, "X-Loraplex-Turn": str(turn),
            "X-Loraplex-Policy-Version": target.version_label}


async def sample_and_record(request: Request, tenant: TenantRef, call: Call, build: Callable[..., dict],
                            turn_id: str | None = None) -> Response:
    """Generate, build the answer (`build(response_id=, model=, fingerprint=, prompt_len=, cached=,
    sequences=, completions=, tokenizer=)`), record it as the next turn of its trajectory, send it."""
    generation = await generate(request, tenant.id, call.target, call.prompt, call.n, call.options, call.topk)
    built, session_id, turn = await run_in_threadpool(record, request, tenant, call, generation,
                                                      turn_id or new_id(), build)
    return JSONResponse(built, headers=turn_headers(session_id, turn, call.target))
