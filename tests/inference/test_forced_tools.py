"""Forced and strict tool calls through the real `openai` and `anthropic` SDKs: tool_choice required or
named (Anthropic's any / tool) and Responses' strict tools hold the answer to Hermes' tool-call format with a
grammar in the sampler's vLLM. The tiny base model knows no tool format, so a call from it is the grammar's
doing; `tool_lora` learnt the format, and forcing it changes none of its tokens (the grammar is the format)."""

from __future__ import annotations

import json

import anthropic
import loraplex
import openai
import pytest

from api.inference import rendering
from tests.inference.tool_calls import HERMES_TEMPLATE, QUESTION, TOOLS

pytestmark = pytest.mark.vllm  # the package's server runs the vLLM sampler

MESSAGES = [{"role": "user", "content": QUESTION}]
CALL_START = '<tool_call>\n{"name": "add", "arguments": '
NAMED = {"type": "function", "function": {"name": "add"}}
# long enough for the untrained model's call to close (it pads the arguments with whitespace)
ROOM = dict(max_tokens=200, temperature=0.0)


@pytest.fixture
def hermes(tokenizer, monkeypatch):
    """The server's tokenizer with a template that renders tools (the tiny model's own renders none)."""
    monkeypatch.setattr(tokenizer, "chat_template", HERMES_TEMPLATE)
    return tokenizer


def openai_client(server, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/oai/api/v1", api_key=api_key, max_retries=0)


def stored_text(store: loraplex.RolloutsClient, session: str, tokenizer) -> str:
    [turn] = store.get_trajectory(session).turns
    return tokenizer.decode(turn.samples[0].tokens)


def test_a_forced_call_comes_from_a_model_that_knows_no_tool_format(server, api_key, store, hermes):
    client = openai_client(server, api_key)
    free = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, **ROOM)
    assert free.choices[0].message.tool_calls is None  # unforced, the base model writes no call

    for choice, session in ((NAMED, "named"), ("required", "required")):
        answer = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                                extra_headers={"X-Loraplex-Session": session}, **ROOM)
        [call] = answer.choices[0].message.tool_calls
        assert call.function.name == "add" and isinstance(json.loads(call.function.arguments), dict)
        assert answer.choices[0].finish_reason == "tool_calls"
        # what was sampled and stored is the template's own call format, from its first token
        assert stored_text(store, session, hermes).startswith(CALL_START)

    streamed = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                              stream=True, **ROOM)
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    [call] = [t for d in deltas for t in d.tool_calls or ()]
    assert call.function.name == "add"


def test_forcing_a_model_that_calls_anyway_changes_none_of_its_tokens(server, tool_lora, hermes):
    client = openai_client(server, tool_lora.api_key)
    store = loraplex.RolloutsClient(loraplex.ServiceClient(base_url=server.base_url, api_key=tool_lora.api_key))
    for choice, session in (("auto", "lora-auto"), ("required", "lora-required"), (NAMED, "lora-named")):
        answer = client.chat.completions.create(model=tool_lora.model, messages=MESSAGES, tools=TOOLS,
                                                tool_choice=choice, extra_headers={"X-Loraplex-Session": session},
                                                **ROOM)
        [call] = answer.choices[0].message.tool_calls
        assert (call.function.name, call.function.arguments) == ("add", '{"a": 2, "b": 3}')
        [turn] = store.get_trajectory(session).turns
        assert turn.samples[0].tokens == tool_lora.call + [hermes.eos_token_id]


def test_responses_strict_tools_and_tool_choice(server, api_key, store, hermes):
    client = openai_client(server, api_key)
    strict = [{"type": "function", "strict": True, **t["function"]} for t in TOOLS]
    for choice in ("required", {"type": "function", "name": "add"}):
        answer = client.responses.create(model="tiny", input=QUESTION, tools=strict, tool_choice=choice,
                                         max_output_tokens=200, temperature=0.0)
        [item] = [o for o in answer.output if o.type == "function_call"]
        arguments = json.loads(item.arguments)
        assert item.name == "add" and set(arguments) <= {"a", "b"}  # its schema's properties
        assert all(isinstance(v, int) for v in arguments.values())
        assert answer.tools[0].strict is True and answer.tool_choice is not None
    with client.responses.stream(model="tiny", input=QUESTION, tools=strict, tool_choice="required",
                                 max_output_tokens=200, temperature=0.0) as stream:
        final = stream.get_final_response()
    assert [o.name for o in final.output if o.type == "function_call"] == ["add"]


def test_anthropic_tool_choice_any_and_tool(server, api_key, hermes):
    client = anthropic.Anthropic(base_url=f"{server.base_url}/anthropic", api_key=api_key, max_retries=0)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    for choice in ({"type": "any"}, {"type": "tool", "name": "add", "disable_parallel_tool_use": True}):
        answer = client.messages.create(model="tiny", max_tokens=200, messages=MESSAGES, tools=tools,
                                        tool_choice=choice, extra_body={"temperature": 0.0})
        assert answer.stop_reason == "tool_use"
        assert [b.name for b in answer.content if b.type == "tool_use"] == ["add"]


def test_refusals_name_the_field(server, api_key, hermes):
    client = openai_client(server, api_key)
    for fields, message in ((dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "mul"}}),
                             "no tool is named 'mul'"),
                            (dict(tool_choice="required"), "needs tools"),
                            (dict(tools=TOOLS, tool_choice={"type": "allowed_tools", "mode": "auto", "tools": []}),
                             '{"type": "function", ...}'),
                            (dict(tools=[{"type": "function", "function": {"name": "add", "parameters": {
                                "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}],
                                  tool_choice="required"), 'Unsupported type "no-such-type"')):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **fields)
        assert refused.value.body["param"] in ("tool_choice", "tools") and message in refused.value.body["message"]
