"""The Anthropic Messages API under /anthropic: the `anthropic` SDK works with only `base_url`
(<server>/anthropic) and `api_key` (a tenant's key, sent as x-api-key; a bearer token works too).

    POST /anthropic/v1/messages   messages rendered with the base model's chat template, one sample;
                                  stream: true sends Anthropic's events (anthropic_stream.py)
    POST /anthropic/v1/messages/count_tokens   the prompt's length, rendered the same way
    GET  /anthropic/v1/models     the base model, the caller's sampler checkpoints and policy aliases
                                  (as /oai/api/v1/models), paged by after_id / before_id / limit
    anything else under /anthropic: 404 naming the route, in Anthropic's error shape

Calls are recorded in the rollout store as api "anthropic.messages", with the same X-Loraplex-* answer
headers as the OpenAI routes (openai_api.py). Parameters: anthropic_params.py.
"""

from __future__ import annotations

import functools
import importlib

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from api.inference import anthropic_params, calls, rendering, targets, tool_grammar
from api.inference.errors import InferenceError
from api.public_errors import MAX_ERROR_CHARS, public_error

router = APIRouter(prefix="/anthropic")
SERVED = "POST /anthropic/v1/messages, POST /anthropic/v1/messages/count_tokens, GET /anthropic/v1/models"
ANY_METHOD = ["GET", "POST", "PUT", "PATCH", "DELETE"]
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(settings, exc: HTTPException) -> JSONResponse:
    """A refusal in Anthropic's shape: {"type": "error", "error": {"type", "message"}}; the message starts
    with the field it is about, as every inference route's does."""
    message = public_error(str(exc.detail), settings.checkpoint_dir, settings.store_root)[:MAX_ERROR_CHARS]
    kind = _TYPES.get(exc.status_code, "api_error" if exc.status_code >= 500 else "invalid_request_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}},
                        status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def _answers():
    """anthropic_answers.py, imported on first use (it says why), off the event loop."""
    return await run_in_threadpool(importlib.import_module, "api.inference.anthropic_answers")


async def _render(request: Request, tenant, body: anthropic_params.Conversation):
    """(the target `model` names, the parse_tools flag, the prompt tokens, the grammar of its tool calls
    (tool_grammar.py) or None) of a conversation."""
    messages = anthropic_params.template_messages(body)
    tools = anthropic_params.template_tools(body)
    choice, parallel = anthropic_params.tool_choice(body)
    target, prompt = await calls.render_for(request, tenant, body.model, messages, tools)
    grammar = await run_in_threadpool(functools.partial(tool_grammar.structural_tag, tools, choice,
                                                        parallel=parallel))  # (xgrammar compiles)
    return target, bool(tools) and choice != "none", prompt, grammar


async def _prepare(request: Request):
    """(tenant, the parsed body, the Call to sample) of a Messages request; every refusal raised here."""
    tenant = await run_in_threadpool(calls.authenticate, request)
    raw = await calls.json_body(request)
    await calls.check_prompt_size(request, raw)
    body = anthropic_params.parse(raw)
    target, parse_tools, prompt, grammar = await _render(request, tenant, body)
    options = calls.sampling_options(
        target, len(prompt), max_tokens=body.max_tokens, max_tokens_field="max_tokens", prompt_field="messages",
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, stop=tuple(body.stop_sequences or ()),
        structural_tag=grammar)
    session = calls.session_named((calls.SESSION_HEADER, request.headers.get(calls.SESSION_HEADER)),
                                  ("metadata.user_id", (body.metadata or {}).get("user_id")))
    call = calls.Call(api="anthropic.messages", model=body.model, raw=raw, target=target, prompt=prompt, n=1,
                      options=options, session=session, topk=0, parse_tools=parse_tools)
    return tenant, body, call


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    """The prompt's length as /v1/messages would render it for `model` (not sampled, not recorded)."""
    async def work() -> Response:
        answers = await _answers()
        tenant = await run_in_threadpool(calls.authenticate, request)
        raw = await calls.json_body(request)
        await calls.check_prompt_size(request, raw)
        body = anthropic_params.parse(raw, anthropic_params.Conversation, anthropic_params.COUNT_PARAMETERS)
        _, _, prompt, _ = await _render(request, tenant, body)
        return JSONResponse(answers.token_count(len(prompt)))

    return await calls.answer(request, work, anthropic_error)


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    async def work() -> Response:
        answers = await _answers()
        tenant, body, call = await _prepare(request)
        model_path = str(call.target.served.info.path)
        stops = call.options.stop_strings

        def build(*, response_id, model, prompt_len, cached, sequences, completions, tokenizer, **_) -> dict:
            [seq], [done] = sequences, completions
            needs_text = seq.stop_reason == "stop" and stops and done.finish_reason == "stop"
            full_text = rendering.completion_of(tokenizer, model_path, list(seq.tokens), "stop", (),
                                                False).text if needs_text else None
            reason = answers.stop_reason(done, seq, rendering.end_token_ids(model_path), full_text, stops)
            return answers.message(response_id=response_id, model=model, prompt_len=prompt_len, cached=cached,
                                   seq=seq, done=done, reason=reason)

        if not body.stream:
            return await calls.sample_and_record(request, tenant, call, build)
        # off the event loop: its event streams import openai's package (api/inference/chunks.py)
        anthropic_stream = await run_in_threadpool(importlib.import_module, "api.inference.anthropic_stream")
        from api.inference import event_streams  # (imported with it)

        def events_of(turn_id: str):
            return anthropic_stream.MessageEvents(response_id=turn_id, model=call.model, prompt_len=len(call.prompt))

        return await event_streams.stream_and_record(request, tenant, call, build, events_of)

    return await calls.answer(request, work, anthropic_error)


@router.get("/v1/models")
async def list_models(request: Request, limit: str = "20", after_id: str | None = None,
                      before_id: str | None = None) -> Response:
    async def work() -> Response:
        answers = await _answers()
        tenant = await run_in_threadpool(calls.authenticate, request)
        if not (limit.isdigit() and 1 <= int(limit) <= 1000):
            raise InferenceError(400, f"limit: an integer from 1 to 1000, not {limit[:40]!r}")
        if after_id is not None and before_id is not None:
            raise InferenceError(400, "before_id: give after_id or before_id, not both")

        def listed():
            with request.app.state.sessions() as db:
                return targets.listed_models(request, db, tenant.id)

        models = await run_in_threadpool(listed)
        for field, cursor in (("after_id", after_id), ("before_id", before_id)):
            if cursor is not None and cursor not in {m.id for m in models}:
                raise InferenceError(400, f"{field}: {cursor[:240]!r} is not a listed model")
        return JSONResponse(answers.model_page(models, limit=int(limit), after_id=after_id, before_id=before_id))

    return await calls.answer(request, work, anthropic_error)


@router.api_route("/{route:path}", methods=ANY_METHOD, include_in_schema=False)
async def not_supported(route: str, request: Request) -> Response:
    async def work() -> Response:
        await run_in_threadpool(calls.authenticate, request)
        raise InferenceError(404, f"/anthropic/{route[:100]}: not supported by this server; served: {SERVED}")

    return await calls.answer(request, work, anthropic_error)
