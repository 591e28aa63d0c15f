"""The official `openai` SDK, with only `base_url` and `api_key` set, against a real embedded server on
the tiny model and its multi-LoRA vLLM sampler; every call lands in the rollout store, token for token."""

from __future__ import annotations

import loraplex
import numpy as np
import openai
import pytest

from api.inference import rendering
from tests.inference.tool_calls import HERMES_TEMPLATE, TOOLS, sft_steps

pytestmark = pytest.mark.vllm  # the package's server runs the vLLM sampler

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def client(server, api_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/oai/api/v1", api_key=api_key, max_retries=0)


def ids(entries) -> list[int]:
    """Token ids of logprob entries answered with return_tokens_as_token_ids ("token_id:<id>")."""
    return [int(e.token.removeprefix("token_id:")) for e in entries]


def test_chat_completion_is_answered_and_recorded_token_for_token(client, store, tokenizer, model_path):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=MESSAGES, n=2, max_tokens=8, temperature=1.0, seed=7, logprobs=True, top_logprobs=3,
        extra_body={"return_tokens_as_token_ids": True})
    answer = raw.parse()
    session, turn = raw.headers["X-Loraplex-Session"], raw.headers["X-Loraplex-Turn"]
    assert (turn, raw.headers["X-Loraplex-Policy-Version"], answer.system_fingerprint) == ("0", "base", "loraplex-base")
    assert answer.object == "chat.completion" and answer.model == "tiny" and len(answer.choices) == 2
    prompt = rendering.render_chat(tokenizer, MESSAGES, None, "tiny")
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.completion_tokens == sum(len(c.logprobs.content) for c in answer.choices)

    [stored] = store.get_trajectory(session).turns
    assert stored.prompt_tokens == prompt and stored.policy_version is None and stored.sampler_path is None
    assert stored.id == answer.id.removeprefix("chatcmpl-") and stored.api == "chat.completions"
    for choice, sample in zip(answer.choices, stored.samples, strict=True):
        entries = choice.logprobs.content
        assert sample.tokens == ids(entries)  # the tokens recorded are the tokens whose logprobs were answered
        assert np.array_equal(np.float32(sample.logprobs), np.float32([e.logprob for e in entries]))
        assert all(len(e.top_logprobs) == 3 for e in entries)
        assert all(e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob for e in entries)
        assert sample.finish_reason == choice.finish_reason in ("stop", "length")
        stop_reason = "length" if choice.finish_reason == "length" else "stop"
        assert choice.message.content == rendering.completion_of(tokenizer, model_path, sample.tokens, stop_reason, (),
                                                                 False).text
    assert stored.request["n"] == 2 and stored.request["messages"] == MESSAGES  # the request as it came
    assert stored.response["id"] == answer.id and stored.response["choices"][1]["message"]["content"] == \
        answer.choices[1].message.content  # the response as it went


def test_completions_take_token_ids_and_stop_before_a_stop_string(client, store, tokenizer):
    free = client.completions.create(model="loraplex/tiny", prompt=PROMPT, max_tokens=12, temperature=0.0, logprobs=2,
                                      extra_body={"return_tokens_as_token_ids": True})
    [choice] = free.choices
    tokens = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
    assert len(tokens) == 12 and choice.finish_reason == "length" and free.usage.prompt_tokens == len(PROMPT)
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    # a stop string that first appears in the text with the token at index `end`
    end, stop = next((i, t) for i in range(1, len(tokens)) if (t := tokenizer.decode([tokens[i]]).strip()).isascii()
                     and t.isalnum() and t not in tokenizer.decode(tokens[:i]))
    raw = client.completions.with_raw_response.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.0,
                                                      stop=[stop], user="stopper")
    stopped = raw.parse().choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == choice.text[:choice.text.find(stop)]
    [turn] = store.get_trajectory("stopper").turns  # named by `user`
    assert turn.samples[0].tokens == tokens[:end + 1]  # up to and including the token that completed the match
    assert raw.headers["X-Loraplex-Session"] == "stopper"


