"""`stream: true` with the official `openai` SDK against a real embedded server on the tiny model: chunks
go out as the vLLM engine makes the tokens, add up to the stored turn and to the same call unstreamed,
and a client that leaves mid-stream stops its sample in the engine."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest

from api.inference import rendering
from api.inference.chunks import ChoiceText
from contract.sampling import SampleDelta
from db.models import Request as RequestRow
from db.models import RequestState
from messaging.notify import Finished, Notifier
from tests.waiting import wait_until
from workers.sampler.engine import CANCELLED

MESSAGES = [{"role": "user", "content": "Count to ten."}]
PROMPT = [5, 6, 7, 8, 9]
IDS = {"return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def client(server, api_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/oai/api/v1", api_key=api_key, max_retries=0)


def ids(tokens) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def joined_chat(chunks) -> dict[int, dict]:
    """Per choice index: the text, sampled token ids (from logprobs), finish reason, and how many chunks
    carried its tokens."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            c = out.setdefault(choice.index, {"text": "", "tokens": [], "logprobs": [], "finish": None, "steps": 0})
            c["text"] += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                c["tokens"] += ids(e.token for e in choice.logprobs.content)
                c["logprobs"] += [e.logprob for e in choice.logprobs.content]
                c["steps"] += 1
            if choice.finish_reason is not None:
                assert c["finish"] is None, "one finish per choice"
                c["finish"] = choice.finish_reason
    return out


@pytest.mark.vllm
def test_chat_stream_adds_up_to_the_stored_turn_and_the_unstreamed_answer(client, store):
    common = dict(model="tiny", messages=MESSAGES, n=2, max_tokens=12, temperature=1.0, seed=11, logprobs=True,
                  top_logprobs=2, extra_body=IDS)
    raw = client.chat.completions.with_raw_response.create(
        **common, stream=True, stream_options={"include_usage": True}, extra_headers={"X-Loraplex-Session": "s1"})
    assert raw.headers["content-type"].startswith("text/event-stream") and raw.headers["X-Loraplex-Session"] == "s1"
    chunks = list(raw.parse())
    assert all(c.object == "chat.completion.chunk" for c in chunks) and len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1]
    assert usage.choices == [] and all(c.usage is None for c in chunks[:-1])
    streamed = joined_chat(chunks[:-1])
    assert sorted(streamed) == [0, 1]

    [turn] = store.get_trajectory("s1").turns
    assert turn.id == chunks[0].id.removeprefix("chatcmpl-")
    unstreamed = client.chat.completions.create(**common)  # same seed: the same samples
    for i, sample in enumerate(turn.samples):
        s = streamed[i]
        assert s["tokens"] == sample.tokens and s["logprobs"] == pytest.approx(sample.logprobs, abs=1e-6)
        assert s["steps"] > 1 and s["finish"] == sample.finish_reason  # token by token, not one replayed chunk
        assert s["text"] == turn.response["choices"][i]["message"]["content"] == unstreamed.choices[i].message.content
        assert ids(e.token for e in unstreamed.choices[i].logprobs.content) == s["tokens"]
    assert usage.usage.completion_tokens == sum(len(s.tokens) for s in turn.samples)
    assert usage.usage.prompt_tokens == len(turn.prompt_tokens)


@pytest.mark.vllm
def test_completions_stream_is_the_unstreamed_text_and_stops_before_a_stop_string(client):
    common = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0.0, logprobs=1, extra_body=IDS)
    whole = client.completions.create(**common).choices[0]
    chunks = list(client.completions.create(**common, stream=True, n=2))  # greedy n=2: two copies, both streamed
    assert all(c.object == "text_completion" and len(c.choices) == 1 for c in chunks)
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert "".join(c.text for c in mine) == whole.text
        assert sum((ids(c.logprobs.tokens) for c in mine if c.logprobs), []) == ids(whole.logprobs.tokens)
        assert sum((c.logprobs.text_offset for c in mine if c.logprobs), []) == whole.logprobs.text_offset
        assert [c.finish_reason for c in mine].count("length") == 1 and mine[-1].finish_reason == "length"
    text = whole.text
    stop = next(w for w in (text[i:i + 3] for i in range(3, len(text) - 3)) if w.strip() == w and w not in text[:3])
    cut = [c.choices[0] for c in client.completions.create(**{**common, "logprobs": None}, stop=[stop], stream=True)]
    assert "".join(c.text for c in cut) == text[:text.find(stop)] and cut[-1].finish_reason == "stop"


@pytest.mark.vllm
def test_tokens_go_out_while_the_engine_still_samples(client, server):
    engine = server.embedded.sampling.engine
    # greedy: the tiny model runs the whole length without an end token
    with client.completions.create(model="tiny", prompt=PROMPT, max_tokens=64, temperature=0.0, stream=True) as stream:
        first = next(iter(stream))
        assert first.choices[0].text is not None
        assert engine.pending == 1  # the first chunk is here before the sample is done
        rest = list(stream)
    assert rest and engine.pending == 0


@pytest.mark.vllm
def test_bad_fields_are_refused_before_the_stream_starts(client):
    for fields, param in ((dict(temperature=-1), "temperature"), (dict(n=10_000), "n"),
                          (dict(stream_options={"include_obfuscation": True}), "stream_options.include_obfuscation"),
                          (dict(model="gpt-4o"), "model")):
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(**{"model": "tiny", "messages": MESSAGES, "stream": True, **fields})
        assert refused.value.status_code in (400, 404) and refused.value.body["param"] == param


