"""The Anthropic Messages and OpenAI Responses request bodies: every parameter of the official SDKs is
known (used, accepted at a neutral value, or refused naming it), and content becomes the chat template's
messages. No server: the routes themselves are tested in test_anthropic_api.py and test_responses_api.py."""

from __future__ import annotations

import pytest
from anthropic.types.message_count_tokens_params import MessageCountTokensParams
from anthropic.types.message_create_params import MessageCreateParamsStreaming
from openai.types.responses.response_create_params import ResponseCreateParamsStreaming

from api.inference import anthropic_params, responses_params
from api.inference.errors import InferenceError

BASE = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def refusal(parse, body) -> str:
    with pytest.raises(InferenceError) as caught:
        parse(body)
    assert caught.value.status_code == 400
    return caught.value.detail


def test_the_parameter_lists_are_the_sdks_own():
    assert anthropic_params.PARAMETERS == set(MessageCreateParamsStreaming.__annotations__) | {
        "temperature", "top_p", "top_k"}  # older models' sampling fields, still sent by harnesses
    assert anthropic_params.COUNT_PARAMETERS == set(MessageCountTokensParams.__annotations__)
    assert responses_params.PARAMETERS == set(ResponseCreateParamsStreaming.__annotations__)


@pytest.mark.parametrize("extra, field", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"container": "c"}, "container"), ({"guided_choice": ["a"]}, "guided_choice"),
    ({"temperature": 1.5}, "temperature"), ({"stop_sequences": [""]}, "stop_sequences[0]"),
    ({"tool_choice": {"type": "all"}}, "tool_choice"), ({"metadata": {"user_id": "u", "x": "y"}}, "metadata.x"),
    ({"tool_choice": {"type": "auto", "disable_parallel_tool_use": 1}}, "tool_choice.disable_parallel_tool_use"),
])
def test_anthropic_refusals_name_the_field(extra, field):
    assert refusal(anthropic_params.parse, BASE | extra).startswith(f"{field}: ")
    assert refusal(anthropic_params.parse, {k: v for k, v in BASE.items() if k != "max_tokens"}).startswith(
        "max_tokens: ")


def test_anthropic_blocks_become_template_messages():
    body = anthropic_params.parse(BASE | {"system": [{"type": "text", "text": "Be brief."}], "messages": [
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Adding."},
                                          {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 2, "b": 3}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "5"}]}, {"type": "text", "text": "Thanks", "cache_control": {"type": "ephemeral"}}]},
    ]})
    assert anthropic_params.template_messages(body) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": "Adding.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "5"}, {"role": "user", "content": "Thanks"}]
    image = BASE | {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}
    with pytest.raises(InferenceError, match=r"^400: messages\[0\]\.content\[0\]\.type: "):
        anthropic_params.template_messages(anthropic_params.parse(image))
    tools = anthropic_params.parse(BASE | {"tools": [{"name": "add", "input_schema": {"type": "object"}}]})
    assert anthropic_params.template_tools(tools) == [
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("extra, field", [
    ({"store": False}, "store"), ({"tool_choice": "always"}, "tool_choice"), ({"reasoning": {"effort": "low"}},
                                                                                 "reasoning"),
    ({"temperature": 3}, "temperature"), ({"min_p": 0.1}, "min_p"), ({"conversation": "c"}, "conversation"),
])
def test_responses_refusals_name_the_field(extra, field):
    assert refusal(responses_params.parse, {"model": "tiny", "input": "hi"} | extra).startswith(f"{field}: ")


def test_responses_items_become_template_messages():
    items = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "input_text", "text": "2 + 3?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed", "content": [
            {"type": "output_text", "text": "Adding.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call_output", "call_id": "c1", "output": "5"}]
    assert responses_params.template_messages(items) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": "Adding.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    with pytest.raises(InferenceError, match=r"^400: input\[0\]\.type: "):
        responses_params.template_messages([{"type": "reasoning", "summary": []}])
    # strict is the grammar's business, not the template's: absent means true, as on OpenAI
    body = responses_params.parse({"model": "tiny", "input": "hi", "tools": [
        {"type": "function", "name": "add", "parameters": {}, "strict": False}, {"type": "function", "name": "f"}]})
    tools = responses_params.template_tools(body)
    assert tools == [{"type": "function", "function": {"name": "add", "parameters": {}}},
                     {"type": "function", "function": {"name": "f"}}]
    assert [t["function"]["strict"] for t in responses_params.grammar_tools(body, tools)] == [False, True]
    with pytest.raises(InferenceError, match=r"^400: tools\[0\]\.strict: "):
        responses_params.template_tools(responses_params.parse({"model": "tiny", "input": "hi", "tools": [
            {"type": "function", "name": "add", "strict": "yes"}]}))