def test_errors_name_the_field_and_other_tenants_models_do_not_exist(server, client, lp, api_key):
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert unknown.value.body["param"] == "model" and unknown.value.body["code"] == "model_not_found"
    for fields, param in ((dict(temperature=-1), "temperature"), (dict(top_logprobs=2), "top_logprobs"),
                          (dict(stream_options={"include_usage": True}), "stream_options"),
                          (dict(tool_choice="required"), "tool_choice"),
                          (dict(n=0), "n"), (dict(extra_body={"guided_choice": ["a"]}), "guided_choice"),
                          (dict(messages=[{"role": "user", "content": [IMAGE]}]), "messages[0].content[0].type")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(**{"model": "tiny", "messages": MESSAGES, **fields})
        assert refused.value.body["param"] == param, refused.value.body
    with pytest.raises(openai.BadRequestError, match="prompt: one prompt per request"):
        client.completions.create(model="tiny", prompt=["a", "b"])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="tml-nobody", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError, match="not supported by this server yet"):
        client.embeddings.create(model="tiny", input="hi")  # (Responses: test_responses_api.py)

    # the owner's checkpoint and policy alias, as another tenant sees them: like names of nothing
    training = lp.create_lora_training_client("tiny", rank=4, seed=1)
    path = training.save_weights_for_sampler("mine").result().path
    other = openai.OpenAI(base_url=client.base_url, api_key=server.new_tenant(), max_retries=0)
    for model, nobody in ((path, path.replace(training.model_id, "nobody:train:0")),
                          (f"tinker://{training.model_id}/sampler_weights/@latest",
                           "tinker://nobody:train:0/sampler_weights/@latest")):
        with pytest.raises(openai.NotFoundError) as theirs:
            other.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1)
        with pytest.raises(openai.NotFoundError) as nobodys:
            other.chat.completions.create(model=nobody, messages=MESSAGES, max_tokens=1)
        assert theirs.value.body["message"].replace(training.model_id, "X") == \
            nobodys.value.body["message"].replace("nobody:train:0", "X")
    assert client.chat.completions.create(model=path, messages=MESSAGES, max_tokens=1).choices  # the owner's: served
    assert [m.id for m in other.models.list()] == ["loraplex/tiny"]
    assert {f"tinker://{training.model_id}/sampler_weights/@latest", path} <= {m.id for m in client.models.list()}


def test_a_policy_alias_follows_new_saves_and_the_store_records_each_version(client, lp, store):
    training = lp.create_lora_training_client("tiny", rank=8, seed=2)
    sft_steps(training, list(range(10, 40)), 1, 1, 2e-2)
    first = training.save_weights_for_sampler("alias").result().path
    alias = f"tinker://{training.model_id}/sampler_weights/@latest"

    def call() -> tuple[str, list[int]]:
        raw = client.completions.with_raw_response.create(
            model=alias, prompt=PROMPT, max_tokens=10, temperature=0.0, extra_headers={"X-Loraplex-Session": "alias"})
        return raw.headers["X-Loraplex-Policy-Version"], raw.parse().choices[0].text

    version, before = call()
    assert version == "v1"
    sft_steps(training, list(range(10, 40)), 1, 2, 2e-2)
    training.save_weights_and_get_sampling_client()  # an unnamed save is a save too
    version, after = call()
    assert version == "v3" and after != before
    turns = store.get_trajectory("alias").turns
    assert [t.policy_version for t in turns] == [1, 3] and [t.model for t in turns] == [alias, alias]
    assert turns[0].sampler_path == first and turns[1].sampler_path != first
    assert store.list_trajectories()[0].policy_versions == [1, 3]  # the newest trajectory first


