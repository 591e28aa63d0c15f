"""A bare HTTP client of one tenant (httpx, no SDK): the reliability tests send exactly the bytes
they mean to, including ones no SDK would send, and see every status and body as it is."""

from __future__ import annotations

import numpy as np
import httpx

from loraplex.wire.client import encode_forward_backward_request
from tests.distributed.processes import wait_for

TOKENS = list(range(10, 30))
PROTOBUF = {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}


def checkpoint_url(tinker_path: str, tail: str = "") -> str:
    """The REST path of a checkpoint (tinker://<run>/<kind>/<name>), plus `tail` (/ttl, /publish, ...)."""
    run_id, kind, name = tinker_path.removeprefix("tinker://").split("/")
    return f"/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}{tail}"


def sft_inputs(tokens: list[int]) -> dict[str, np.ndarray]:
    return {"target_tokens": np.array(tokens[1:], np.int64), "weights": np.ones(len(tokens) - 1, np.float32)}


def forward_backward_body(model_id: str, seq_id: int, tokens: list[int] = TOKENS, forward_only: bool = False) -> bytes:
    """A valid, zstd-compressed ForwardBackwardRequest: one cross-entropy datum."""
    return encode_forward_backward_request(model_id, seq_id, [(tokens[:-1], sft_inputs(tokens))], "cross_entropy",
                                           forward_only=forward_only)


def send(base_url: str, key: str | None, call: dict) -> httpx.Response:
    """One request described as httpx.request's arguments (method, url under `base_url`, ...), with `key`."""
    call = dict(call)
    headers = dict(call.pop("headers", {})) | ({"X-API-Key": key} if key else {})
    return httpx.request(call.pop("method"), base_url + call.pop("url"), headers=headers, timeout=60, **call)


class Api:
    """POSTs and GETs under /api/v1 with one X-API-Key (or none)."""

    def __init__(self, base_url: str, key: str | None, timeout: float = 60) -> None:
        headers = {"X-API-Key": key} if key else {}
        self.http = httpx.Client(base_url=f"{base_url}/api/v1", headers=headers, timeout=timeout)

    def post(self, route: str, **kw) -> httpx.Response:
        return self.http.post(route, **kw)

    def accept(self, route: str, **kw) -> str:
        """Submit a request that must be accepted; its request id."""
        response = self.post(route, **kw)
        assert response.status_code == 200, (route, response.status_code, response.text[:500])
        return response.json()["request_id"]

    def forward_backward(self, model_id: str, seq_id: int, tokens: list[int] = TOKENS, forward_only: bool = False) -> str:
        return self.accept("forward_backward", content=forward_backward_body(model_id, seq_id, tokens, forward_only),
                           headers=PROTOBUF)

    def optim_step(self, model_id: str, seq_id: int, learning_rate: float = 1e-2) -> str:
        return self.accept("optim_step", json={"model_id": model_id, "seq_id": seq_id,
                                               "adam_params": {"learning_rate": learning_rate}})

    def result(self, request_id: str, seconds: float = 120) -> bytes:
        """The finished request's result body (fails on an error outcome or after `seconds`)."""
        return wait_for(self.post, request_id, seconds)

    def create_model(self, session_id: str, model_seq_id: int = 0, rank: int = 4, seed: int = 1) -> str:
        accepted = self.post("create_model", json={"session_id": session_id, "model_seq_id": model_seq_id,
                                                   "base_model": "tiny", "lora_config": {"rank": rank, "seed": seed}})
        assert accepted.status_code == 200, accepted.text[:500]
        self.result(accepted.json()["request_id"])
        return accepted.json()["model_id"]

    def new_session(self) -> str:
        response = self.post("create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"})
        assert response.status_code == 200, response.text[:500]
        return response.json()["session_id"]

    def close(self) -> None:
        self.http.close()
