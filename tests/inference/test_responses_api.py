"""The official `openai` SDK's Responses API (`client.responses`) against a real embedded server on the
tiny model: answers, refusals naming the field, and previous_response_id served from the rollout store."""

from __future__ import annotations

import loraplex
import openai
import pytest

from api.inference import rendering
from tests.inference.tool_calls import HERMES_TEMPLATE, TOOLS

pytestmark = pytest.mark.vllm  # the package's server runs the vLLM sampler

QUESTION = "What is 2 + 3?"
FUNCTIONS = [{"type": "function", "strict": False, **t["function"]} for t in TOOLS]  # Responses' flat shape


@pytest.fixture(scope="module")
def client(server, api_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/oai/api/v1", api_key=api_key, max_retries=0)


def test_a_response_is_answered_stored_and_chained(client, store, tokenizer):
    raw = client.responses.with_raw_response.create(model="tiny", input=QUESTION, instructions="Be brief.",
                                                    max_output_tokens=8, temperature=1.0,
                                                    metadata={"session_id": "plain"})
    first = raw.parse()
    assert first.object == "response" and first.model == "tiny" and first.instructions == "Be brief."
    assert raw.headers["X-Loraplex-Session"] == "plain" and raw.headers["X-Loraplex-Turn"] == "0"
    [turn] = store.get_trajectory("plain").turns
    prompt = rendering.render_chat(tokenizer, [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": QUESTION}], None, "tiny")
    assert turn.api == "responses" and turn.id == first.id.removeprefix("resp_") and turn.prompt_tokens == prompt
    # what the answer reports is what was stored
    assert (first.usage.input_tokens, first.usage.output_tokens) == (len(prompt), len(turn.samples[0].tokens))
    assert first.status == {"length": "incomplete", "stop": "completed"}[turn.samples[0].finish_reason]
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()

    # chained: the previous input and output come first (its instructions do not), in the same trajectory
    second = client.responses.create(model="tiny", input="And 3 + 4?", previous_response_id=first.id,
                                     max_output_tokens=4)
    turns = store.get_trajectory("plain").turns
    assert [t.id for t in turns] == [turn.id, second.id.removeprefix("resp_")]
    history = [{"role": "user", "content": QUESTION}]
    history += [{"role": "assistant", "content": first.output_text}] if first.output_text else []
    assert turns[1].prompt_tokens == rendering.render_chat(
        tokenizer, [*history, {"role": "user", "content": "And 3 + 4?"}], None, "tiny")
    assert second.previous_response_id == first.id and second.usage.input_tokens == len(turns[1].prompt_tokens)



def test_a_streamed_response_is_the_answer_token_by_token(client, store):
    greedy = dict(model="tiny", input=QUESTION, max_output_tokens=8, temperature=0.0)
    whole = client.responses.create(**greedy)
    assert whole.status == "incomplete"  # 8 greedy tokens of the tiny model do not reach its end token
    with client.responses.stream(**greedy, metadata={"session_id": "streamed"}) as stream:
        events = list(stream)  # through the SDK's own accumulation, which checks their order
        final = stream.get_final_response()  # it takes only response.completed, incomplete or not
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert (final.status, final.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    [turn] = store.get_trajectory("streamed").turns
    assert final.id == f"resp_{turn.id}" and final.output_text == whole.output_text
    assert final.model_dump(exclude_none=True) == client.responses.retrieve(final.id).model_dump(exclude_none=True)
    assert final.usage.output_tokens == len(turn.samples[0].tokens) == whole.usage.output_tokens == 8


def test_errors_name_the_field_and_other_tenants_responses_do_not_exist(server, client, lp):
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(model="gpt-5", input=QUESTION)
    assert unknown.value.body["param"] == "model"
    for fields, param in ((dict(store=False), "store"), (dict(tool_choice="always"), "tool_choice"),
                          (dict(temperature=3), "temperature"), (dict(reasoning={"effort": "low"}), "reasoning"),
                          (dict(extra_body={"guided_choice": ["a"]}), "guided_choice"),
                          (dict(max_output_tokens=5000), "max_output_tokens"),
                          (dict(input=[{"type": "reasoning", "summary": []}]), "input[0].type"),
                          (dict(tools=[{**FUNCTIONS[0], "strict": "yes"}]), "tools[0].strict"),
                          (dict(tools=FUNCTIONS), "tools")):  # the tiny model's own template renders no tools
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(**{"model": "tiny", "input": QUESTION, **fields})
        assert refused.value.body["param"] == param, refused.value.body

    mine = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=1)
    other = openai.OpenAI(base_url=client.base_url, api_key=server.new_tenant(), max_retries=0)
    for response_id in (mine.id, "resp_nothing"):
        with pytest.raises(openai.NotFoundError) as missing:
            other.responses.create(model="tiny", input="hi", previous_response_id=response_id, max_output_tokens=1)
        assert missing.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(response_id)
    training = lp.create_lora_training_client("tiny", rank=4, seed=1)
    path = training.save_weights_for_sampler("mine").result().path
    with pytest.raises(openai.NotFoundError) as theirs:
        other.responses.create(model=path, input=QUESTION, max_output_tokens=1)
    assert theirs.value.body["param"] == "model"
    assert client.responses.create(model=path, input=QUESTION, max_output_tokens=1).usage.output_tokens == 1


def test_a_function_call_round_trip_is_one_trajectory(server, tool_lora, tokenizer, monkeypatch):
    # As in test_openai_api.py: a Hermes-style template on the server's tokenizer, and `tool_lora`, which
    # learnt to answer the question with a call (the tiny model knows no tool format).
    client = openai.OpenAI(base_url=f"{server.base_url}/oai/api/v1", api_key=tool_lora.api_key, max_retries=0)
    store = loraplex.RolloutsClient(loraplex.ServiceClient(base_url=server.base_url, api_key=tool_lora.api_key))
    monkeypatch.setattr(tokenizer, "chat_template", HERMES_TEMPLATE)
    prompt = rendering.render_chat(tokenizer, [{"role": "user", "content": QUESTION}], TOOLS, "tiny")
    call = tool_lora.call
    assert prompt == tool_lora.prompt  # the prompt the LoRA learnt to answer
    model = tool_lora.model

    with client.responses.stream(model=model, input=QUESTION, tools=FUNCTIONS, temperature=0.0,
                                 max_output_tokens=80) as stream:  # streamed, and chained like any other
        first = stream.get_final_response()  # a trajectory of its own
    [function_call] = first.output
    assert (function_call.type, function_call.name, function_call.arguments) == ("function_call", "add",
                                                                                 '{"a": 2, "b": 3}')
    assert first.status == "completed"

    # the harness runs the function and sends only its output, chained to the call
    raw = client.responses.with_raw_response.create(
        model=model, previous_response_id=first.id, tools=FUNCTIONS, max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": function_call.call_id, "output": "5"}])
    session = raw.headers["X-Loraplex-Session"]  # the first call's trajectory
    turns = store.get_trajectory(session).turns
    assert raw.headers["X-Loraplex-Turn"] == "1" and turns[0].id == first.id.removeprefix("resp_")
    assert turns[0].prompt_tokens == prompt and turns[0].samples[0].tokens == call + [tokenizer.eos_token_id]
    assert "<tool_response>\n5\n</tool_response>" in tokenizer.decode(turns[1].prompt_tokens)
    # turn 1's prompt extends turn 0's prompt and completion token for token: one datum
    assert turns[1].prompt_tokens[:len(prompt) + len(call) + 1] == turns[0].prompt_tokens + turns[0].samples[0].tokens
    assert store.datums(session, advantage=1.0).per_trajectory
    assert raw.parse().usage.input_tokens == len(turns[1].prompt_tokens)
