"""OpenAI-compatible routes under /oai/api/v1: the `openai` SDK works with only `base_url` and `api_key`.

    POST /oai/api/v1/chat/completions   messages rendered with the base model's chat template
    POST /oai/api/v1/completions        a prompt string or token ids (token-in/token-out)
    GET  /oai/api/v1/models             the base model, the caller's sampler checkpoints and policy aliases
    anything else under /oai/api/v1: 404 naming the route, "not supported yet"
(POST/GET /oai/api/v1/responses: responses_api.py, registered before this router's catch-all; the
Anthropic Messages API: anthropic_api.py)

The key is the tenant's: `Authorization: Bearer tml-...` (the openai SDK) or `x-api-key`. Each call
answers with headers naming where it was recorded: X-Loraplex-Session (its trajectory), X-Loraplex-Turn
and X-Loraplex-Policy-Version ("v3", or "base").
"""

from __future__ import annotations

import importlib

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from api.inference import calls, params, rendering, targets, tool_grammar
from api.inference.errors import InferenceError

router = APIRouter(prefix="/oai/api/v1")
SERVED = "POST /chat/completions, POST /completions, POST /responses, GET /responses/{id}, GET /models"
ANY_METHOD = ["GET", "POST", "PUT", "PATCH", "DELETE"]


async def _responses():
    """api/inference/responses.py, imported on first use (it says why), off the event loop."""
    return await run_in_threadpool(importlib.import_module, "api.inference.responses")


def _include_usage(body: params.InferenceRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    async def work() -> Response:
        responses = await _responses()
        tenant = await run_in_threadpool(calls.authenticate, request)
        raw = await calls.json_body(request)
        await calls.check_prompt_size(request, raw)
        body: params.ChatRequest = params.parse(params.ChatRequest, raw, params.CHAT_PARAMETERS)
        tools = body.tools or None
        target, prompt = await calls.render_for(request, tenant, body.model,
                                                rendering.template_messages(body.messages), tools)
        topk = (body.top_logprobs or 0) if body.logprobs else 0

        def build(**common) -> dict:
            return responses.chat_completion(**common, logprobs=bool(body.logprobs), top_logprobs=topk,
                                             as_ids=body.return_tokens_as_token_ids)

        choice = body.tool_choice or "auto"
        grammar = await run_in_threadpool(tool_grammar.structural_tag, tools, choice)  # (xgrammar compiles)
        call = calls.openai_call(request, body, raw, "chat.completions", target, prompt, topk,
                                 bool(tools) and choice != "none", grammar)
        if body.stream:
            from api.inference import chunks, streaming  # (openai is imported by now)

            def chat_chunks(response_id: str) -> chunks.ChatChunks:
                return chunks.ChatChunks(
                    response_id=response_id, model=body.model, fingerprint=f"loraplex-{target.version_label}",
                    tokenizer=rendering.tokenizer_of(str(target.served.info.path)),
                    logprobs=bool(body.logprobs), top_logprobs=topk,
                    as_ids=body.return_tokens_as_token_ids, include_usage=_include_usage(body))

            return await streaming.stream_and_record(request, tenant, call, build, chat_chunks)
        return await calls.sample_and_record(request, tenant, call, build)

    return await calls.answer(request, work)


@router.post("/completions")
async def completions(request: Request) -> Response:
    async def work() -> Response:
        responses = await _responses()
        tenant = await run_in_threadpool(calls.authenticate, request)
        raw = await calls.json_body(request)
        await calls.check_prompt_size(request, raw, token_prompt="prompt")
        body: params.CompletionRequest = params.parse(params.CompletionRequest, raw, params.COMPLETION_PARAMETERS)
        target = await run_in_threadpool(calls.resolve, request, tenant, body.model)
        info = target.served.info
        tokenizer = await run_in_threadpool(rendering.tokenizer_of, str(info.path))
        prompt = await run_in_threadpool(rendering.prompt_tokens, tokenizer, body.prompt, info.vocab_size)
        topk = body.logprobs or 0

        def build(**common) -> dict:
            return responses.text_completion(**common, logprobs=body.logprobs, as_ids=body.return_tokens_as_token_ids)

        call = calls.openai_call(request, body, raw, "completions", target, prompt, topk, False)
        if body.stream:
            from api.inference import chunks, streaming  # (openai is imported by now)

            def text_chunks(response_id: str) -> chunks.TextChunks:
                return chunks.TextChunks(
                    response_id=response_id, model=body.model, fingerprint=f"loraplex-{target.version_label}",
                    tokenizer=tokenizer, logprobs=body.logprobs, as_ids=body.return_tokens_as_token_ids,
                    include_usage=_include_usage(body))

            return await streaming.stream_and_record(request, tenant, call, build, text_chunks)
        return await calls.sample_and_record(request, tenant, call, build)

    return await calls.answer(request, work)


@router.get("/models")
async def list_models(request: Request) -> Response:
    async def work() -> Response:
        responses = await _responses()
        tenant = await run_in_threadpool(calls.authenticate, request)

        def names() -> list[str]:
            with request.app.state.sessions() as db:
                return targets.listed_models(request, db, tenant.id)

        return JSONResponse(responses.model_list(await run_in_threadpool(names)))

    return await calls.answer(request, work)


@router.api_route("/{route:path}", methods=ANY_METHOD, include_in_schema=False)
async def not_supported(route: str, request: Request) -> Response:
    async def work() -> Response:
        await run_in_threadpool(calls.authenticate, request)
        raise InferenceError(404, f"/oai/api/v1/{route[:100]}: not supported by this server yet; "
                                  f"served: {SERVED}")

    return await calls.answer(request, work)

