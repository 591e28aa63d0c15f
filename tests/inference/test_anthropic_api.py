"""The official `anthropic` SDK, with only `base_url` and `api_key` set, against a real embedded server on
the tiny model and its multi-LoRA vLLM sampler: POST /anthropic/v1/messages, recorded in the rollout store."""

from __future__ import annotations

import anthropic
import httpx
import loraplex
import pytest

from api.inference import rendering
from tests.inference.tool_calls import HERMES_TEMPLATE

pytestmark = pytest.mark.vllm  # the package's server runs the vLLM sampler

QUESTION = "What is 2 + 3?"
MESSAGES = [{"role": "user", "content": QUESTION}]
TOOLS = [{"name": "add", "description": "a + b", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]


@pytest.fixture(scope="module")
def client(server, api_key) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"{server.base_url}/anthropic", api_key=api_key, max_retries=0)


def test_a_message_is_answered_and_recorded_token_for_token(client, store, tokenizer, model_path):
    raw = client.messages.with_raw_response.create(
        model="tiny", max_tokens=8, system="Be brief.", messages=MESSAGES, metadata={"user_id": "plain"},
        extra_body={"temperature": 1.0, "top_k": 20})
    answer = raw.parse()
    assert isinstance(answer, anthropic.types.Message) and answer.role == "assistant" and answer.model == "tiny"
    assert (raw.headers["X-Loraplex-Session"], raw.headers["X-Loraplex-Turn"]) == ("plain", "0")  # metadata.user_id
    [stored] = store.get_trajectory("plain").turns
    [sample] = stored.samples
    prompt = rendering.render_chat(tokenizer, [{"role": "system", "content": "Be brief."}, *MESSAGES], None, "tiny")
    assert stored.prompt_tokens == prompt and stored.api == "anthropic.messages" and stored.id == answer.id[4:]
    # what the answer reports is what was stored (Anthropic counts prompt-cache reads apart from input_tokens)
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == len(prompt)
    assert answer.usage.output_tokens == len(sample.tokens)
    assert answer.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[sample.finish_reason]
    text = rendering.completion_of(tokenizer, model_path, sample.tokens, "length" if answer.stop_reason ==
                                   "max_tokens" else "stop", (), False).text
    assert [block.text for block in answer.content] == ([text] if text else [])
    assert stored.request["metadata"] == {"user_id": "plain"} and stored.response["id"] == answer.id
    assert client.messages.count_tokens(model="tiny", system="Be brief.", messages=MESSAGES).input_tokens == len(prompt)

    # greedy, then stopped by a stop sequence that first appears with the token at index `end`
    free = client.messages.create(model="tiny", max_tokens=12, messages=MESSAGES, extra_body={"temperature": 0.0},
                                  extra_headers={"X-Loraplex-Session": "greedy"}, metadata={"user_id": "ignored"})
    tokens = store.get_trajectory("greedy").turns[0].samples[0].tokens  # the header wins over metadata.user_id
    end, stop = next((i, t) for i in range(1, len(tokens)) if (t := tokenizer.decode([tokens[i]]).strip()).isascii()
                     and t.isalnum() and t not in tokenizer.decode(tokens[:i]))
    stopped = client.messages.create(model="tiny", max_tokens=12, messages=MESSAGES, stop_sequences=["\x00", stop],
                                     extra_body={"temperature": 0.0}, extra_headers={"X-Loraplex-Session": "greedy"})
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == free.content[0].text[:free.content[0].text.find(stop)]
    assert store.get_trajectory("greedy").turns[1].samples[0].tokens == tokens[:end + 1]



def test_a_streamed_message_is_the_answer_token_by_token(client, store):
    greedy = dict(model="tiny", max_tokens=8, messages=MESSAGES, extra_body={"temperature": 0.0})
    whole = client.messages.create(**greedy)
    events = list(client.messages.create(**greedy, stream=True, extra_headers={"X-Loraplex-Session": "streamed"}))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    with client.messages.stream(**greedy, extra_headers={"X-Loraplex-Session": "streamed"}) as stream:
        final = stream.get_final_message()  # the SDK's own accumulation of the events
    turns = store.get_trajectory("streamed").turns
    assert final.model_dump(exclude_none=True) == anthropic.types.Message.model_validate(
        turns[1].response).model_dump(exclude_none=True)  # what was streamed is what was recorded
    assert final.usage.output_tokens == len(turns[1].samples[0].tokens) == whole.usage.output_tokens
    assert ([b.text for b in final.content], final.stop_reason) == ([b.text for b in whole.content], whole.stop_reason)

