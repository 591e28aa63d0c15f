"""Refuse before the work (issue 42, point 3): text that the model's context could never hold is refused
before it is tokenised. A 10 MB prompt on chat, completions or messages used to be tokenised in full
(7-12 s of CPU, the server's RSS up by 2 GB and 1.4 GB of it kept) only to be refused for exceeding the
2,048-token context. Now the text of a body is held to input_policy.prompt_byte_limit first.

The quick tests run on the app alone, with no sampler (nothing here needs one: the refusal comes first);
the slow one measures `python -m service serve` in a process of its own, whose RSS is its alone.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.deps import tenant_of_key
from api.inference import rendering
from api.input_policy import PROMPT_BYTES_PER_TOKEN_SLACK, prompt_byte_limit
from api.served_models import ServedModel, ServedModels
from db import rollouts
from db.models import new_id
from db.session import make_engine, make_session_factory, upgrade_to_head
from db.tenants import create_tenant
from messaging.notify import Notifier
from models.registry import model_info
from service.embedded import free_port
from service.settings import Settings
from tests.reliability.processes import RssSampler, rss_bytes, start_serve, stop, tenant_key

MB = 1 << 20
TEXT = "hello world " * (10 * MB // 12)  # 10 MB, about 4.4 million tokens of the tiny model
# The server's RSS after the big prompts, and at their peak, over what it was before: a bound well above
# the parsed body's few copies (10 MB each) and far below the 1.4 GB kept and 2 GB peak of tokenising them.
SETTLED_BOUND = 200 * MB
PEAK_BOUND = 400 * MB


def bodies(text: str) -> dict[str, dict]:
    """Each route that tokenises text, with `text` as its prompt (its path under the server's root)."""
    messages = [{"role": "user", "content": text}]
    return {
        "/oai/api/v1/chat/completions": {"model": "tiny", "messages": messages, "max_tokens": 4},
        "/oai/api/v1/completions": {"model": "tiny", "prompt": text, "max_tokens": 4},
        "/oai/api/v1/responses": {"model": "tiny", "input": text, "max_output_tokens": 4},
        "/anthropic/v1/messages": {"model": "tiny", "messages": messages, "max_tokens": 4},
        "/anthropic/v1/messages/count_tokens": {"model": "tiny", "messages": messages},
    }


FIELDS = {"/oai/api/v1/completions": "prompt", "/oai/api/v1/responses": "input"}  # else "messages"


def message_of(answer) -> str:
    error = answer.json()["error"]
    return error["message"]


@pytest.fixture(scope="module")
def app_alone(tmp_path_factory):
    """The app with no scheduler loop or sampler behind it (as tests/api/conftest.py builds it)."""
    settings = Settings(data_dir=tmp_path_factory.mktemp("prompts"), base_model="tiny", sampler_enabled=False)
    upgrade_to_head(settings.resolved_database_url)
    sessions = make_session_factory(make_engine(settings.resolved_database_url))
    scheduler = SimpleNamespace(submit=lambda queued: None)
    app = create_app(settings=settings, sessions_factory=sessions, notifier=Notifier(), models=ServedModels(
        [ServedModel(model_info("tiny"), scheduler, sampling_unavailable="no sampler in this test")]))
    with sessions() as s:
        key = create_tenant(s, "prompts")[1]
    with TestClient(app, base_url="http://test", headers={"x-api-key": key}) as client:
        yield SimpleNamespace(client=client, app=app, sessions=sessions, key=key)


def test_the_limit_is_derived_from_the_context_and_the_longest_token(app_alone):
    info = app_alone.app.state.models.default.info
    per_token = rendering.max_token_bytes(str(info.path))
    limit = prompt_byte_limit(info.max_context, per_token)
    assert limit == PROMPT_BYTES_PER_TOKEN_SLACK * info.max_context * per_token
    # the limit can never refuse a text that fits: even a context of the longest tokens is under it
    vocab = rendering.tokenizer_of(str(info.path)).get_vocab()
    longest = max(vocab, key=lambda t: len(t.encode()))
    assert len(longest.encode()) == per_token and info.max_context * per_token < limit


@pytest.mark.parametrize("route", list(bodies("")))
def test_a_10_mb_prompt_is_refused_naming_the_field_before_it_is_tokenised(app_alone, route, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the prompt was tokenised")

    monkeypatch.setattr(rendering, "render_chat", never)
    monkeypatch.setattr(rendering, "prompt_tokens", never)
    answer = app_alone.client.post(route, json=bodies(TEXT)[route])
    assert answer.status_code == 400, answer.text[:300]
    message = message_of(answer)
    assert message.startswith(f"{FIELDS.get(route, 'messages')}: ") and " bytes of text " in message, message
    assert "the model's context of 2048 tokens" in message, message
    assert len(answer.content) < 1024


def test_this_process_keeps_no_memory_of_10_mb_prompts(app_alone):
    """The app runs in this process here: its RSS (the test's too) comes back near where it was. The slow
    test below measures a server of its own."""
    import os

    routes = ["/oai/api/v1/chat/completions", "/oai/api/v1/completions", "/anthropic/v1/messages"]
    for route in routes:
        app_alone.client.post(route, json=bodies("hi")[route])  # warm: the tokenizer loaded
    payloads = {route: bodies(TEXT)[route] for route in routes}
    baseline = rss_bytes(os.getpid())
    for route in routes * 2:
        assert app_alone.client.post(route, json=payloads[route]).status_code == 400
    grown = rss_bytes(os.getpid()) - baseline
    assert grown < SETTLED_BOUND, f"RSS {grown / MB:.0f} MB above its baseline"


def test_a_responses_chain_holding_more_text_than_the_context_is_refused_before_rendering(app_alone):
    """Each stored call of a previous_response_id chain was within the limit; together they are not."""
    with app_alone.sessions() as s:
        tenant_id = tenant_of_key(s, app_alone.key).id
    limit = prompt_byte_limit(2048, rendering.max_token_bytes(str(app_alone.app.state.models.default.info.path)))
    previous = None
    for _ in range(2):
        turn_id = new_id()
        request_body = {"model": "tiny", "input": "x" * (limit * 2 // 3)} | (
            {"previous_response_id": previous} if previous else {})
        rollouts.record_turn(app_alone.sessions, tenant_id, "chain", rollouts.NewTurn(
            id=turn_id, api="responses", model="tiny", sampler_path=None, adapter_path=None, policy_version=None,
            request_id=new_id(), prompt=[1], choices=[rollouts.SampledChoice([2], [-0.1], "stop")],
            request_body=request_body, response_body={"output": []}))
        previous = f"resp_{turn_id}"
    answer = app_alone.client.post("/oai/api/v1/responses", json={"model": "tiny", "input": "hi",
                                                                  "previous_response_id": previous})
    assert answer.status_code == 400 and message_of(answer).startswith("previous_response_id: "), answer.text[:300]


def test_token_ids_past_the_context_are_refused_before_they_are_checked(app_alone):
    answer = app_alone.client.post("/oai/api/v1/completions", json={"model": "tiny", "prompt": [1] * 1_000_000})
    assert answer.status_code == 400 and message_of(answer).startswith("prompt: 1000000 token ids"), answer.text[:300]


def test_a_prompt_that_fits_the_context_is_not_refused_for_its_size(app_alone):
    """About 2,000 tokens of text (5 KB): rendered and tokenised as before; refused only because this app
    has no sampler."""
    answer = app_alone.client.post("/oai/api/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hello world " * 400}], "max_tokens": 4})
    assert answer.status_code == 400 and message_of(answer).startswith("model: sampling is not available"), answer.text
    answer = app_alone.client.post("/oai/api/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hello world " * 5000}], "max_tokens": 4})
    assert message_of(answer).startswith("messages: the prompt is"), answer.text  # tokenised: 60 KB fit the limit


