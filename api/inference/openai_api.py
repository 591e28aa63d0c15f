"""OpenAI-compatible routes under /oai/api/v1: the `openai` SDK works with only `base_url` and `api_key`.

    POST /oai/api/v1/chat/completions   messages rendered with the base model's chat template
    POST /oai/api/v1/completions        a prompt string or token ids (token-in/token-out)
    GET  /oai/api/v1/models             the base model, the caller's sampler checkpoints and policy aliases
    anything else under /oai/api/v1, and /anthropic/...: 404 naming the route, "not supported yet"

The key is the tenant's: `Authorization: Bearer tml-...` (the openai SDK) or `x-api-key`. Each call
answers with headers naming where it was recorded: X-Loraplex-Session (its trajectory), X-Loraplex-Turn
and X-Loraplex-Policy-Version ("v3", or "base").
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from api.deps import TenantRef, tenant_of_key
from api.inference import params, rendering, targets
from api.inference.errors import InferenceError, error_response
from api.inference.generate import Generation, generate
from api.inference.keys import api_key
from db import rollouts
from db.models import new_id

router = APIRouter(prefix="/oai/api/v1")
anthropic_router = APIRouter(prefix="/anthropic")
SESSION_HEADER = "X-Loraplex-Session"
SERVED = "POST /chat/completions, POST /completions, GET /models"
ANY_METHOD = ["GET", "POST", "PUT", "PATCH", "DELETE"]


def _authenticate(request: Request) -> TenantRef:
    key = api_key(request.headers)
    if not key:
        raise InferenceError(401, "api_key: missing: send Authorization: Bearer <key> or x-api-key",
                             code="invalid_api_key")
    with request.app.state.sessions() as db:
        tenant = tenant_of_key(db, key)
    if tenant is None:
        raise InferenceError(401, "api_key: invalid, revoked or disabled", code="invalid_api_key")
    return tenant


def _resolve(request: Request, tenant: TenantRef, model: str) -> targets.Target:
    with request.app.state.sessions() as db:
        return targets.resolve(request, db, tenant.id, model)


async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError as e:
        raise InferenceError(400, f"body: not valid JSON ({e})") from None


async def _responses():
    """api/inference/responses.py, imported on first use (it says why), off the event loop."""
    return await run_in_threadpool(importlib.import_module, "api.inference.responses")


async def _answer(request: Request, work: Callable[[], Awaitable[Response]]) -> Response:
    """Every refusal in OpenAI's error shape (api/inference/errors.py)."""
    try:
        return await work()
    except HTTPException as e:
        return error_response(request.app.state.settings, e)


async def _sample_and_record(request: Request, tenant: TenantRef, body: params.InferenceRequest, raw: dict,
                             api: str, target: targets.Target, prompt: list[int], topk: int, parse_tools: bool,
                             build: Callable[..., dict]) -> Response:
    """Generate, build the answer, record it as the next turn of its trajectory, send it."""
    session = params.session_of(request.headers.get(SESSION_HEADER), body)
    info, settings = request.app.state.model_info, request.app.state.settings
    options = params.sampling_options(body, len(prompt), info.max_context, settings.sampler_max_samples)
    generation: Generation = await generate(request, tenant.id, target, prompt, body.n, options, topk)
    tokenizer, model_path = rendering.tokenizer_of(str(info.path)), str(info.path)
    turn_id = new_id()

    def answer_and_record() -> tuple[dict, str, int]:
        completions = [rendering.completion_of(tokenizer, model_path, list(seq.tokens), seq.stop_reason,
                                               options.stop_strings, parse_tools) for seq in generation.sequences]
        answer = build(response_id=turn_id, model=body.model, fingerprint=f"loraplex-{target.version_label}",
                       prompt_len=len(prompt), cached=generation.cached_prompt_tokens,
                       sequences=generation.sequences, completions=completions, tokenizer=tokenizer)
        choices = [rollouts.SampledChoice(seq.tokens, seq.logprobs, done.finish_reason)
                   for seq, done in zip(generation.sequences, completions)]
        stored = rollouts.NewTurn(
            id=turn_id, api=api, model=body.model, sampler_path=target.sampler_path, adapter_path=target.adapter_path,
            policy_version=target.policy_version, request_id=generation.request_id, prompt=prompt, choices=choices,
            request_body=raw, response_body=answer)
        return (answer, *rollouts.record_turn(request.app.state.sessions, tenant.id, session, stored))

    answer, session_id, turn = await run_in_threadpool(answer_and_record)
    return JSONResponse(answer, headers={SESSION_HEADER: session_id, "X-Loraplex-Turn": str(turn),
                                         "X-Loraplex-Policy-Version": target.version_label})


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    async def work() -> Response:
        responses = await _responses()
        tenant = await run_in_threadpool(_authenticate, request)
        raw = await _json_body(request)
        body: params.ChatRequest = params.parse(params.ChatRequest, raw, params.CHAT_PARAMETERS)
        info = request.app.state.model_info
        messages = rendering.template_messages(body.messages)
        target = await run_in_threadpool(_resolve, request, tenant, body.model)
        tokenizer = await run_in_threadpool(rendering.tokenizer_of, str(info.path))
        tools = body.tools or None
        if tools:
            rendering.check_tools(tokenizer, tools, info.name)
        prompt = await run_in_threadpool(rendering.render_chat, tokenizer, messages, tools, info.name)
        topk = (body.top_logprobs or 0) if body.logprobs else 0

        def build(**common) -> dict:
            return responses.chat_completion(**common, logprobs=bool(body.logprobs), top_logprobs=topk,
                                             as_ids=body.return_tokens_as_token_ids)

        return await _sample_and_record(request, tenant, body, raw, "chat.completions", target, prompt, topk,
                                        bool(tools) and body.tool_choice != "none", build)

    return await _answer(request, work)


