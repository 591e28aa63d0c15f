"""Property-based fuzzing (hypothesis) of every route that stores input and then reads it back: whatever
a request's fields hold (lone surrogates, nesting past any library's limit, integers past any column,
NaN, strings of megabytes, the wrong types), the route answers below 500, and every later read of the
tenant (the listings and gets of what it stored) still answers 200. One tenant keeps everything stored
across a test's examples, so a row stored by one example must not break the reads of the next.

On the app alone (tests/api/conftest.py); the inference routes store nothing without a sampler, and
are fuzzed for their answers only. A few dozen examples per route by default, derandomized (the same
requests every run); `-m slow` runs the heavier search.
"""

from __future__ import annotations

import itertools
import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from api.deps import tenant_of_key
from db import rollouts
from db.models import new_id

JSON = {"Content-Type": "application/json"}
RUNS = [pytest.param(10, id="quick"), pytest.param(200, id="heavy", marks=pytest.mark.slow)]

# --- JSON text, good and bad (as text: nesting past 1,000 levels cannot be built with json.dumps) ---

SURROGATES = st.sampled_from(['"\\ud800"', '"a\\udfff"', '"\\udbff\\u0041"', '"\\ud83d\\ude00"'])  # the last is a pair
NUMBERS = st.one_of(
    st.integers(-2**80, 2**80).map(str), st.sampled_from(["1e309", "-1e309", "NaN", "Infinity", "-0.0", "1e-400"]),
    st.floats(allow_nan=False, allow_infinity=False).map(repr).filter(lambda r: "e" in r or "." in r),
)
STRINGS = st.one_of(st.text(max_size=40).map(json.dumps), SURROGATES,
                    st.sampled_from([300, 5_000, 2_000_000]).map(lambda n: json.dumps("x" * n)))
SCALARS = st.one_of(STRINGS, NUMBERS, st.sampled_from(["true", "false", "null"]))
# around each limit that mattered: the policy's 64, pydantic's 255, Python's ~1,000 (a 500 when stored
# and read back), and far past them all
DEPTHS = st.sampled_from([64, 65, 256, 900, 5_000, 100_000])
DEEP = st.one_of(DEPTHS.map(lambda d: "[" * d + "]" * d), DEPTHS.map(lambda d: '{"k": ' * d + "0" + "}" * d))


def _containers(children):
    return st.one_of(st.lists(children, max_size=4).map(lambda xs: "[" + ", ".join(xs) + "]"),
                     st.lists(st.tuples(STRINGS, children), max_size=4).map(
                         lambda kv: "{" + ", ".join(f"{k}: {v}" for k, v in kv) + "}"))


VALUES = st.one_of(DEEP, SURROGATES, st.recursive(st.one_of(SCALARS, DEEP), _containers, max_leaves=8))


BAD = st.one_of(DEEP, SURROGATES, st.sampled_from([300, 2_000_000]).map(lambda n: json.dumps("x" * n)),
                st.sampled_from(["1e309", "NaN", str(2**70), str(-2**63 - 1), str(2**31)]))


def spoiled(good) -> st.SearchStrategy[str]:
    """`good` (a Python value) as JSON text with one bad part where a route looks: a bad value instead of
    it, or (recursively) instead of one of its keys' values or list items, the rest left good."""
    if isinstance(good, dict) and good:
        def replace(key: str) -> st.SearchStrategy[str]:
            rest = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in good.items() if k != key]
            return spoiled(good[key]).map(lambda bad: "{" + ", ".join([f"{json.dumps(key)}: {bad}", *rest]) + "}")
        return st.one_of(BAD, st.sampled_from(sorted(good)).flatmap(replace))
    if isinstance(good, list) and good:
        def replace_item(i: int) -> st.SearchStrategy[str]:
            items = [json.dumps(v) for v in good]
            return spoiled(good[i]).map(lambda bad: "[" + ", ".join(items[:i] + [bad] + items[i + 1:]) + "]")
        return st.one_of(BAD, st.integers(0, len(good) - 1).flatmap(replace_item))
    return BAD


