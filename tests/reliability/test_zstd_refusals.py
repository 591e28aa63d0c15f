"""A refused zstd body releases its seq_id at once too, however broken: too large with a first block
longer than the prefix a refusal reads of other bodies, cut short after its first block, or
labelled zstd while it is not. Only a body cut inside its first compressed block names no ids that
can be read: it gets a 400 that says so, and its seq_id is left to the gap rule."""

from __future__ import annotations

import numpy as np
import zstandard

from api.refusals import PREFIX_BYTES, read_seq_ref
from tests.reliability.test_seq_refusals import (
    MAX_BODY,
    PROTOBUF,
    chunked,
    datum,
    finishes_promptly,
    header_then,
    http,
    new_model,
    proto,
    server,  # noqa: F401 (the module's server: a pytest fixture)
    stored,
)

ZSTD = PROTOBUF | {"Content-Encoding": "zstd"}


def hard_to_compress(model_id: str, seq_id: int, values: int) -> bytes:
    """A zstd body of float32 noise (as logprobs or advantages are): its blocks compress to ~92 %, so the
    first one ends past PREFIX_BYTES, with the ids in it."""
    noise = np.random.default_rng(seq_id).standard_normal(values).astype(np.float32).tobytes()
    return zstandard.ZstdCompressor().compress(header_then(model_id, seq_id, noise))


def test_the_ids_of_a_large_first_block_are_read():
    body = hard_to_compress("m", 3, 40_000)
    assert read_seq_ref(body[:PREFIX_BYTES], "application/x-protobuf", "zstd") is None  # what was read before
    assert read_seq_ref(body, "application/x-protobuf", "zstd") == ("m", 3)


def test_refused_zstd_bodies_release_their_seq_ids(server):  # noqa: F811
    key = server.new_tenant()
    model_id = new_model(server, key)
    cases = {
        "over the size limit (Content-Length)": lambda h, s: h.post(
            "/api/v1/forward_backward", content=hard_to_compress(model_id, s, MAX_BODY // 2), headers=ZSTD),
        "over the size limit (chunked)": lambda h, s: h.post(
            "/api/v1/forward_backward", content=chunked(hard_to_compress(model_id, s, MAX_BODY // 2)), headers=ZSTD),
        "cut short after its first block": lambda h, s: h.post(
            "/api/v1/forward_backward", headers=ZSTD, content=zstandard.ZstdCompressor().compress(
                header_then(model_id, s, b"\x00" * 300_000))[:-3]),
        "labelled zstd, plain protobuf": lambda h, s: h.post(
            "/api/v1/forward_backward", content=proto(model_id, s, [datum([1, 2, 3])]).SerializeToString(),
            headers=ZSTD),
        "labelled zstd, plain JSON": lambda h, s: h.post(
            "/api/v1/optim_step", json={"model_id": model_id, "seq_id": s, "adam_params": [1e-3]},
            headers={"Content-Encoding": "zstd"}),
    }
    with http(server, key) as client:
        seq = 1
        for case, send in cases.items():
            refused = send(client, seq)
            assert refused.status_code in (400, 413, 422), (case, refused.status_code, refused.text)
            record = stored(server, model_id, seq)
            assert record is not None and str(refused.status_code) in record.error["error"], case
            assert "error" not in finishes_promptly(client, model_id, seq + 1), case
            seq += 2


def test_bad_zstd_bodies_get_a_400_that_says_what_is_wrong(server):  # noqa: F811
    key = server.new_tenant()
    model_id = new_model(server, key)
    body = proto(model_id, 1, [datum([1, 2, 3])]).SerializeToString()
    with http(server, key) as client:
        plain = client.post("/api/v1/forward_backward", content=body, headers=ZSTD)
        assert plain.status_code == 400 and "body: Content-Encoding says zstd, but the body is not a zstd frame" \
            in plain.json()["detail"]
        # cut inside its one compressed block: no ids can be read from it, so nothing is released
        cut = hard_to_compress(model_id, 3, 40_000)[:1000]
        short = client.post("/api/v1/forward_backward", content=cut, headers=ZSTD)
        assert short.status_code == 400 and "cut short" in short.json()["detail"], short.text
        assert stored(server, model_id, 3) is None