@router.post("/completions")
async def completions(request: Request) -> Response:
    async def work() -> Response:
        responses = await _responses()
        tenant = await run_in_threadpool(_authenticate, request)
        raw = await _json_body(request)
        body: params.CompletionRequest = params.parse(params.CompletionRequest, raw, params.COMPLETION_PARAMETERS)
        info = request.app.state.model_info
        target = await run_in_threadpool(_resolve, request, tenant, body.model)
        tokenizer = await run_in_threadpool(rendering.tokenizer_of, str(info.path))
        prompt = await run_in_threadpool(rendering.prompt_tokens, tokenizer, body.prompt, info.vocab_size)
        topk = body.logprobs or 0

        def build(**common) -> dict:
            return responses.text_completion(**common, logprobs=body.logprobs, as_ids=body.return_tokens_as_token_ids)

        return await _sample_and_record(request, tenant, body, raw, "completions", target, prompt, topk, False, build)

    return await _answer(request, work)


@router.get("/models")
async def list_models(request: Request) -> Response:
    async def work() -> Response:
        responses = await _responses()
        tenant = await run_in_threadpool(_authenticate, request)

        def names() -> list[str]:
            with request.app.state.sessions() as db:
                return targets.listed_models(request, db, tenant.id)

        return JSONResponse(responses.model_list(await run_in_threadpool(names)))

    return await _answer(request, work)


@router.api_route("/{route:path}", methods=ANY_METHOD, include_in_schema=False)
async def not_supported(route: str, request: Request) -> Response:
    async def work() -> Response:
        await run_in_threadpool(_authenticate, request)
        later = " (OpenAI Responses: a later version)" if route.startswith("responses") else ""
        raise InferenceError(404, f"/oai/api/v1/{route[:100]}: not supported by this server yet{later}; "
                                  f"served: {SERVED}")

    return await _answer(request, work)


@anthropic_router.api_route("/{route:path}", methods=ANY_METHOD, include_in_schema=False)
async def anthropic_not_supported(route: str, request: Request) -> Response:
    """In Anthropic's error shape, so the anthropic SDK shows the message; authenticated like every route."""
    try:
        await run_in_threadpool(_authenticate, request)
    except InferenceError as e:
        return JSONResponse({"type": "error", "error": {"type": "authentication_error", "message": e.detail}},
                            status_code=e.status_code)
    message = (f"/anthropic/{route[:100]}: the Anthropic Messages API is not supported by this server yet; "
               "the OpenAI-compatible one is, under /oai/api/v1")
    return JSONResponse({"type": "error", "error": {"type": "not_found_error", "message": message}}, status_code=404)
