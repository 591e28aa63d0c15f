"""What the inference API does with each OpenAI parameter, and how it renders and reads text:
no parameter is silently ignored, and every refusal names its field."""

from __future__ import annotations

import pytest
from openai.types.chat.completion_create_params import CompletionCreateParamsBase as ChatParams
from openai.types.completion_create_params import CompletionCreateParamsBase as TextParams

from api.inference import params, rendering
from api.inference.errors import InferenceError
from models.registry import resolve_model

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def refusal(call) -> str:
    with pytest.raises(InferenceError) as caught:
        call()
    assert caught.value.status_code == 400
    return caught.value.detail


def chat(**fields) -> params.ChatRequest:
    return params.parse(params.ChatRequest, CHAT | fields, params.CHAT_PARAMETERS)


def test_the_known_parameters_are_the_openai_packages_own():
    assert params.CHAT_PARAMETERS == ChatParams.__required_keys__ | ChatParams.__optional_keys__ | {"stream"}
    assert params.COMPLETION_PARAMETERS == TextParams.__required_keys__ | TextParams.__optional_keys__ | {"stream"}


@pytest.mark.parametrize("name", sorted(params.CHAT_PARAMETERS - set(params.ChatRequest.model_fields)))
def test_every_chat_parameter_not_used_is_refused_unless_neutral(name):
    for neutral in params.NEUTRAL.get(name, (None,)):
        chat(**{name: neutral})  # accepted: it changes nothing
    assert refusal(lambda: chat(**{name: "something else"})).startswith(f"{name}: ")


def test_unknown_parameters_and_stream_options_without_stream_are_refused_naming_them():
    assert refusal(lambda: chat(best_of=2)).startswith("best_of: not a parameter of this route")  # a /completions one
    assert refusal(lambda: chat(min_p=0.1)).startswith("min_p: ")
    assert refusal(lambda: chat(stream_options={"include_usage": True})).startswith("stream_options: only allowed when")
    assert refusal(lambda: chat(stream=True, stream_options={"include_obfuscation": True})).startswith(
        "stream_options.include_obfuscation: ")
    assert chat(stream=True, stream_options={"include_usage": True}).stream_options.include_usage
    assert refusal(lambda: chat(frequency_penalty=0.5)) == \
        "frequency_penalty: not supported by this server; only 0 is accepted"
    chat(frequency_penalty=0.0, presence_penalty=0, stream=False, store=True, parallel_tool_calls=True)
    assert refusal(lambda: chat(store=False)).startswith("store: ")
    assert refusal(lambda: chat(parallel_tool_calls=1)).startswith("parallel_tool_calls: ")  # 1 is not True


@pytest.mark.parametrize("fields, field", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 0}, "n"), ({"seed": -1}, "seed"),
    ({"max_tokens": 0}, "max_tokens"), ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"tool_choice": "always"}, "tool_choice"), ({"stop": [""]}, "stop[0]"),
    ({"messages": []}, "messages"), ({"temperature": float("nan")}, "temperature"), ({"top_k": -2}, "top_k"),
])
def test_bad_values_name_their_field(fields, field):
    assert refusal(lambda: chat(**fields)).startswith(f"{field}: ")


def test_sampling_options_fill_the_context_and_name_the_limit_they_pass():
    body = chat(temperature=0.5, top_k=0, seed=3, stop="END")
    options = params.sampling_options(body, prompt_len=10, max_context=100, max_samples=8)
    assert (options.max_tokens, options.temperature, options.top_k, options.seed, options.stop_strings) == \
        (90, 0.5, -1, 3, ("END",))
    assert params.sampling_options(chat(max_tokens=5, max_completion_tokens=7), 10, 100, 8).max_tokens == 7
    assert refusal(lambda: params.sampling_options(chat(max_completion_tokens=91), 10, 100, 8)).startswith(
        "max_completion_tokens: prompt (10) + max_completion_tokens (91) exceed")
    assert refusal(lambda: params.sampling_options(chat(n=9), 10, 100, 8)) == "n: at most 8, got 9"
    completion = params.parse(params.CompletionRequest, {"model": "tiny", "prompt": [1, 2]},
                              params.COMPLETION_PARAMETERS)
    assert params.sampling_options(completion, 2, 100, 8).max_tokens == 16  # OpenAI's default for /completions


def test_the_session_comes_from_the_header_then_metadata_then_user():
    body = chat(metadata={"session_id": "from-metadata"}, user="from-user")
    assert params.session_of("from-header", body) == "from-header"
    assert params.session_of(None, body) == "from-metadata"
    assert params.session_of(None, chat(user="a@b.com")) == "a@b.com"
    assert params.session_of(None, chat()) is None
    assert refusal(lambda: params.session_of("has space", chat())).startswith("X-Loraplex-Session: ")


# --- rendering ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    path = str(resolve_model("tiny"))
    return path, rendering.tokenizer_of(path)


def test_messages_are_checked_and_text_parts_joined():
    messages = rendering.template_messages([
        {"role": "system", "content": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
    ])
    assert messages[0] == {"role": "system", "content": "be\nbrief"}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}  # as templates print it
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert refusal(lambda: rendering.template_messages(image)).startswith("messages[0].content[0].type: ")
    assert refusal(lambda: rendering.template_messages([{"role": "function", "content": "x"}])).startswith(
        "messages[0].role: ")
    assert refusal(lambda: rendering.template_messages([{"role": "user", "content": "x", "audio": {}}])).startswith(
        "messages[0].audio: ")
    assert refusal(lambda: rendering.template_messages([{"role": "user"}])).startswith("messages[0].content: ")


def test_the_chat_template_renders_the_prompt_and_tools_need_one_that_takes_them(tiny):
    path, tokenizer = tiny
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = rendering.render_chat(tokenizer, messages, None, "loraplex/tiny")
    assert tokenizer.decode(prompt) == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    tools = [{"type": "function", "function": {"name": "add"}}]
    assert refusal(lambda: rendering.check_tools(tokenizer, tools, "loraplex/tiny")) == \
        "tools: the chat template of loraplex/tiny does not render tools"
    assert refusal(lambda: rendering.check_tools(tokenizer, [{"type": "custom"}], "x")).startswith("tools[0]: ")


def test_completion_text_leaves_out_the_end_token_and_stops_before_a_stop_string(tiny):
    path, tokenizer = tiny
    tokens = tokenizer.encode("one two three") + [tokenizer.eos_token_id]
    assert rendering.completion_of(tokenizer, path, tokens, "stop", (), False).text == "one two three"
    cut = rendering.completion_of(tokenizer, path, tokens, "stop", ("three", " two"), False)
    assert (cut.text, cut.finish_reason, cut.tool_calls) == ("one", "stop", [])
    assert rendering.completion_of(tokenizer, path, tokens[:2], "length", ("two",), False).finish_reason == "length"
    assert refusal(lambda: rendering.prompt_tokens(tokenizer, ["a", "b"], 512)).startswith("prompt: one prompt")
    assert refusal(lambda: rendering.prompt_tokens(tokenizer, [1, 512], 512)) == \
        "prompt: token id 512 is not in [0, 512)"
    assert rendering.prompt_tokens(tokenizer, [[4, 5]], 512) == [4, 5]