def test_a_stored_multi_turn_trajectory_trains_exactly_the_tokens_sampled(client, lp, store):
    training = lp.create_lora_training_client("tiny", rank=4, seed=3)  # B = 0: the base model's numbers
    headers = {"X-Loraplex-Session": "multi"}
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=1, extra_headers=headers)
    sampled = store.get_trajectory("multi").turns[0].samples[0].tokens
    client.completions.create(model="tiny", prompt=PROMPT + sampled + [11, 12], max_tokens=5, temperature=1.0, seed=2,
                              extra_headers=headers)
    with pytest.raises(loraplex.BadRequestError, match="advantage: "):
        store.datums("multi")  # no reward yet
    store.set_reward("multi", 1.0)
    built = store.datums("multi")
    assert built.per_trajectory and built.sources == [[(0, 0), (1, 0)]]
    [datum] = built.datums
    turns = store.get_trajectory("multi").turns
    full = turns[1].prompt_tokens + turns[1].samples[0].tokens
    assert datum.model_input.to_ints() == full[:-1] and datum.arrays()["target_tokens"].tolist() == full[1:]
    sampled_rows = np.flatnonzero(datum.arrays()["advantages"])  # row j predicts token j + 1
    last = len(turns[1].samples[0].tokens)
    assert sampled_rows.tolist() == [*range(len(PROMPT) - 1, len(PROMPT) - 1 + len(sampled)),
                                     *range(len(full) - 1 - last, len(full) - 1)]
    recorded = np.concatenate([turns[0].samples[0].logprobs, turns[1].samples[0].logprobs]).astype(np.float32)
    assert np.array_equal(datum.arrays()["logprobs"][sampled_rows], recorded)

    # the trainer's logprobs of those tokens: the sampler's, within the bound of tests/service/test_sampling.py
    out = training.forward([datum], "importance_sampling").result().loss_fn_outputs[0]["logprobs"]
    gaps = np.abs(np.asarray(out)[sampled_rows] - recorded)
    assert gaps.mean() < 1e-5 and gaps.max() < 1e-4

    # a prompt that does not extend the last turn: one datum per turn, and why
    client.completions.create(model="tiny", prompt=PROMPT + [13], max_tokens=2, extra_headers=headers)
    built = store.datums("multi", advantage=0.5)
    assert not built.per_trajectory and "turn 2's prompt does not extend turn 1's" in built.reason
    assert len(built.datums) == 3
    store.delete_trajectory("multi")
    with pytest.raises(loraplex.NotFoundError):
        store.get_trajectory("multi")


def test_a_tool_call_round_trip(server, tool_lora, tokenizer, monkeypatch):
    # The tiny model's own template renders no tools: the server's tokenizer gets a Hermes-style one,
    # and `tool_lora` learnt to answer the question with a call (the tiny model knows no tool format).
    client = openai.OpenAI(base_url=f"{server.base_url}/oai/api/v1", api_key=tool_lora.api_key, max_retries=0)
    store = loraplex.RolloutsClient(loraplex.ServiceClient(base_url=server.base_url, api_key=tool_lora.api_key))
    monkeypatch.setattr(tokenizer, "chat_template", HERMES_TEMPLATE)
    prompt, call = rendering.render_chat(tokenizer, MESSAGES, TOOLS, "tiny"), tool_lora.call
    assert prompt == tool_lora.prompt  # the prompt the LoRA learnt to answer
    model, headers = tool_lora.model, {"X-Loraplex-Session": "openai-tools"}

    answer = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, temperature=0.0,
                                            max_tokens=80, extra_headers=headers)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [tool_call] = choice.message.tool_calls
    assert (tool_call.function.name, tool_call.function.arguments) == ("add", '{"a": 2, "b": 3}')
    assert store.get_trajectory("openai-tools").turns[0].samples[0].tokens == call + [tokenizer.eos_token_id]

    # the harness runs the tool and sends the call and its result back: rendered by the same template
    history = MESSAGES + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": tool_call.id, "content": "5"}]
    client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=4, extra_headers=headers)
    second = store.get_trajectory("openai-tools").turns[1].prompt_tokens
    assert "<tool_response>\n5\n</tool_response>" in tokenizer.decode(second)
    # the call re-rendered from its JSON is the very tokens sampled: the two turns train as one datum
    assert second[:len(prompt) + len(call) + 1] == prompt + call + [tokenizer.eos_token_id]
    built = store.datums("openai-tools", advantage=1.0)
    assert built.per_trajectory and len(built.datums) == 1
    monkeypatch.undo()  # the model's own template again
    with pytest.raises(openai.BadRequestError, match="does not render tools"):
        client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=4)
