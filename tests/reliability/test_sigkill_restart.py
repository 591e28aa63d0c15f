"""SIGKILL the embedded server at a random moment of a short training run, restart it on the same
data dir, and let the client go on: every request the client saw acknowledged resolves to its
result, and the final forward equals an uninterrupted run's (to 1e-5), so nothing acknowledged
was lost and nothing was applied twice (a lost or doubled optim_step changes the weights).

The client retries each request with the same seq_id and the same bytes until the server
acknowledges it, as the SDK does: a request whose answer the kill swallowed is deduplicated on
retry, never run twice. Each trial (seeded) kills after a random number of acknowledged requests
plus a random delay, in its own third of the run and with its own state-write interval, so the
kill lands at different points relative to the durable state writes: early with the state written
after every step, midway with it written every 0.2 s, late with none written within the run (the
restart then replays most of the run's steps from the stored requests).
tests/service/test_engine_process_restart.py covers the engine's child process dying alone.
"""

from __future__ import annotations

import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from loraplex.wire.client import decode_forward_backward_output
from service.embedded import free_port
from tests.reliability.client import PROTOBUF, TOKENS, forward_backward_body
from tests.reliability.processes import start_serve, stop, tenant_key
from tests.uninterrupted import logprobs_after_steps
from tests.waiting import wait_until

STEPS, LR, RANK, MODEL_SEED = 8, 1e-2, 4, 5
SEED = 29
REQUESTS = 2 * STEPS + 2  # create, STEPS x (forward_backward, optim_step), forward
# per trial: LORAPLEX_STATE_WRITE_INTERVAL_SECONDS, and the third of the run the kill falls in
TRIALS = ((0.0, range(1, 7)), (0.2, range(7, 13)), (5.0, range(13, REQUESTS)))
PATIENCE = 180.0  # seconds a request may wait for the server to come back


class PatientClient:
    """Resends each call (same bytes) through connection errors until the server answers."""

    def __init__(self, base_url: str, key: str) -> None:
        self.http = httpx.Client(base_url=f"{base_url}/api/v1", headers={"X-API-Key": key}, timeout=30)

    def call(self, route: str, **kw) -> httpx.Response:
        def answer() -> list[httpx.Response]:  # in a list: a Response has no truth value of its own
            try:
                return [self.http.post(route, **kw)]
            except httpx.TransportError:
                return []

        return wait_until(answer, f"{route}: the server to come back", timeout=PATIENCE, interval=0.2)[0]

    def submit(self, route: str, **kw) -> dict:
        response = self.call(route, **kw)
        assert response.status_code == 200, (route, response.status_code, response.text[:300])
        return response.json()

    def result(self, request_id: str) -> bytes:
        """The outcome of an acknowledged request; fails on an error outcome."""
        while True:
            response = self.call("retrieve_future", json={"request_id": request_id})
            assert response.status_code == 200, response.text[:300]
            if response.headers["content-type"].startswith("application/json"):
                body = response.json()
                assert "error" not in body, f"acknowledged request {request_id} failed: {body}"
                if body.get("type") == "try_again":
                    continue
            return response.content


def training_run(client: PatientClient, acked: list[str]) -> list[float]:
    """create, STEPS x (forward_backward, optim_step), forward: its logprobs. Appends every
    acknowledged request id to `acked` as it comes."""
    session = client.submit("create_session", json={"tags": [], "user_metadata": {}})["session_id"]
    created = client.submit("create_model", json={"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                                  "lora_config": {"rank": RANK, "seed": MODEL_SEED}})
    acked.append(created["request_id"])
    client.result(created["request_id"])
    model = created["model_id"]
    for step in range(STEPS):
        acked.append(client.submit("forward_backward", content=forward_backward_body(model, 2 * step + 1),
                                   headers=PROTOBUF)["request_id"])
        acked.append(client.submit("optim_step", json={"model_id": model, "seq_id": 2 * step + 2,
                                                       "adam_params": {"learning_rate": LR}})["request_id"])
        client.result(acked[-1])
    forward = client.submit("forward_backward", content=forward_backward_body(model, 2 * STEPS + 1, forward_only=True),
                            headers=PROTOBUF)["request_id"]
    acked.append(forward)
    return decode_forward_backward_output(client.result(forward))[0][0]["logprobs"].tolist()


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_path) -> list[float]:
    return logprobs_after_steps(tiny_model_path, TOKENS, rank=RANK, seed=MODEL_SEED, steps=STEPS, lr=LR)


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(len(TRIALS)))
def test_a_killed_server_loses_nothing_acknowledged_and_applies_nothing_twice(trial, tmp_path, uninterrupted):
    rng = random.Random(SEED + trial)
    write_interval, kill_range = TRIALS[trial]
    env = {"LORAPLEX_STATE_WRITE_INTERVAL_SECONDS": str(write_interval)}
    port = free_port()
    server = start_serve(tmp_path, port, **env)
    try:
        client = PatientClient(f"http://127.0.0.1:{port}", tenant_key(tmp_path, "trainer"))
        acked: list[str] = []
        kill_after, delay = rng.choice(kill_range), rng.uniform(0.0, 0.05)
        with ThreadPoolExecutor(1) as pool:
            run = pool.submit(training_run, client, acked)
            # polled every millisecond: the kill falls `delay` after that acknowledgement, not later
            wait_until(lambda: len(acked) >= kill_after or run.done(),
                       lambda: f"{kill_after} acknowledged requests (so far {len(acked)})", timeout=PATIENCE, interval=0.001)
            time.sleep(delay)  # a random point between two acknowledgements: it passes time on purpose
            where = f"killed after {len(acked)} of {REQUESTS} acknowledged requests (+{delay * 1000:.0f} ms)"
            server.send_signal(signal.SIGKILL)
            server.wait()
            server = start_serve(tmp_path, port, **env)
            try:
                logprobs = run.result(timeout=PATIENCE)
                for request_id in acked:  # every acknowledged request resolves, after the restart too
                    client.result(request_id)
            except AssertionError as e:
                raise AssertionError(f"{where}: {e}") from None
        assert logprobs == pytest.approx(uninterrupted, rel=1e-5), where
    finally:
        stop(server)