def fields(**good) -> st.SearchStrategy[str]:
    """A JSON object of these fields: one of them spoiled (its value with a bad part) or any value at all,
    each other one good (the value given) or left out, so the request gets past the rest of its checks."""
    names = list(good)

    def body(spoilt: str, bad: str, kept: list[bool]) -> str:
        parts = [f'"{name}": {bad if name == spoilt else json.dumps(good[name])}'
                 for name, keep in zip(names, kept) if keep or name == spoilt]
        return "{" + ", ".join(parts) + "}"

    def spoil(name: str) -> st.SearchStrategy[str]:
        bad = st.one_of(spoiled(good[name]), spoiled(good[name]), spoiled(good[name]), VALUES)
        return st.builds(lambda b, kept: body(name, b, kept), bad,
                         st.lists(st.sampled_from([True, True, False]), min_size=len(names), max_size=len(names)))

    return st.sampled_from(names).flatmap(spoil)


def fuzz(examples: int, picks: st.SearchStrategy, send, reads) -> None:
    """Send `examples` requests drawn from `picks` with `send(pick)` (its response), asserting each answer
    is below 500, a refusal short and without Python internals, and `reads()` (every later read) still
    working after it."""
    @given(pick=picks)
    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    def check(pick) -> None:
        answer = send(pick)
        assert answer.status_code < 500, (answer.status_code, answer.text[:300], str(pick)[:300])
        if answer.status_code >= 400:
            assert len(answer.content) < 1024 and "Traceback" not in answer.text, answer.text[:300]
        reads()

    check()


def with_field(text: str, name: str, value: int) -> str:
    """The JSON object `text` with `"name": value` first."""
    return f'{{"{name}": {value}' + (", " + text[1:] if text != "{}" else "}")


def ok(answer) -> None:
    assert answer.status_code == 200, answer.text[:300]


@pytest.fixture
def alice(api):
    key = api.key("alice")
    http = api.as_tenant(key)
    session_id = http.post("/create_session", json={"tags": []}).json()["session_id"]
    with api.sessions() as s:
        tenant_id = tenant_of_key(s, key).id
    return http, key, session_id, tenant_id


def read_everything(http: TestClient, session_id: str) -> None:
    key = http.headers["x-api-key"]
    dashboard = TestClient(http.app, base_url="http://test/dashboard/api", headers={"X-API-Key": key})
    ok(http.get("/sessions"))
    sessions = http.get("/sessions", params={"limit": 1000}).json()["sessions"]
    for sid in [session_id, *sessions[:3]]:
        ok(http.get(f"/sessions/{sid}"))
    runs = http.get("/training_runs", params={"limit": 1000})
    ok(runs)
    for run in runs.json()["training_runs"][:3]:
        ok(http.get(f"/training_runs/{run['training_run_id']}"))
        ok(http.get(f"/training_runs/{run['training_run_id']}/checkpoints"))
        ok(http.post("/get_info", json={"model_id": run["training_run_id"]}))
        ok(dashboard.get(f"/runs/{run['training_run_id']}/metrics"))
        ok(dashboard.get(f"/runs/{run['training_run_id']}"))
    ok(dashboard.get("/runs"))
    ok(http.get("/checkpoints"))
    ok(http.get("/rollouts/trajectories"))
    for trajectory in http.get("/rollouts/trajectories").json()["trajectories"][:3]:
        ok(http.get(f"/rollouts/trajectories/{trajectory['session_id']}"))


def post(http: TestClient, route: str):
    return lambda text: http.post(route, content=text.encode(), headers=JSON)


@pytest.mark.parametrize("examples", RUNS)
def test_create_session_then_reads(alice, examples):
    http, _, session_id, _ = alice
    bodies = fields(tags=["a", "b"], user_metadata={"recipe": "sft", "n": {"lr": 1e-4}}, sdk_version="1.0",
                    display_name="run", project_id="p")
    fuzz(examples, bodies, post(http, "/create_session"), lambda: read_everything(http, session_id))


@pytest.mark.parametrize("examples", RUNS)
def test_create_model_then_reads(alice, examples):
    http, _, session_id, _ = alice
    seqs = itertools.count(1)
    bodies = fields(session_id=session_id, base_model="tiny", lora_config={"rank": 4, "seed": 1},
                    user_metadata={"recipe": "rl"}, optimizer_config={"type": "adamw"})
    send = post(http, "/create_model")
    fuzz(examples, bodies, lambda text: send(with_field(text, "model_seq_id", next(seqs))),
         lambda: read_everything(http, session_id))


