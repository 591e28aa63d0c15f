"""A refused training request releases its seq_id at once, on every training route, for every kind
of refusal: the model's next request runs in well under the gap timeout (60 s here), instead of
waiting for a seq_id that the server refused. Absurd seq_ids are refused and release nothing; a
refusal by someone who is not the model's owner releases nothing either.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import numpy as np
import pytest
import sqlalchemy as sa
import tinker
import zstandard
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from db.models import Quota, Request, RequestState
from tests.servers import running_server
from tests.waiting import wait_until

MAX_BODY = 256 * 1024  # the server's body limit here: oversized bodies stay small in the test
PROMPT_SECONDS = 30.0  # the next request finishes within this, against a 60 s gap timeout
PROTOBUF = {"Content-Type": "application/x-protobuf"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("seq"), sampler_enabled=False, max_request_bytes=MAX_BODY,
                        seq_gap_seconds=60) as running:
        yield running


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": np.ones(len(tokens) - 1, np.float32)})


def proto(model_id: str, seq_id: int, data: list[types.Datum], forward_only: bool = False):
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"), model_id=model_id,
        seq_id=seq_id)
    message = forward_backward_request_to_proto(request)
    message.forward_only = forward_only
    return message


def header_then(model_id: str, seq_id: int, rest: bytes) -> bytes:
    """A protobuf body whose fields 1 and 2 (model_id, seq_id) are readable, followed by `rest`."""
    encoded = model_id.encode()
    return bytes([0x0A, len(encoded)]) + encoded + bytes([0x10]) + _varint(seq_id) + rest


def _varint(n: int) -> bytes:
    out = b""
    while True:
        byte, n = n & 0x7F, n >> 7
        out += bytes([byte | (0x80 if n else 0)])
        if not n:
            return out


def with_dtype_99(model_id: str, seq_id: int) -> bytes:
    message = proto(model_id, seq_id, [datum([1, 2, 3, 4])])
    message.data[0].loss_fn_inputs["weights"].dtype = 99
    return message.SerializeToString()


def chunked(body: bytes):
    for i in range(0, len(body), 64 * 1024):
        yield body[i:i + 64 * 1024]


# Each case: (route, how it is sent) -> an httpx call that the server refuses with a 4xx.
Send = Callable[[httpx.Client, str, int], httpx.Response]
REFUSALS: dict[str, Send] = {
    "forward_backward: negative token id": lambda h, m, s: h.post(
        "/api/v1/forward_backward", content=proto(m, s, [datum([1, -2, 3])]).SerializeToString(), headers=PROTOBUF),
    "forward_backward: empty datum": lambda h, m, s: h.post(
        "/api/v1/forward_backward", content=proto(m, s, [types.Datum(
            model_input=types.ModelInput.from_ints([]), loss_fn_inputs={})]).SerializeToString(), headers=PROTOBUF),
    "forward_backward: dtype 99": lambda h, m, s: h.post(
        "/api/v1/forward_backward", content=with_dtype_99(m, s), headers=PROTOBUF),
    "forward_backward: protobuf garbage after the header": lambda h, m, s: h.post(
        "/api/v1/forward_backward", content=header_then(m, s, b"\xff" * 40), headers=PROTOBUF),
    "forward_backward: zstd garbage": lambda h, m, s: h.post(
        "/api/v1/forward_backward", content=zstandard.ZstdCompressor().compress(header_then(m, s, b"\xff" * 40)),
        headers=PROTOBUF | {"Content-Encoding": "zstd"}),
    "forward_backward: over the size limit (Content-Length)": lambda h, m, s: h.post(
        "/api/v1/forward_backward", content=header_then(m, s, b"\x00" * (2 * MAX_BODY)), headers=PROTOBUF),
    "forward_backward: over the size limit (chunked)": lambda h, m, s: h.post(
        "/api/v1/forward_backward", content=chunked(header_then(m, s, b"\x00" * (2 * MAX_BODY))), headers=PROTOBUF),
    "forward: token id over the vocabulary": lambda h, m, s: h.post(
        "/api/v1/forward_backward", content=proto(m, s, [datum([1, 10**6, 3])], forward_only=True).SerializeToString(),
        headers=PROTOBUF),
    "optim_step: adam_params as a list": lambda h, m, s: h.post(
        "/api/v1/optim_step", json={"model_id": m, "seq_id": s, "adam_params": [1e-3]}),
    "optim_step: unknown optimizer": lambda h, m, s: h.post(
        "/api/v1/optim_step", json={"model_id": m, "seq_id": s, "adam_params": {"type": "sgd"}}),
    "optim_step: text/plain body": lambda h, m, s: h.post(
        "/api/v1/optim_step", content=json.dumps({"model_id": m, "seq_id": s, "adam_params": {}}),
        headers={"Content-Type": "text/plain"}),
    "optim_step: NaN learning rate": lambda h, m, s: h.post(
        "/api/v1/optim_step", content=f'{{"model_id": "{m}", "seq_id": {s}, "adam_params": {{"learning_rate": NaN}}}}',
        headers={"Content-Type": "application/json"}),
    "save_weights: ttl_seconds 0": lambda h, m, s: h.post(
        "/api/v1/save_weights", json={"model_id": m, "seq_id": s, "path": "x", "ttl_seconds": 0}),
    "save_weights: ttl_seconds -5": lambda h, m, s: h.post(
        "/api/v1/save_weights", json={"model_id": m, "seq_id": s, "path": "x", "ttl_seconds": -5}),
    "save_weights_for_sampler: neither path nor session": lambda h, m, s: h.post(
        "/api/v1/save_weights_for_sampler", json={"model_id": m, "seq_id": s}),
    "load_weights: missing checkpoint": lambda h, m, s: h.post(
        "/api/v1/load_weights", json={"model_id": m, "seq_id": s, "path": f"tinker://{m}/weights/nope"}),
    "load_weights: malformed path": lambda h, m, s: h.post(
        "/api/v1/load_weights", json={"model_id": m, "seq_id": s, "path": "s3://elsewhere"}),
    "load_weights: sampler weights": lambda h, m, s: h.post(
        "/api/v1/load_weights", json={"model_id": m, "seq_id": s, "path": f"tinker://{m}/sampler_weights/x"}),
    "save_weights_external: not an age recipient": lambda h, m, s: h.post(
        "/api/v1/save_weights_external", json={"model_id": m, "seq_id": s, "path": "x", "type": "save_weights_external",
                                               "age_encryption_recipients": ["age1recipient"]}),
    "unknown route: made up": lambda h, m, s: h.post("/api/v1/no_such_route", json={"model_id": m, "seq_id": s}),
}


def new_model(server, key: str) -> str:
    client = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    return client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result().model_id


def http(server, key: str | None) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers={"X-API-Key": key} if key else {}, timeout=30)


def finishes_promptly(client: httpx.Client, model_id: str, seq_id: int) -> dict:
    """Send a good optim_step at `seq_id` and wait for its answer, at most PROMPT_SECONDS."""
    accepted = client.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": seq_id, "adam_params": {}})
    assert accepted.status_code == 200, accepted.text

    def answer() -> dict | None:
        body = client.post("/api/v1/retrieve_future", json={"request_id": accepted.json()["request_id"]}).json()
        return None if body.get("type") == "try_again" else body

    return wait_until(answer, f"an answer to seq_id {seq_id} (none: it waited for a refused seq_id)",
                      timeout=PROMPT_SECONDS)


def stored(server, model_id: str, seq_id: int) -> Request | None:
    with server.embedded.sessions() as s:
        return s.scalar(sa.select(Request).where(Request.model_id == model_id, Request.seq_id == seq_id))


def test_every_refusal_releases_its_seq_id_at_once(server):
    key = server.new_tenant()
    model_id = new_model(server, key)
    with http(server, key) as client:
        seq = 1
        for case, send in REFUSALS.items():
            refused = send(client, model_id, seq)
            assert 400 <= refused.status_code < 500 and refused.status_code != 429, (case, refused.status_code)
            assert len(refused.content) < 1024, case  # no input echoed
            record = stored(server, model_id, seq)
            assert record is not None and record.error and str(refused.status_code) in record.error["error"], case
            answer = finishes_promptly(client, model_id, seq + 1)
            assert "error" not in answer, (case, answer)
            assert stored(server, model_id, seq).state == RequestState.FAILED, case
            seq += 2


def test_a_quota_refusal_releases_its_seq_id(server):
    key = server.new_tenant()
    model_id = new_model(server, key)
    with server.embedded.sessions() as s:
        tenant_id = s.scalar(sa.select(Request.tenant_id).where(Request.model_id == model_id))
        s.add(Quota(tenant_id=tenant_id, train_tokens_per_day=5))
        s.commit()
    with http(server, key) as client:
        body = proto(model_id, 1, [datum(list(range(1, 20)))]).SerializeToString()
        r = client.post("/api/v1/forward_backward", content=body, headers=PROTOBUF)
        assert r.status_code == 403 and "train_tokens_per_day" in r.text
        assert "error" not in finishes_promptly(client, model_id, 2)


def test_refusals_of_others_release_nothing(server):
    """No key, a revoked key or another tenant's key: the refusal is not the owner's, so the owner's
    own request with that seq_id is still accepted and runs."""
    key = server.new_tenant()
    model_id = new_model(server, key)
    for intruder in (None, "tml-not-a-key", server.new_tenant()):
        with http(server, intruder) as client:
            r = client.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": [1]})
            assert r.status_code in (401, 404, 422)
        assert stored(server, model_id, 1) is None
    with http(server, key) as client:
        assert "error" not in finishes_promptly(client, model_id, 1)


@pytest.mark.parametrize("seq_id", [0, -1, 10**30, 2000])
def test_absurd_seq_ids_are_refused_and_release_nothing(server, seq_id):
    key = server.new_tenant()
    model_id = new_model(server, key)
    with http(server, key) as client:
        r = client.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": seq_id, "adam_params": {}})
        assert r.status_code in (400, 422) and "seq_id" in r.json()["detail"], r.text
        if seq_id < 2**31:
            r = client.post("/api/v1/forward_backward", content=proto(model_id, seq_id, [datum([1, 2, 3])]).SerializeToString(),
                            headers=PROTOBUF)
            assert r.status_code in (400, 422) and "seq_id" in r.json()["detail"], r.text
        with server.embedded.sessions() as s:
            assert s.scalar(sa.select(sa.func.count()).select_from(Request).where(
                Request.model_id == model_id, Request.seq_id != 0)) == 0
        assert "error" not in finishes_promptly(client, model_id, 1)