@pytest.mark.vllm
def test_a_client_that_leaves_mid_stream_stops_its_sample(client, server, api_key):
    engine = server.embedded.sampling.engine
    with server.embedded.sessions() as db:  # the package's server: other modules' requests are in it too
        failed_before = {row.id for row in db.query(RequestRow).filter(RequestRow.state == RequestState.FAILED)}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1500, "temperature": 0.0, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/oai/api/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {api_key}", "X-Loraplex-Session": "gone"}) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # one event, then the client goes away
    wait_until(lambda: engine.pending == 0, lambda: f"the engine to abort the sample ({engine.pending} pending)",
               timeout=60)
    assert engine.pending == 0  # aborted: not 1500 tokens later
    with server.embedded.sessions() as db:
        [row] = [row for row in db.query(RequestRow).filter(RequestRow.state == RequestState.FAILED)
                 if row.id not in failed_before]
        assert row.error["error"] == CANCELLED  # failed as cancelled, never finished
    after = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, stream=True)
    assert [c.choices[0].finish_reason for c in after][-1] == "length"  # the server serves on


def test_a_feed_gets_every_step_in_order_then_the_finish():
    """The embedded hub: progress and the finish from another thread arrive in order on the loop."""
    notifier = Notifier()

    async def follow() -> list:
        with notifier.feed("r1") as feed:
            def engine_thread():
                for i in range(50):
                    notifier.progress("r1", [SampleDelta(0, (i,), (-0.5,))])
                notifier.notify("r1")
            threading.Thread(target=engine_thread).start()
            items = []
            while not items or not isinstance(items[-1], Finished):
                items.append(await asyncio.wait_for(feed.items.get(), 5))
        notifier.progress("r1", [SampleDelta(0, (99,), (0.0,))])  # after the feed closed: dropped, no error
        return items

    items = asyncio.run(follow())
    assert [d[0].tokens[0] for d in items[:-1]] == list(range(50)) and items[-1].answer is None


def test_streamed_text_holds_back_what_may_be_a_stop_string():
    from models.registry import resolve_model

    path = str(resolve_model("tiny"))
    tokenizer = rendering.tokenizer_of(path)
    tokens = tokenizer("hello world, stop here please")["input_ids"]
    final = rendering.completion_of(tokenizer, path, tokens, "stop", ("stop",), False).text
    text = ChoiceText(tokenizer, path, ("stop",), False)
    pieces = [text.push((t,)) for t in tokens]
    assert "".join(pieces) == final  # everything before the stop string went out before the end, nothing after
    assert text.finish(final) == ""
    held = ChoiceText(tokenizer, path, ("here please",), False)
    sent = "".join(held.push((t,)) for t in tokens)
    assert sent.startswith("hello world") and "here" not in sent  # a stop string's start waits until it is ruled out


@pytest.mark.parametrize("model", ["tiny", "tiny-qwen2"])
def test_text_grown_token_by_token_is_the_whole_texts(model):
    """Incremental decoding (a few tokens per push) gives the text of decoding all tokens at once, also
    across multi-byte characters split over tokens and for random token ids."""
    import random

    from models.registry import resolve_model

    path = str(resolve_model(model))
    tokenizer = rendering.tokenizer_of(path)
    rng = random.Random(0)
    samples = [tokenizer("The fox: ¿Qué tal? 日本語のテキスト 😀 done.")["input_ids"]]
    samples += [[rng.randrange(len(tokenizer)) for _ in range(150)] for _ in range(10)]
    for tokens in samples:
        text = ChoiceText(tokenizer, path, (), False)
        sent = "".join(text.push((t,)) for t in tokens)
        whole = tokenizer.decode(tokens, skip_special_tokens=True)
        assert whole.startswith(sent) and len(whole) - len(sent) <= 4  # at most an unfinished character waits
        assert sent + text.finish(whole) == whole


def test_tool_calls_wait_for_the_end_and_go_out_as_one_delta():
    """With tools, text stops going out at a `<tool_call>`; the parsed calls come as a tool_calls delta."""
    from openai.types.chat import ChatCompletionChunk

    from api.inference.chunks import ChatChunks
    from models.registry import resolve_model

    path = str(resolve_model("tiny"))
    tokenizer = rendering.tokenizer_of(path)
    tokens = tokenizer('Let me add. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')["input_ids"]
    text = ChoiceText(tokenizer, path, (), parse_tools=True)
    sent = "".join(text.push((t,)) for t in tokens)
    assert sent.startswith("Let me add") and "<" not in sent
    done = rendering.Completion("Let me add. ", [rendering.ToolCall("call-1", "add", '{"a": 1}')], "tool_calls")
    chunks = ChatChunks(response_id="t", model="tiny", fingerprint="f", tokenizer=tokenizer, logprobs=False,
                        top_logprobs=0, as_ids=False, include_usage=False)
    events = chunks.end(0, text.finish(done.text), done)
    parsed = [ChatCompletionChunk.model_validate_json(e.removeprefix(b"data: ").strip()) for e in events]
    deltas = [p.choices[0] for p in parsed]
    assert "".join(d.delta.content or "" for d in deltas) == done.text[len(sent):]
    [call] = [c for d in deltas for c in d.delta.tool_calls or []]
    assert (call.index, call.id, call.function.name, call.function.arguments) == (0, "call-1", "add", '{"a": 1}')
    assert deltas[-1].finish_reason == "tool_calls" and all(d.finish_reason is None for d in deltas[:-1])