@pytest.mark.parametrize("examples", RUNS)
def test_training_requests_then_reads(alice, examples):
    """save_weights (user_metadata and path kept on the checkpoint), save_weights_for_sampler, optim_step
    and load_weights: stored as requests with their payloads."""
    http, _, session_id, _ = alice
    model_id = http.post("/create_model", json={"session_id": session_id, "model_seq_id": 0, "base_model": "tiny",
                                                "lora_config": {"rank": 4}}).json()["model_id"]
    seqs = itertools.count(1)
    routes = st.sampled_from(["/save_weights", "/save_weights_for_sampler", "/optim_step", "/load_weights"])
    bodies = st.tuples(routes, fields(
        model_id=model_id, path="ckpt", user_metadata={"k": "v"}, ttl_seconds=7200,
        adam_params={"learning_rate": 1e-4}, sampling_session_seq_id=1, overwrite=True))

    def send(pick):
        route, text = pick
        return http.post(route, content=with_field(text, "seq_id", next(seqs)).encode(), headers=JSON)

    fuzz(examples, bodies, send, lambda: read_everything(http, session_id))


@pytest.mark.parametrize("examples", RUNS)
def test_rewards_and_client_metrics_then_reads(api, alice, examples):
    http, key, session_id, tenant_id = alice
    model_id = http.post("/create_model", json={"session_id": session_id, "model_seq_id": 0, "base_model": "tiny",
                                                "lora_config": {"rank": 4}}).json()["model_id"]
    rollouts.record_turn(api.sessions, tenant_id, "ep", rollouts.NewTurn(
        id=new_id(), api="completions", model="tiny", sampler_path=None, adapter_path=None, policy_version=None,
        request_id=new_id(), prompt=[1, 2], choices=[rollouts.SampledChoice([3], [-0.5], "stop")] * 2,
        request_body={"model": "tiny", "prompt": [1, 2]}, response_body={"id": "x"}))
    rewards = fields(reward=0.5, turn=0, choice=1).map(lambda text: ("reward", text))
    metrics = fields(metrics={"reward/mean": 0.5}, step=3).map(lambda text: ("metrics", text))

    def send(pick):
        kind, text = pick
        if kind == "reward":
            return http.put("/rollouts/trajectories/ep/reward", content=text.encode(), headers=JSON)
        return http.post(f"/training_runs/{model_id}/metrics", content=text.encode(), headers=JSON)

    def reads() -> None:
        read_everything(http, session_id)
        ok(http.get("/rollouts/trajectories/ep/datums", params={"advantage": 1.0}))

    fuzz(examples, st.one_of(rewards, metrics), send, reads)


@pytest.mark.parametrize("examples", RUNS)
def test_inference_routes_answer_below_500(api, alice, examples):
    """Chat, completions, responses and messages: refused (no sampler here) but never a 500, in their
    API's error shape; the rollout store's reads still work after them."""
    http, key, session_id, _ = alice
    oai = TestClient(api.app, base_url="http://test/oai/api/v1", headers={"Authorization": f"Bearer {key}"})
    anthropic = TestClient(api.app, base_url="http://test/anthropic/v1", headers={"x-api-key": key})
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    routes = {
        "chat": (oai, "/chat/completions", fields(model="tiny", messages=messages, metadata={"session_id": "s"},
                                                  tools=[{"type": "function", "function": {"name": "t", "parameters": {
                                                      "type": "object", "properties": {"x": {"type": "string"}}}}}],
                                                  stop=["x"], max_tokens=4, seed=1)),
        "completions": (oai, "/completions", fields(model="tiny", prompt=[1, 2, 3], max_tokens=4, n=1)),
        "responses": (oai, "/responses", fields(model="tiny", input="hi", instructions="be brief",
                                                metadata={"k": "v"})),
        "messages": (anthropic, "/messages", fields(model="tiny", max_tokens=4, messages=messages[1:],
                                                    system="s", metadata={"user_id": "u"},
                                                    tools=[{"name": "t", "input_schema": {"type": "object"}}])),
    }

    def send(pick):
        name, text = pick
        client, route, _ = routes[name]
        answer = client.post(route, content=text.encode(), headers=JSON)
        if answer.status_code >= 400:  # in the API's own error shape
            assert "error" in answer.json(), answer.text[:300]
        return answer

    picks = st.sampled_from(sorted(routes)).flatmap(lambda name: st.tuples(st.just(name), routes[name][2]))
    fuzz(examples, picks, send, lambda: ok(http.get("/rollouts/trajectories")))
