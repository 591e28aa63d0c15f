"""A request that waits tells its caller so: retrieve_future's try_again carries the request's queue
position, and the SDK's future shows it, as plain lines on stderr when stderr is no terminal."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

import loraplex
from loraplex import futures, types
from tests.servers import running_server
from tests.waiting import wait_until

pytestmark = pytest.mark.slow  # a server whose scheduler stops, and waits of a few seconds
TOKENS = list(range(10, 30))


def datum() -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(TOKENS[1:]), "weights": np.ones(len(TOKENS) - 1)})


def test_a_waiting_request_reports_its_queue_position(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(futures, "PROGRESS_AFTER_SECONDS", 0.5)
    monkeypatch.setattr(futures, "LINE_AFTER_SECONDS", 1.0)
    with running_server(tmp_path, sampler_enabled=False, long_poll_seconds=0.5) as server:
        second_key = server.new_tenant()
        first = loraplex.ServiceClient(base_url=server.base_url, api_key=server.new_tenant(), retry_seconds=1)
        second = loraplex.ServiceClient(base_url=server.base_url, api_key=second_key, retry_seconds=1)
        ahead, behind = (client.create_lora_training_client("tiny", rank=4) for client in (first, second))
        server.embedded.scheduler.stop()  # from here on requests are accepted, not run
        queued = [ahead.forward_backward([datum()]) for _ in range(3)]
        wait_until(lambda: all(f.waiting.request_id for f in queued), "the first three to be accepted")
        waiting = behind.forward_backward([datum()])
        with pytest.raises(TimeoutError):
            waiting.result(timeout=4)
        assert waiting.waiting.queue_position == 3  # a count of others' requests, never whose

        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("loraplex: still waiting")]
        assert lines and "queue position 3" in lines[0] and waiting.waiting.request_id in lines[0]

        answer = httpx.post(f"{server.base_url}/api/v1/retrieve_future", headers={"X-API-Key": second_key},
                            json={"request_id": waiting.waiting.request_id}, timeout=30).json()
        assert answer["type"] == "try_again" and answer["queue_position"] == 3
        first.close(), second.close()
