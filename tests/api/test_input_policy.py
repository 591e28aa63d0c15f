"""The input policy (api/input_policy.py), one test per failure it was written for (issue 42, point 2):
strings and numbers that made a route answer 500, input that was stored and then broke every later
read, stored strings without a size, and 400s that showed Python's own words. On the app alone
(tests/api/conftest.py): whatever a route accepts is stored as it would be in production.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient
from loraplex.wire import tinker_public_pb2 as pb

from api.deps import tenant_of_key
from api.input_policy import ID_CHARS, LABEL_CHARS, MAX_JSON_DEPTH, METADATA_MAX_BYTES, METADATA_MAX_DEPTH
from db import rollouts
from db.models import ClientSession, TrainingModel, new_id

JSON = {"Content-Type": "application/json"}
SURROGATE = '"\\ud800"'  # a lone surrogate, as JSON text spells it
MB = 1 << 20


def nested_object(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


def nested_array(depth: int) -> str:
    return "[" * depth + "]" * depth


def post_raw(http: TestClient, route: str, text: str):
    return http.post(route, content=text.encode(), headers=JSON)


def detail(response) -> str:
    body = response.json()
    if "detail" in body:
        return body["detail"]
    error = body["error"]
    return error["message"]


def assert_refused(response, status: int, field: str) -> str:
    assert response.status_code == status, response.text[:300]
    message = detail(response)
    assert message.startswith(field), message
    for internal in ("Traceback", "__init__", "not supported between instances", "UnicodeEncodeError"):
        assert internal not in message, message
    assert len(response.content) < 1024
    return message


@pytest.fixture
def tenant(api):
    key = api.key("alice")
    http = api.as_tenant(key)
    session_id = http.post("/create_session", json={"tags": [], "sdk_version": "test"}).json()["session_id"]
    return http, key, session_id


def new_model(http, session_id: str, seq: int, **more) -> str:
    answer = http.post("/create_model", json={"session_id": session_id, "model_seq_id": seq, "base_model": "tiny",
                                              "lora_config": {"rank": 4}, **more})
    assert answer.status_code == 200, answer.text
    return answer.json()["model_id"]


def reads_work(http, session_id: str) -> None:
    """Every read of the tenant's stored sessions, runs and checkpoints answers 200."""
    for route in ("/training_runs", "/checkpoints", "/sessions", f"/sessions/{session_id}"):
        answer = http.get(route)
        assert answer.status_code == 200, (route, answer.text[:300])
    for run in http.get("/training_runs").json()["training_runs"]:
        assert http.get(f"/training_runs/{run['training_run_id']}").status_code == 200


# --- lone surrogates: were 500s ------------------------------------------------------------------


def test_a_lone_surrogate_in_get_info_model_id_is_a_400_naming_it(tenant):
    http, _, _ = tenant
    assert_refused(post_raw(http, "/get_info", f'{{"model_id": {SURROGATE}}}'), 400, "model_id")


def test_a_lone_surrogate_in_retrieve_future_request_id_is_a_400_naming_it(tenant):
    http, _, _ = tenant
    assert_refused(post_raw(http, "/retrieve_future", f'{{"request_id": {SURROGATE}}}'), 400, "request_id")


def test_a_lone_surrogate_in_a_chat_message_is_a_400_in_openais_shape(api, tenant):
    _, key, _ = tenant
    oai = TestClient(api.app, base_url="http://test/oai/api/v1", headers={"Authorization": f"Bearer {key}"})
    answer = post_raw(oai, "/chat/completions",
                      f'{{"model": "tiny", "messages": [{{"role": "user", "content": {SURROGATE}}}]}}')
    assert_refused(answer, 400, "messages[0].content")
    assert answer.json()["error"]["param"] == "messages[0].content"


def test_a_lone_surrogate_in_a_key_and_bytes_that_are_not_utf8_are_refused(tenant):
    http, _, session_id = tenant
    assert_refused(post_raw(http, "/create_session", f'{{"user_metadata": {{{SURROGATE}: 1}}}}'), 400, "user_metadata")
    answer = http.post("/create_session", content=b'{"sdk_version": "\xff\xfe"}', headers=JSON)
    assert_refused(answer, 400, "body")
    reads_work(http, session_id)


def test_a_lone_surrogate_in_an_optim_step_still_releases_its_seq_id(api, tenant):
    """The refusal of a body naming (model_id, seq_id) is recorded; a surrogate in the id is never looked up."""
    http, _, session_id = tenant
    model_id = new_model(http, session_id, 0)
    answer = post_raw(http, "/optim_step", f'{{"model_id": "{model_id}", "seq_id": 1, '
                                           f'"adam_params": {{"learning_rate": {SURROGATE}}}}}')
    assert_refused(answer, 400, "adam_params.learning_rate")
    assert [q.seq_id for q in api.scheduler.submitted if q.model_id == model_id] == [0, 1]  # 1: the refusal
    assert_refused(post_raw(http, "/optim_step", f'{{"model_id": {SURROGATE}, "seq_id": 1}}'), 400, "model_id")


