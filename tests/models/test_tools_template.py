"""Tools end to end on a built-in model: `loraplex/tiny-qwen3` carries a chat template that renders tools
(Hermes format, as Qwen's), so `tools` work through the inference proxy's three APIs with the official
SDKs, on a server started as a user starts it. The untrained model writes a call only when made to, so the
calls here are forced (tool_choice named), and the round trip goes on with the tool's result."""

from __future__ import annotations

import itertools
import json

import anthropic
import loraplex
import openai
import pytest
from transformers import AutoTokenizer

from examples import agent_rl
from models.registry import resolve_model
from models.tiny import TOOLS_CHAT_TEMPLATE
from service.embedded import free_port
from tests.inference.tool_calls import QUESTION, TOOLS
from tests.reliability.processes import start_serve, stop, tenant_key

pytestmark = pytest.mark.vllm
MODEL = "loraplex/tiny-qwen3"
ROOM = dict(max_tokens=200, temperature=0.0)  # room for the untrained model's call to close


def test_the_qwen_family_tiny_model_renders_tools_and_the_others_do_not():
    rendered = AutoTokenizer.from_pretrained(resolve_model(MODEL)).apply_chat_template(
        [{"role": "user", "content": QUESTION}], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"name": "add"' in rendered and "<tool_call>" in rendered
    assert AutoTokenizer.from_pretrained(resolve_model("tiny")).chat_template != TOOLS_CHAT_TEMPLATE


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data_dir, port = tmp_path_factory.mktemp("tools"), free_port()
    process = start_serve(data_dir, port, LORAPLEX_BASE_MODEL=MODEL, LORAPLEX_SAMPLER_ENABLED="true",
                          LORAPLEX_SAMPLER_KV_CACHE_GIB="0.25")
    yield f"http://127.0.0.1:{port}", tenant_key(data_dir, "tools")
    stop(process)


def test_a_tool_call_round_trip_through_chat_completions(server):
    base_url, key = server
    client = openai.OpenAI(base_url=f"{base_url}/oai/api/v1", api_key=key, max_retries=0)
    asked = [{"role": "user", "content": QUESTION}]
    free = client.chat.completions.create(model=MODEL, messages=asked, tools=TOOLS, **ROOM)
    assert free.choices[0].finish_reason in ("stop", "length", "tool_calls")  # tools accepted: no 400

    forced = client.chat.completions.create(model=MODEL, messages=asked, tools=TOOLS,
                                            tool_choice={"type": "function", "function": {"name": "add"}}, **ROOM)
    [call] = forced.choices[0].message.tool_calls
    assert call.function.name == "add" and isinstance(json.loads(call.function.arguments), dict)
    answered = client.chat.completions.create(model=MODEL, **ROOM, tools=TOOLS, messages=asked + [
        forced.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "5"}])
    assert answered.choices[0].message.role == "assistant" and answered.usage.prompt_tokens > forced.usage.prompt_tokens


def test_a_tool_call_round_trip_through_anthropic_messages(server):
    base_url, key = server
    client = anthropic.Anthropic(base_url=f"{base_url}/anthropic", api_key=key, max_retries=0)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    asked = [{"role": "user", "content": QUESTION}]
    forced = client.messages.create(model=MODEL, max_tokens=200, messages=asked, tools=tools,
                                    tool_choice={"type": "tool", "name": "add"})
    [use] = [block for block in forced.content if block.type == "tool_use"]
    assert use.name == "add" and isinstance(use.input, dict) and forced.stop_reason == "tool_use"
    answered = client.messages.create(model=MODEL, max_tokens=20, tools=tools, messages=asked + [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in forced.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}])
    assert answered.role == "assistant" and prompt_tokens(answered) > prompt_tokens(forced)  # the call and result went in


def prompt_tokens(message) -> int:
    return message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)  # (prefix caching reads some)


def test_a_forced_call_through_responses(server):
    base_url, key = server
    client = openai.OpenAI(base_url=f"{base_url}/oai/api/v1", api_key=key, max_retries=0)
    tools = [{"type": "function", "name": "add", "description": "a + b",
              "parameters": TOOLS[0]["function"]["parameters"]}]
    answer = client.responses.create(model=MODEL, input=QUESTION, tools=tools, max_output_tokens=200,
                                     temperature=0.0, tool_choice={"type": "function", "name": "add"})
    [call] = [item for item in answer.output if item.type == "function_call"]
    assert call.name == "add" and isinstance(json.loads(call.arguments), dict)



def test_the_agent_example_calls_its_calculator_as_a_tool(server, tmp_path, monkeypatch):
    """examples/agent_rl.py on a model whose template renders tools: `auto` picks OpenAI tool calls, every
    episode's first turn is a parsed call answered by a tool message (so each runs its two turns), and the
    GRPO step trains on what the store recorded."""
    base_url, key = server
    # the untrained model solves nothing: alternate the rewards, so that every group of three disagrees
    rewards = itertools.cycle((0.0, 1.0))
    monkeypatch.setattr(agent_rl, "score", lambda problem, episode, bonus: next(rewards))
    summary = agent_rl.run(loraplex.ServiceClient(base_url=base_url, api_key=key), MODEL, steps=1,
                           prompts_per_step=2, group_size=3, max_turns=2, max_tokens=256, held_out=2,
                           eval_every=1, results=tmp_path)
    assert summary["protocol"] == "tools"
    [_, step] = [json.loads(line) for line in (tmp_path / "agent_rl.jsonl").read_text().splitlines()]
    assert step["turns"] == 2.0  # turn 1's forced call was parsed and answered in every episode
    assert step["datums"] > 0 and step["policy_version"] == 1 and step["stale_turns"] == 0