def test_errors_are_anthropic_shaped_and_name_the_field(server, client, lp, api_key):
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="claude-opus-4", max_tokens=4, messages=MESSAGES)
    assert unknown.value.body["type"] == "error" and unknown.value.body["error"]["type"] == "not_found_error"
    assert unknown.value.body["error"]["message"].startswith("model: ")
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    for fields, field in ((dict(extra_body={"temperature": 1.5}), "temperature"),
                          (dict(tool_choice={"type": "all"}, tools=TOOLS), "tool_choice"),
                          (dict(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking"),
                          (dict(extra_body={"guided_choice": ["a"]}), "guided_choice"),
                          (dict(max_tokens=20_000), "max_tokens"),
                          (dict(messages=[{"role": "user", "content": [image]}]), "messages[0].content[0].type"),
                          (dict(tools=TOOLS), "tools")):  # the tiny model's own template renders no tools
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.create(**{"model": "tiny", "max_tokens": 4, "messages": MESSAGES, **fields})
        error = refused.value.body["error"]
        assert error["type"] == "invalid_request_error" and error["message"].startswith(f"{field}: "), error
    with pytest.raises(anthropic.AuthenticationError) as bad_key:
        anthropic.Anthropic(base_url=client.base_url, api_key="tml-nobody", max_retries=0).messages.create(
            model="tiny", max_tokens=1, messages=MESSAGES)
    assert bad_key.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError, match="not supported by this server"):
        client.models.retrieve("tiny")
    # a bearer token works as x-api-key does
    bearer = httpx.post(f"{server.base_url}/anthropic/v1/messages", headers={"Authorization": f"Bearer {api_key}"},
                        json={"model": "tiny", "max_tokens": 1, "messages": MESSAGES})
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"

    # the owner's snapshot, as another tenant sees it: like the name of nothing
    training = lp.create_lora_training_client("tiny", rank=4, seed=1)
    path = training.save_weights_for_sampler("mine").result().path
    other = anthropic.Anthropic(base_url=client.base_url, api_key=server.new_tenant(), max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as theirs:
        other.messages.create(model=path, max_tokens=1, messages=MESSAGES)
    with pytest.raises(anthropic.NotFoundError) as nobodys:
        other.messages.create(model=path.replace(training.model_id, "nobody:train:0"), max_tokens=1, messages=MESSAGES)
    assert theirs.value.body["error"]["message"].replace(training.model_id, "X") == \
        nobodys.value.body["error"]["message"].replace("nobody:train:0", "X")
    with pytest.raises(anthropic.NotFoundError):
        other.messages.count_tokens(model=path, messages=MESSAGES)
    with pytest.raises(anthropic.BadRequestError, match="max_tokens: not a parameter"):
        client.messages.count_tokens(model=path, messages=MESSAGES, extra_body={"max_tokens": 4})
    assert client.messages.create(model=path, max_tokens=1, messages=MESSAGES).usage.output_tokens == 1

    # the model list: the base model for everyone, the owner's snapshots and policy alias for the owner
    assert [m.id for m in other.models.list()] == ["loraplex/tiny"]
    alias = f"tinker://{training.model_id}/sampler_weights/@latest"
    listed = list(client.models.list(limit=1))  # the SDK pages through all of them, one model a page
    assert {alias, path} <= {m.id for m in listed} and listed[0].id == "loraplex/tiny"
    assert [m.id for m in listed] == [m.id for m in client.models.list(limit=1000).data]
    assert all(m.type == "model" and m.created_at.tzinfo is not None for m in listed)
    page = client.models.list(before_id=listed[-1].id, limit=1)
    assert [m.id for m in page.data] == [listed[-2].id] and page.has_more
    for fields, field in ((dict(limit=0), "limit"), (dict(after_id="nothing"), "after_id"),
                          (dict(after_id=path, before_id=path), "before_id")):
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.models.list(**fields)
        assert refused.value.body["error"]["message"].startswith(f"{field}: ")


def test_a_tool_use_round_trip(server, tool_lora, tokenizer, monkeypatch):
    # As in test_openai_api.py: a Hermes-style template on the server's tokenizer, and `tool_lora`, which
    # learnt to answer the question with a call (the tiny model knows no tool format).
    client = anthropic.Anthropic(base_url=f"{server.base_url}/anthropic", api_key=tool_lora.api_key, max_retries=0)
    store = loraplex.RolloutsClient(loraplex.ServiceClient(base_url=server.base_url, api_key=tool_lora.api_key))
    monkeypatch.setattr(tokenizer, "chat_template", HERMES_TEMPLATE)
    chat_tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                    "parameters": t["input_schema"]}} for t in TOOLS]
    prompt, call = rendering.render_chat(tokenizer, MESSAGES, chat_tools, "tiny"), tool_lora.call
    assert prompt == tool_lora.prompt  # these tools render as the LoRA's (chat completions') tools do
    model, headers = tool_lora.model, {"X-Loraplex-Session": "anthropic-tools"}

    answer = client.messages.create(model=model, max_tokens=80, messages=MESSAGES, tools=TOOLS,
                                    extra_body={"temperature": 0.0}, extra_headers=headers)
    assert answer.stop_reason == "tool_use"
    [use] = answer.content
    assert (use.type, use.name, use.input) == ("tool_use", "add", {"a": 2, "b": 3})
    first = store.get_trajectory("anthropic-tools").turns[0]
    assert first.prompt_tokens == prompt and first.samples[0].tokens == call + [tokenizer.eos_token_id]

    # the harness runs the tool and sends the call and its result back: rendered by the same template
    history = MESSAGES + [{"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
    client.messages.create(model=model, max_tokens=4, messages=history, tools=TOOLS, extra_headers=headers)
    second = store.get_trajectory("anthropic-tools").turns[1].prompt_tokens
    assert "<tool_response>\n5\n</tool_response>" in tokenizer.decode(second)
    assert second[:len(prompt) + len(call) + 1] == prompt + call + [tokenizer.eos_token_id]  # one datum
    assert store.datums("anthropic-tools", advantage=1.0).per_trajectory
    with client.messages.stream(model=model, max_tokens=80, messages=MESSAGES, tools=TOOLS,
                                extra_body={"temperature": 0.0}) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", "add", {"a": 2, "b": 3})]
    # tool_choice none: the tools are rendered, the call is not parsed out of the text
    plain = client.messages.create(model=model, max_tokens=80, messages=MESSAGES, tools=TOOLS,
                                   tool_choice={"type": "none"}, extra_body={"temperature": 0.0})
    assert plain.stop_reason == "end_turn" and plain.content[0].type == "text"
    assert '"name": "add"' in plain.content[0].text