# --- numbers out of their column's range ---------------------------------------------------------


def test_a_reward_turn_of_2_to_the_70_is_refused_naming_turn(api, tenant):
    http, key, _ = tenant
    with api.sessions() as s:
        tenant_id = tenant_of_key(s, key).id
    rollouts.record_turn(api.sessions, tenant_id, "ep", rollouts.NewTurn(
        id=new_id(), api="completions", model="tiny", sampler_path=None, adapter_path=None, policy_version=None,
        request_id=new_id(), prompt=[1, 2], choices=[rollouts.SampledChoice([3], [-0.5], "stop")],
        request_body={"model": "tiny", "prompt": [1, 2]}, response_body={"id": "x"}))
    for field, body in (("turn", {"reward": 1.0, "turn": 2**70}), ("turn", {"reward": 1.0, "turn": 2**31}),
                        ("choice", {"reward": 1.0, "turn": 0, "choice": 2**70})):
        assert_refused(http.put("/rollouts/trajectories/ep/reward", json=body), 422, field)
    assert http.put("/rollouts/trajectories/ep/reward", json={"reward": 1.0, "turn": 0, "choice": 0}).status_code == 200
    assert http.get("/rollouts/trajectories/ep").status_code == 200


# --- nesting: a 500 at once, or stored and then every read a 500 -----------------------------------


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 900, 100_000])
def test_user_metadata_nested_too_deep_is_refused_and_the_runs_still_list(tenant, depth):
    http, _, session_id = tenant
    new_model(http, session_id, 0, user_metadata={"recipe": "sft"})
    body = (f'{{"session_id": "{session_id}", "model_seq_id": 1, "base_model": "tiny", '
            f'"user_metadata": {nested_object(depth)}}}')
    assert_refused(post_raw(http, "/create_model", body), 400, "user_metadata" if depth < 1000 else "body")
    reads_work(http, session_id)
    assert len(http.get("/training_runs").json()["training_runs"]) == 1


def test_user_metadata_deeper_than_metadata_allows_is_a_422_naming_it(tenant):
    http, _, session_id = tenant
    deep = json.loads(nested_object(METADATA_MAX_DEPTH + 1))  # fine as JSON, too deep for metadata
    message = assert_refused(http.post("/create_session", json={"user_metadata": deep}), 422, "user_metadata")
    assert f"nested deeper than {METADATA_MAX_DEPTH} levels" in message
    assert http.post("/create_session", json={"user_metadata": json.loads(nested_object(METADATA_MAX_DEPTH))}
                     ).status_code == 200
    reads_work(http, session_id)


@pytest.mark.parametrize("metadata", [nested_object(900), f'{{"a": {SURROGATE}}}'], ids=["nested", "surrogate"])
def test_create_session_refuses_what_get_session_could_not_answer(tenant, metadata):
    http, _, session_id = tenant
    assert_refused(post_raw(http, "/create_session", f'{{"user_metadata": {metadata}}}'), 400, "user_metadata")
    reads_work(http, session_id)


def test_openai_metadata_nested_100000_levels_is_a_400(api, tenant):
    _, key, _ = tenant
    oai = TestClient(api.app, base_url="http://test/oai/api/v1", headers={"Authorization": f"Bearer {key}"})
    chat = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "metadata": '
    body = chat + nested_object(100_000) + "}"
    answer = post_raw(oai, "/chat/completions", body)
    assert_refused(answer, 400, "body")
    assert answer.json()["error"]["type"] == "invalid_request_error"
    deep = chat + nested_object(200) + "}"
    assert_refused(post_raw(oai, "/chat/completions", deep), 400, "metadata")


def test_an_anthropic_tool_schema_nested_100000_levels_is_a_400_in_anthropics_shape(api, tenant):
    _, key, _ = tenant
    anthropic = TestClient(api.app, base_url="http://test/anthropic/v1", headers={"x-api-key": key})
    for depth, field in ((100_000, "body"), (MAX_JSON_DEPTH + 5, "tools[0].input_schema")):
        body = (f'{{"model": "tiny", "max_tokens": 4, "messages": [{{"role": "user", "content": "hi"}}], '
                f'"tools": [{{"name": "t", "input_schema": {nested_array(depth)}}}]}}')
        answer = post_raw(anthropic, "/messages", body)
        assert_refused(answer, 400, field)
        assert answer.json()["type"] == "error" and answer.json()["error"]["type"] == "invalid_request_error"


# --- sizes of stored strings ----------------------------------------------------------------------


@pytest.mark.parametrize("field", ["sdk_version", "display_name", "project_id"])
def test_a_10_mb_session_label_is_refused_naming_it(tenant, field):
    http, _, session_id = tenant
    assert_refused(http.post("/create_session", json={field: "x" * (10 * MB)}), 422, field)
    assert http.post("/create_session", json={field: "x" * LABEL_CHARS}).status_code == 200
    reads_work(http, session_id)


