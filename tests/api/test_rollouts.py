"""The rollout store's REST routes and the inference API's door (keys, errors), on the app alone:
turns are recorded as the inference routes record them; no sampler stands behind the app."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from api.deps import tenant_of_key
from db import rollouts
from db.models import new_id


def record(api, key: str, session: str | None, prompt: list[int], *choices: list[int]) -> tuple[str, int]:
    with api.sessions() as s:
        tenant = tenant_of_key(s, key)
    turn = rollouts.NewTurn(
        id=new_id(), api="completions", model="tiny", sampler_path=None, adapter_path=None, policy_version=None,
        request_id=new_id(), prompt=prompt, request_body={"model": "tiny", "prompt": prompt}, response_body={"id": "x"},
        choices=[rollouts.SampledChoice(tokens, [-0.5] * len(tokens), "stop") for tokens in choices])
    return rollouts.record_turn(api.sessions, tenant.id, session, turn)


@pytest.fixture
def keys(api):
    return api.key("alice"), api.key("bob")


def test_trajectories_are_the_tenants_own(api, keys):
    alice, bob = keys
    assert record(api, alice, "ep-1", [1, 2], [3, 4]) == ("ep-1", 0)
    assert record(api, alice, "ep-1", [1, 2, 3, 4, 5], [6]) == ("ep-1", 1)
    anonymous, _ = record(api, alice, None, [7], [8])
    record(api, bob, "ep-1", [9], [10])  # the same name, another tenant: another trajectory
    a, b = api.as_tenant(alice), api.as_tenant(bob)

    listed = a.get("/rollouts/trajectories").json()
    assert listed["total"] == 2 and [t["session_id"] for t in listed["trajectories"]] == [anonymous, "ep-1"]
    assert listed["trajectories"][1] | {"created_at": None, "updated_at": None} == {
        "session_id": "ep-1", "num_turns": 2, "reward": None, "policy_versions": [None, None],
        "created_at": None, "updated_at": None}
    [theirs] = b.get("/rollouts/trajectories").json()["trajectories"]
    assert theirs["num_turns"] == 1
    stored = a.get("/rollouts/trajectories/ep-1").json()
    assert [t["prompt_tokens"] for t in stored["turns"]] == [[1, 2], [1, 2, 3, 4, 5]]
    assert stored["turns"][0]["samples"] == [{"choice": 0, "tokens": [3, 4], "logprobs": [-0.5, -0.5],
                                              "finish_reason": "stop", "reward": None}]
    assert stored["turns"][0]["request"] == {"model": "tiny", "prompt": [1, 2]}
    assert b.get("/rollouts/trajectories/ep-1").json()["turns"][0]["prompt_tokens"] == [9]

    # another tenant's trajectory answers exactly as one that exists nowhere
    for method, suffix, body in (("GET", "", None), ("PUT", "/reward", {"reward": 1.0}), ("DELETE", "", None),
                                 ("GET", "/datums", None)):
        theirs = b.request(method, f"/rollouts/trajectories/{anonymous}{suffix}", json=body)
        nobody = b.request(method, f"/rollouts/trajectories/nobody{suffix}", json=body)
        assert theirs.status_code == nobody.status_code == 404
        assert theirs.json()["detail"].replace(anonymous, "X") == nobody.json()["detail"].replace("nobody", "X")


def test_rewards_datums_and_delete(api, keys):
    alice, _ = keys
    record(api, alice, "ep-2", [1, 2], [3, 4])
    record(api, alice, "ep-2", [1, 2, 3, 4, 5], [6], [7, 8])  # two choices: one datum per turn and choice
    a = api.as_tenant(alice)
    no_reward = a.get("/rollouts/trajectories/ep-2/datums")
    assert no_reward.status_code == 400 and no_reward.json()["detail"].startswith("advantage: ")
    assert a.put("/rollouts/trajectories/ep-2/reward", json={"reward": 1.0}).status_code == 200
    assert a.put("/rollouts/trajectories/ep-2/reward", json={"reward": -1.0, "turn": 1, "choice": 1}).status_code == 200
    assert a.put("/rollouts/trajectories/ep-2/reward", json={"reward": 1.0, "turn": 5}).json()["detail"] == \
        "turn: trajectory 'ep-2' has no turn 5"
    assert a.put("/rollouts/trajectories/ep-2/reward", json={"reward": 1.0, "choice": 0}).status_code == 400
    assert a.put("/rollouts/trajectories/ep-2/reward", json={"reward": 1.0, "turn": 1, "choice": 7}).status_code == 404
    built = a.get("/rollouts/trajectories/ep-2/datums").json()
    assert not built["per_trajectory"] and built["sources"] == [[[0, 0]], [[1, 0]], [[1, 1]]]
    assert [d["loss_fn_inputs"]["advantages"]["data"][-1] for d in built["datums"]] == [1.0, 1.0, -1.0]
    sft = a.get("/rollouts/trajectories/ep-2/datums", params={"kind": "sft"}).json()
    assert set(sft["datums"][0]["loss_fn_inputs"]) == {"target_tokens", "weights"}
    assert a.get("/rollouts/trajectories/ep-2/datums", params={"advantage": "inf"}).status_code == 400
    assert a.delete("/rollouts/trajectories/ep-2").status_code == 200
    assert a.get("/rollouts/trajectories/ep-2").status_code == 404


# --- the inference API's door --------------------------------------------------------------------


def oai(api, headers: dict | None = None) -> TestClient:
    return TestClient(api.app, base_url="http://test/oai/api/v1", headers=headers or {})


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def test_keys_come_as_a_bearer_token_or_x_api_key_and_errors_come_in_openais_shape(api, keys):
    alice, _ = keys
    missing = oai(api).post("/chat/completions", json=CHAT)
    assert missing.status_code == 401 and missing.json()["error"]["param"] == "api_key"
    wrong = oai(api, {"Authorization": "Bearer tml-wrong"}).post("/chat/completions", json=CHAT)
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    for headers in ({"Authorization": f"Bearer {alice}"}, {"x-api-key": alice}):
        # past the key: this app has no sampler, and says so
        answer = oai(api, headers).post("/chat/completions", json=CHAT)
        assert answer.status_code == 400 and "sampling is not available" in answer.json()["error"]["message"]
    client = oai(api, {"Authorization": f"Bearer {alice}"})
    unknown = client.post("/completions", json={"model": "gpt-4o", "prompt": "hi"}).json()["error"]
    assert unknown["param"] == "model" and unknown["code"] == "model_not_found"
    assert client.post("/chat/completions", content=b"{").json()["error"]["message"].startswith("body: not valid JSON")
    models = client.get("/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["loraplex/tiny"]


def test_routes_not_served_yet_say_so(api, keys):
    alice, _ = keys
    answer = oai(api, {"Authorization": f"Bearer {alice}"}).post("/embeddings", json=CHAT)
    assert answer.status_code == 404 and answer.json()["error"]["message"].startswith(
        "/oai/api/v1/embeddings: not supported by this server yet")
    anthropic = TestClient(api.app, base_url="http://test/anthropic")
    assert anthropic.post("/v1/messages", json={}).status_code == 401
    answer = anthropic.get("/v1/files", headers={"x-api-key": alice})
    assert answer.status_code == 404 and answer.json()["error"]["type"] == "not_found_error"
    assert answer.json()["error"]["message"].startswith("/anthropic/v1/files: not supported by this server")
    # the Messages API itself, past the key: this app has no sampler, and says so in Anthropic's shape
    answer = anthropic.post("/v1/messages", headers={"x-api-key": alice}, json={
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 400 and answer.json()["type"] == "error"
    assert answer.json()["error"]["message"].startswith("model: sampling is not available")


def test_a_long_conversation_with_a_bearer_key_gets_past_the_body_guard(api, keys):
    alice, _ = keys
    body = json.dumps(CHAT | {"messages": [{"role": "user", "content": "x" * 100_000}]})  # > the 64 KiB without a key
    assert oai(api).post("/chat/completions", content=body).status_code == 401
    answer = oai(api, {"Authorization": f"Bearer {alice}"}).post("/chat/completions", content=body)
    assert answer.status_code == 400  # read, rendered, and found too long for the model, naming the field
    assert answer.json()["error"]["message"].startswith("messages: the prompt is 100008 tokens; the model's context")
