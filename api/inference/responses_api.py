"""OpenAI Responses under /oai/api/v1 (the `openai` SDK's `client.responses`):

    POST /oai/api/v1/responses        input items rendered with the base model's chat template, one sample;
                                      stream: true sends the Responses events (responses_stream.py)
    GET  /oai/api/v1/responses/{id}   a stored response, as it was answered

`previous_response_id` is served from the rollout store, scoped to the tenant: the earlier responses'
inputs and outputs (the whole chain) are the conversation before this input, and the new call is the
next turn of the previous one's trajectory (unless X-Loraplex-Session names another). Calls are
recorded as api "responses"; a response's id is "resp_" + its turn's id. Parameters: responses_params.py.
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from api.inference import calls, responses_params, tool_grammar
from api.inference.errors import InferenceError
from api.input_policy import readable
from db.models import RolloutTrajectory, RolloutTurn

router = APIRouter(prefix="/oai/api/v1")
API = "responses"
PREFIX = "resp_"
# A conversation chained further back than this is refused rather than walked without end.
MAX_CHAIN = 1000


async def _answers():
    """responses_answers.py, imported on first use (it says why), off the event loop."""
    return await run_in_threadpool(importlib.import_module, "api.inference.responses_answers")


def _stored(s, tenant_id: str, response_id: str) -> RolloutTurn | None:
    """The tenant's recorded Responses call `response_id`; another tenant's is one that does not exist."""
    if not response_id.startswith(PREFIX):
        return None
    return s.scalar(sa.select(RolloutTurn).where(RolloutTurn.id == response_id.removeprefix(PREFIX),
                                                 RolloutTurn.tenant_id == tenant_id, RolloutTurn.api == API))


def _history(request: Request, tenant_id: str, previous_id: str) -> tuple[list, str]:
    """(the items of the chain ending at `previous_id`: each call's input then its output, oldest first,
    the trajectory it was recorded in)."""
    chain: list[list] = []
    with request.app.state.sessions() as s:
        turn = _stored(s, tenant_id, previous_id)
        if turn is None:
            raise InferenceError(404, f"previous_response_id: no response {previous_id[:100]!r} was found",
                                 code="previous_response_not_found")
        session_id = s.scalar(sa.select(RolloutTrajectory.session_id).where(RolloutTrajectory.id == turn.trajectory_id))
        while turn is not None:
            if len(chain) == MAX_CHAIN:
                raise InferenceError(400, f"previous_response_id: a chain of more than {MAX_CHAIN} responses")
            # maybe stored before the input policy: answered as readable
            asked, answered = readable(turn.request_body), readable(turn.response_body)
            chain.append(responses_params.input_items(asked["input"]) + answered["output"])
            earlier = asked.get("previous_response_id")
            turn = _stored(s, tenant_id, earlier) if earlier else None
    return [item for items in reversed(chain) for item in items], session_id


@router.post("/responses")
async def create_response(request: Request) -> Response:
    async def work() -> Response:
        answers = await _answers()
        tenant = await run_in_threadpool(calls.authenticate, request)
        raw = await calls.json_body(request)
        await calls.check_prompt_size(request, raw)
        body = responses_params.parse(raw)
        items, previous_session = [], None
        if body.previous_response_id is not None:
            items, previous_session = await run_in_threadpool(_history, request, tenant.id, body.previous_response_id)
            # the chain is rendered too: up to MAX_CHAIN stored calls, each within the limit on its own
            await calls.check_prompt_size(request, {**raw, "previous_response_id": items})
        messages = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
        messages += responses_params.template_messages(items, "previous_response_id") if items else []
        messages += responses_params.template_messages(responses_params.input_items(body.input))
        tools = responses_params.template_tools(body)
        choice = responses_params.tool_choice(body)
        target, prompt = await calls.render_for(request, tenant, body.model, messages, tools)
        grammar = await run_in_threadpool(tool_grammar.structural_tag,  # (xgrammar compiles)
                                          responses_params.grammar_tools(body, tools), choice)
        options = calls.sampling_options(
            target, len(prompt), max_tokens=body.max_output_tokens, max_tokens_field="max_output_tokens",
            prompt_field="input", temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            structural_tag=grammar)
        session = calls.session_named((calls.SESSION_HEADER, request.headers.get(calls.SESSION_HEADER)),
                                      ("previous_response_id", previous_session),
                                      ("metadata.session_id", (body.metadata or {}).get("session_id")),
                                      ("user", body.user))
        call = calls.Call(api=API, model=body.model, raw=raw, target=target, prompt=prompt, n=1, options=options,
                          session=session, topk=0, parse_tools=bool(tools) and choice != "none")

        def build(*, response_id, model, prompt_len, cached, sequences, completions, **_) -> dict:
            [seq], [done] = sequences, completions
            return answers.response(response_id=response_id, model=model, prompt_len=prompt_len, cached=cached,
                                    seq=seq, done=done, body=body, tool_choice=choice)

        if not body.stream:
            return await calls.sample_and_record(request, tenant, call, build)
        from api.inference import event_streams, responses_stream  # (openai is imported by now)

        def events_of(turn_id: str) -> responses_stream.ResponseEvents:
            return responses_stream.ResponseEvents(answers.skeleton(response_id=turn_id, model=body.model, body=body,
                                                                    tool_choice=choice))

        return await event_streams.stream_and_record(request, tenant, call, build, events_of)

    return await calls.answer(request, work)


@router.get("/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> Response:
    async def work() -> Response:
        tenant = await run_in_threadpool(calls.authenticate, request)

        def stored() -> dict | None:
            with request.app.state.sessions() as s:
                turn = _stored(s, tenant.id, response_id)
                return None if turn is None else readable(turn.response_body)  # maybe stored before the policy

        found = await run_in_threadpool(stored)
        if found is None:
            raise InferenceError(404, f"response_id: no response {response_id[:100]!r} was found")
        return JSONResponse(found)

    return await calls.answer(request, work)