def test_metadata_values_and_tags_have_a_size(tenant):
    http, _, session_id = tenant
    big = {"notes": "x" * (10 * MB)}
    assert_refused(http.post("/create_session", json={"user_metadata": big}), 422, "user_metadata")
    assert_refused(http.post("/create_session", json={"tags": ["x" * 10_000]}), 422, "tags")
    assert_refused(http.post("/create_session", json={"tags": ["t"] * 1000}), 422, "tags")
    assert_refused(http.post("/create_model", json={"session_id": session_id, "model_seq_id": 3, "base_model": "tiny",
                                                    "user_metadata": big}), 422, "user_metadata")
    model_id = new_model(http, session_id, 0)
    save = {"model_id": model_id, "seq_id": 1, "path": "c", "user_metadata": {"k": "v" * (METADATA_MAX_BYTES + 1)}}
    assert_refused(http.post("/save_weights", json=save), 422, "user_metadata")
    # within the bounds, kept and answered as sent
    kept = {"recipe": "sft", "config": {"lr": 1e-4, "layers": [1, 2, 3]}}
    assert http.post("/create_model", json={"session_id": session_id, "model_seq_id": 4, "base_model": "tiny",
                                            "user_metadata": kept}).status_code == 200
    assert http.get(f"/training_runs/{session_id}:train:4").json()["user_metadata"] == kept
    reads_work(http, session_id)


def test_ids_in_bodies_have_a_size(tenant):
    http, _, _ = tenant
    for route, field in (("/get_info", "model_id"), ("/retrieve_future", "request_id"),
                         ("/session_heartbeat", "session_id"), ("/weights_info", "tinker_path")):
        assert_refused(http.post(route, json={field: "x" * (ID_CHARS + 1)}), 422, field)


def test_a_protobuf_model_id_over_the_id_size_is_refused_naming_it(tenant):
    http, _, session_id = tenant
    new_model(http, session_id, 0)
    msg = pb.ForwardBackwardRequest(model_id="x" * (ID_CHARS + 1), seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray([1, 2], "<i4").tobytes()
    answer = http.post("/forward_backward", content=msg.SerializeToString(),
                       headers={"Content-Type": "application/x-protobuf"})
    assert_refused(answer, 400, "model_id")


# --- errors in the project's words ---------------------------------------------------------------


def test_adam_params_are_refused_in_the_projects_words(tenant):
    http, _, session_id = tenant
    model_id = new_model(http, session_id, 0)
    cases = [({"foo": 1}, "adam_params.foo"), ({"learning_rate": "x"}, "adam_params.learning_rate"),
             ({"beta1": None}, "adam_params.beta1"), ({"eps": [1]}, "adam_params.eps"),
             ({"learning_rate": True}, "adam_params.learning_rate")]
    for seq, (adam, field) in enumerate(cases, start=1):
        answer = http.post("/optim_step", json={"model_id": model_id, "seq_id": seq, "adam_params": adam})
        message = assert_refused(answer, 400, field)
        assert "got an unexpected keyword" not in message and "'>='" not in message
    assert "known: learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm" in detail(
        http.post("/optim_step", json={"model_id": model_id, "seq_id": 9, "adam_params": {"lr": 1}}))


# --- reads of what was stored before the policy ----------------------------------------------------


def test_rows_stored_before_the_policy_are_still_answered(api, tenant):
    """Rows as the server stored them before these bounds: listings and gets answer, the metadata cut
    at MAX_JSON_DEPTH and lone surrogates replaced."""
    http, key, session_id = tenant
    deep = json.loads(nested_object(900))
    with api.sessions() as s:
        tenant_id = tenant_of_key(s, key).id
        old = ClientSession(tenant_id=tenant_id, tags=[], user_metadata={"a": "\ud800", "display_name": "\udfff",
                                                                          "deep": deep}, sdk_version="x")
        s.add(old)
        s.flush()
        s.add(TrainingModel(id=f"{old.id}:train:0", tenant_id=tenant_id, session_id=old.id, base_model="tiny",
                            lora_config={"rank": 4, "alpha": 32.0, "seed": 0, "train_attn": True, "train_mlp": True,
                                         "train_unembed": True}, user_metadata=deep, last_applied_seq_id=-1))
        s.commit()
        old_id = old.id
    rollouts.record_turn(api.sessions, tenant_id, "old", rollouts.NewTurn(
        id=new_id(), api="chat.completions", model="tiny", sampler_path=None, adapter_path=None, policy_version=None,
        request_id=new_id(), prompt=[1], choices=[rollouts.SampledChoice([2], [-0.1], "stop")],
        request_body={"model": "tiny", "tools": deep, "messages": [{"role": "user", "content": "\ud800"}]},
        response_body={"id": "x"}))
    reads_work(http, session_id)
    got = http.get(f"/sessions/{old_id}").json()
    assert got["user_metadata"]["a"] == "\ufffd" and got["display_name"] == "\ufffd"
    run = http.get(f"/training_runs/{old_id}:train:0").json()
    assert json.dumps(run["user_metadata"]).count('"a"') == MAX_JSON_DEPTH
    turn = http.get("/rollouts/trajectories/old").json()["turns"][0]
    assert turn["request"]["messages"][0]["content"] == "\ufffd"
