"""A restart serves at once, whatever work it must replay: the replay runs on the scheduler's thread, one
request per cycle, and only the model being replayed waits for it; other tenants train meanwhile."""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa
import tinker
from tinker import types

from db.models import Request, RequestState
from scheduler.service import SchedulerService
from service.embedded import ServerThread, free_port
from service.settings import Settings
from tests.service.test_scheduling import PROTOBUF, http_client, proto_body, sft_data, wait_result
from tests.waiting import wait_until

pytestmark = pytest.mark.slow  # two servers, one restarted
BACKLOG = 4  # forward_backwards of model A that no optim_step followed and no stored state holds
LR = 0.01


def state(server: ServerThread, request_id: str) -> RequestState:
    with server.embedded.sessions() as s:
        return s.scalar(sa.select(Request.state).where(Request.id == request_id))


def test_a_restart_serves_at_once_and_replays_a_backlog_behind_its_model_only(tmp_path, monkeypatch):
    settings = Settings(data_dir=tmp_path, port=free_port(), base_model="tiny", long_poll_seconds=5,
                        sampler_enabled=False, engine_process=False, cycle_gather_seconds=0)
    first = ServerThread(settings)
    key_a, key_b = first.new_tenant(), first.new_tenant()
    a = tinker.ServiceClient(base_url=first.base_url, api_key=key_a).create_lora_training_client(
        base_model="tiny", rank=4, seed=5).result()
    b = tinker.ServiceClient(base_url=first.base_url, api_key=key_b).create_lora_training_client(
        base_model="tiny", rank=4, seed=6).result()
    first.embedded.executor.live.writer.submit = lambda *args, **kwargs: None  # it dies before writing again
    for seed in range(BACKLOG):  # seq_ids 1..BACKLOG: gradients only the engine holds
        a.forward_backward(sft_data(seed), "cross_entropy").result()
    first.stop()

    # Each replayed request, after the first, waits until tenant B's request is in: B is sent while A is
    # still replaying, however fast the replay. Each notes whether B's and A's new requests had finished.
    sent, seen = threading.Event(), []
    replay = SchedulerService._replay

    def gated(scheduler, s, request_id):
        if seen:
            sent.wait(timeout=120)
        seen.append((state(second, b_id) if sent.is_set() else None,
                     state(second, a_id) if sent.is_set() else None))
        return replay(scheduler, s, request_id)

    monkeypatch.setattr(SchedulerService, "_replay", gated)
    second = ServerThread(settings.model_copy(update={"port": free_port()}))  # it answers with A's replay waiting
    try:
        wait_until(lambda: a.model_id in second.embedded.scheduler.replaying, "A's replay to be planned")
        assert len(seen) <= 1  # its second replayed request waits for B's
        with http_client(second, key_b) as http_b, http_client(second, key_a) as http_a:
            b_id = http_b.post("/api/v1/forward_backward", content=proto_body(b.model_id, 1, sft_data(7)),
                               headers=PROTOBUF).json()["request_id"]
            a_id = http_a.post("/api/v1/optim_step", json={"model_id": a.model_id, "seq_id": BACKLOG + 1,
                                                           "adam_params": {"learning_rate": LR}}).json()["request_id"]
            sent.set()
            assert wait_result(http_b, b_id).status_code == 200
            assert "metrics" in wait_result(http_a, a_id).json()  # on the replayed gradients
        assert len(seen) == BACKLOG  # every lost request replayed once
        # B finished while A was still replaying, and A's new request never ran before its replay ended
        assert (RequestState.DONE, RequestState.PENDING) in seen[2:]
        assert all(a_state in (None, RequestState.PENDING) for _, a_state in seen)
        assert not second.embedded.scheduler.replaying

        # A's numbers are those of a run never interrupted: the same forward_backwards, then the step
        client = tinker.ServiceClient(base_url=second.base_url, api_key=key_a)
        with http_client(second, key_a) as http:
            save = http.post("/api/v1/save_weights", json={"model_id": a.model_id, "seq_id": BACKLOG + 2,
                                                           "path": "after"})
            restarted = client.create_training_client_from_state(
                wait_result(http, save.json()["request_id"]).json()["path"]).result()
        reference = client.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
        for seed in range(BACKLOG):
            reference.forward_backward(sft_data(seed), "cross_entropy").result()
        reference.optim_step(types.AdamParams(learning_rate=LR)).result()
        got, want = (t.forward(sft_data(9), "cross_entropy").result().metrics["loss:sum"] for t in (restarted, reference))
        assert got == want  # bit for bit
    finally:
        second.stop()