# --- the server's memory, in a process of its own ----------------------------------------------------


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    data_dir, port = tmp_path_factory.mktemp("serve"), free_port()
    process = start_serve(data_dir, port)
    try:
        yield SimpleNamespace(process=process, base_url=f"http://127.0.0.1:{port}", key=tenant_key(data_dir, "t"))
    finally:
        stop(process)


@pytest.mark.slow  # `python -m service serve` in a process of its own, 30 MB of prompts
def test_rss_returns_near_its_baseline_after_10_mb_prompts(serve):
    headers = {"x-api-key": serve.key}
    routes = ["/oai/api/v1/chat/completions", "/oai/api/v1/completions", "/anthropic/v1/messages"]
    for route in routes:  # warm up: the tokenizer loaded, the routes' modules imported
        answer = httpx.post(serve.base_url + route, json=bodies("hi")[route], headers=headers, timeout=60)
        assert answer.status_code == 400, answer.text[:300]  # no sampler
    time.sleep(0.5)
    baseline = rss_bytes(serve.process.pid)
    seen = []
    with RssSampler(serve.process.pid) as sampler:
        for route in routes:
            answer = httpx.post(serve.base_url + route, json=bodies(TEXT)[route], headers=headers, timeout=120)
            seen.append((route, answer.status_code, answer.text[:160]))
            assert answer.status_code == 400 and "the model's context of 2048 tokens" in answer.text, seen
    assert sampler.peak - baseline < PEAK_BOUND, f"RSS peaked {(sampler.peak - baseline) / MB:.0f} MB above {seen}"
    time.sleep(1)
    after = rss_bytes(serve.process.pid) - baseline
    assert after < SETTLED_BOUND, f"RSS stayed {after / MB:.0f} MB above its baseline after {seen}"
