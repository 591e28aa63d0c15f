"""What every refused request must satisfy, and the bystander whose service must not suffer."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import httpx

from tests.reliability.client import Api

SHORT = 1024  # an error answer is a sentence naming the field: under 1 KB, never the input echoed back
REPO = str(Path(__file__).resolve().parents[2])


def refusal_problems(response: httpx.Response, fields: tuple[str, ...], server_paths: tuple[str, ...]) -> list[str]:
    """Why `response` is not a proper refusal (empty when it is): a 4xx that names one of
    `fields`, short, and with no server path or traceback in it."""
    problems = []
    if not 400 <= response.status_code < 500:
        problems.append(f"status {response.status_code}, expected a 4xx")
    if fields and not any(field in response.text for field in fields):
        problems.append(f"the error names none of {fields}")
    if len(response.content) >= SHORT:
        problems.append(f"a {len(response.content)}-byte error body")
    for path in (*server_paths, REPO, "Traceback"):
        if path in response.text:
            problems.append(f"the error shows {path!r}")
    return problems


def assert_refused(response: httpx.Response, fields: tuple[str, ...], server_paths: tuple[str, ...]) -> None:
    problems = refusal_problems(response, fields, server_paths)
    assert not problems, f"{'; '.join(problems)}: {response.status_code} {response.text[:300]!r}"


class Bystander:
    """Another tenant with a model of its own: after each attack, its get_info answers within
    `info_seconds` and its forward within `forward_seconds`."""

    def __init__(self, base_url: str, key: str, info_seconds: float = 2.0, forward_seconds: float = 5.0) -> None:
        self.api = Api(base_url, key)
        self.model_id = self.api.create_model(self.api.new_session())
        self.seq = itertools.count(1)
        self.info_seconds, self.forward_seconds = info_seconds, forward_seconds

    def check_info(self) -> None:
        start = time.monotonic()
        response = self.api.post("get_info", json={"model_id": self.model_id})
        elapsed = time.monotonic() - start
        assert response.status_code == 200, response.text[:300]
        assert elapsed < self.info_seconds, f"the bystander's get_info took {elapsed:.1f} s"

    def check_forward(self) -> None:
        start = time.monotonic()
        self.api.result(self.api.forward_backward(self.model_id, next(self.seq), forward_only=True), self.forward_seconds)
        elapsed = time.monotonic() - start
        assert elapsed < self.forward_seconds, f"the bystander's forward took {elapsed:.1f} s"

    def check(self) -> None:
        self.check_info()
        self.check_forward()
