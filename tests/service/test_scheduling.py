"""Cross-tenant batches, seq_id order, retries, isolation and restarts, through the real server."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest
import sqlalchemy as sa
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from contract.queue import QueuedRequest
from db.models import Request, RequestState, TrainingModel
from service.embedded import ServerThread, free_port
from tests.servers import metric
from tests.waiting import wait_until

pytestmark = pytest.mark.slow  # two servers (SQLite; Postgres with the engine in a child process), restarts
PROTOBUF = {"Content-Type": "application/x-protobuf"}


def sft_data(seed: int, n_datums: int = 3, length: int = 10) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_datums):
        seq = rng.integers(0, 512, length + 1)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                               loss_fn_inputs={"target_tokens": seq[1:], "weights": np.ones(length, np.float32)}))
    return out


def proto_body(model_id: str, seq_id: int, data: list[types.Datum], loss_fn: str = "cross_entropy") -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn), model_id=model_id, seq_id=seq_id
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def wait_result(http: httpx.Client, request_id: str, timeout: float = 120) -> httpx.Response:

    def finished() -> list[httpx.Response]:  # in a list: a Response has no truth value of its own
        r = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        return [r] if r.headers["content-type"].startswith("application/x-protobuf") or "try_again" not in r.text else []

    return wait_until(finished, f"request {request_id} to finish", timeout=timeout)[0]


def http_client(server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers={"X-API-Key": key}, timeout=60)


def cycles_with_more_tenants_than(server, n: int) -> float:
    """From GET /metrics: how many cycles so far batched more than n tenants' forward_backward."""
    return (metric(server.base_url, "loraplex_cycle_tenants_count")
            - metric(server.base_url, "loraplex_cycle_tenants_bucket", le=f"{float(n)}"))


def test_tenants_share_one_batch_and_get_what_they_get_alone(server):
    batched_before = cycles_with_more_tenants_than(server, 2)
    clients = [tinker.ServiceClient(base_url=server.base_url, api_key=server.new_tenant()) for _ in range(4)]
    trainers = [c.create_lora_training_client(base_model="tiny", rank=4 + i, seed=i).result() for i, c in enumerate(clients)]
    outputs = [None] * 4

    def train(i):
        outputs[i] = trainers[i].forward_backward(sft_data(i), "cross_entropy").result()

    threads = [threading.Thread(target=train, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    with server.embedded.sessions() as s:
        ids = {s.scalar(sa.select(Request.id).where(Request.model_id == t.model_id, Request.seq_id == 1)) for t in trainers}
    shared = max(len(ids & set(cycle)) for cycle in server.embedded.scheduler.cycle_log.cycles)
    assert shared == 4, "the four tenants' forward_backward requests ran in one engine call"
    assert cycles_with_more_tenants_than(server, 2) > batched_before, "GET /metrics shows it too"

    for i, client in enumerate(clients):  # the same model alone gives the same numbers
        alone = client.create_lora_training_client(base_model="tiny", rank=4 + i, seed=i).result()
        expected = alone.forward_backward(sft_data(i), "cross_entropy").result()
        assert outputs[i].metrics["loss:sum"] == pytest.approx(expected.metrics["loss:sum"], rel=1e-5)
        for got, want in zip(outputs[i].loss_fn_outputs, expected.loss_fn_outputs):
            np.testing.assert_allclose(got["logprobs"].to_numpy(), want["logprobs"].to_numpy(), rtol=1e-5)


def test_chunked_forward_backward_of_more_than_1024_datums(server):
    client = tinker.ServiceClient(base_url=server.base_url, api_key=server.new_tenant())
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    data = sft_data(7, n_datums=1100, length=3)
    forward = tc.forward(data, "cross_entropy").result()  # chunks sent concurrently, the first one last
    backward = tc.forward_backward(data, "cross_entropy").result()
    assert len(backward.loss_fn_outputs) == 1100
    assert backward.metrics["loss:sum"] == pytest.approx(forward.metrics["loss:sum"], rel=1e-5)


def test_out_of_order_seq_ids_run_in_order_and_retries_dedupe(server):
    client = tinker.ServiceClient(base_url=server.base_url, api_key=(key := server.new_tenant()))
    model_id = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result().model_id
    with http_client(server, key) as http:
        second = http.post("/api/v1/forward_backward", content=proto_body(model_id, 2, sft_data(2)), headers=PROTOBUF)
        time.sleep(0.5)  # seq 2 must wait for seq 1, however long
        assert http.post("/api/v1/retrieve_future", json={"request_id": second.json()["request_id"]}).json()["type"] == "try_again"
        first = http.post("/api/v1/forward_backward", content=proto_body(model_id, 1, sft_data(1)), headers=PROTOBUF)
        retry = http.post("/api/v1/forward_backward", content=proto_body(model_id, 1, sft_data(1)), headers=PROTOBUF)
        assert retry.json()["request_id"] == first.json()["request_id"]
        for r in (first, second):
            assert wait_result(http, r.json()["request_id"]).status_code == 200
    with server.embedded.sessions() as s:
        rows = {r.seq_id: r for r in s.scalars(sa.select(Request).where(Request.model_id == model_id, Request.seq_id > 0))}
    assert len(rows) == 2 and rows[1].started_at <= rows[2].started_at


def test_seq_ids_that_never_arrive_are_skipped_together_and_fail_the_request_behind_them(server):
    """The gap rule (scheduler/service.py): seq_ids 1-2 never come (lost on the network, say). After the
    gap timeout both are recorded at once; seq 3, which waited behind them, fails without running
    (it may depend on them); seq 4 runs. A late seq 2 finds its failed record and never runs."""
    client = tinker.ServiceClient(base_url=server.base_url, api_key=(key := server.new_tenant()))
    model_id = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result().model_id
    scheduler = server.embedded.scheduler
    gap_seconds, scheduler.seq_gap_seconds = scheduler.seq_gap_seconds, 1.5
    try:
        with http_client(server, key) as http:
            started = time.monotonic()
            fourth = http.post("/api/v1/forward_backward", content=proto_body(model_id, 4, sft_data(4)), headers=PROTOBUF)
            third = http.post("/api/v1/forward_backward", content=proto_body(model_id, 3, sft_data(3)), headers=PROTOBUF)
            assert wait_result(http, fourth.json()["request_id"], timeout=30).status_code == 200
            assert 1.5 <= time.monotonic() - started < 1.5 + 10  # one timeout for both missing seq_ids
            error = wait_result(http, third.json()["request_id"]).json()
            assert error["category"] == "user" and "seq_id 1-2 of this model never arrived" in error["error"]
            late = http.post("/api/v1/forward_backward", content=proto_body(model_id, 2, sft_data(2)), headers=PROTOBUF)
            error = wait_result(http, late.json()["request_id"]).json()
            assert error["category"] == "user" and "seq_id 2: never arrived" in error["error"]
    finally:
        scheduler.seq_gap_seconds = gap_seconds
    with server.embedded.sessions() as s:
        states = dict(s.execute(sa.select(Request.seq_id, Request.state).where(Request.model_id == model_id)).all())
    assert states == {0: RequestState.DONE, 1: RequestState.FAILED, 2: RequestState.FAILED, 3: RequestState.FAILED,
                      4: RequestState.DONE}


def test_a_request_failing_inside_a_shared_batch_fails_alone(server):
    """Bypass the API's validation to put a bad request into the same cycle as a good one."""
    client = tinker.ServiceClient(base_url=server.base_url, api_key=server.new_tenant())
    good_model = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result().model_id
    bad_model = client.create_lora_training_client(base_model="tiny", rank=4, seed=1).result().model_id
    bad_data = sft_data(3)
    bad_data[1] = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 9999]),
                              loss_fn_inputs={"target_tokens": np.array([2, 3, 4]), "weights": np.ones(3, np.float32)})
    with server.embedded.sessions() as s:
        tenant_id = s.scalar(sa.select(Request.tenant_id).where(Request.model_id == good_model))
        rows = [Request(tenant_id=tenant_id, model_id=m, seq_id=1, kind="forward_backward", payload=proto_body(m, 1, d),
                        payload_content_type="application/x-protobuf", num_tokens=30)
                for m, d in ((good_model, sft_data(4)), (bad_model, bad_data))]
        s.add_all(rows)
        s.commit()
        for row in rows:
            server.embedded.scheduler.submit(QueuedRequest(row.id, tenant_id, row.model_id, 1, row.kind, 30))
        ids = [row.id for row in rows]

    def both_finished() -> tuple[Request, Request] | None:
        with server.embedded.sessions() as s:
            good, bad = (s.get(Request, i) for i in ids)
            done = all(r.state != RequestState.PENDING and r.finished_at for r in (good, bad))
            return (good, bad) if done else None

    good, bad = wait_until(both_finished, "both requests to finish", timeout=60)
    assert any(set(ids) <= set(cycle) for cycle in server.embedded.scheduler.cycle_log.cycles)
    assert good.state == RequestState.DONE
    assert bad.state == RequestState.FAILED and bad.error["category"] == "user"
    assert "data[1].model_input" in bad.error["error"]


def test_another_tenants_models_answer_404(server):
    owner = tinker.ServiceClient(base_url=server.base_url, api_key=server.new_tenant())
    tc = owner.create_lora_training_client(base_model="tiny", rank=4).result()
    pending = tc.forward_backward(sft_data(0), "cross_entropy")
    tc.save_state("mine").result()
    with http_client(server, server.new_tenant()) as intruder:
        assert intruder.post("/api/v1/get_info", json={"model_id": tc.model_id}).status_code == 404
        assert intruder.get(f"/api/v1/training_runs/{tc.model_id}").status_code == 404
        assert intruder.get(f"/api/v1/training_runs/{tc.model_id}/checkpoints").status_code == 404
        body = proto_body(tc.model_id, 99, sft_data(1))
        assert intruder.post("/api/v1/forward_backward", content=body, headers=PROTOBUF).status_code == 404
        path = f"tinker://{tc.model_id}/weights/mine"
        assert intruder.post("/api/v1/weights_info", json={"tinker_path": path}).status_code == 404
        assert intruder.get("/api/v1/checkpoints").json()["checkpoints"] == []
    pending.result()


def test_restart_with_pending_work_completes_it(server, tmp_path):
    settings = server.settings.model_copy(update={"data_dir": tmp_path, "port": free_port(), "database_url": ""})
    first = ServerThread(settings)
    key = first.new_tenant()
    client = tinker.ServiceClient(base_url=first.base_url, api_key=key)
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    tc.forward_backward(sft_data(0), "cross_entropy").result()  # its gradient lives only in memory
    first.embedded.scheduler.stop()  # from here on requests are accepted but not run
    with http_client(first, key) as http:
        opt = http.post("/api/v1/optim_step", json={"model_id": tc.model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.01}})
        fwd = http.post("/api/v1/forward_backward", content=proto_body(tc.model_id, 3, sft_data(9)), headers=PROTOBUF)
    first.stop()

    second = ServerThread(settings.model_copy(update={"port": free_port()}))
    try:
        with http_client(second, key) as http:
            assert "metrics" in wait_result(http, opt.json()["request_id"]).json()
            assert wait_result(http, fwd.json()["request_id"]).status_code == 200
        assert_same_as_uninterrupted(second, key, tc.model_id, 4, seeds=[0])
    finally:
        second.stop()


def assert_same_as_uninterrupted(server, key: str, model_id: str, save_seq_id: int, seeds: list[int]) -> None:
    """The model, saved at `save_seq_id`, equals a fresh one (rank 4, seed 5) trained without a restart:
    forward_backward(sft_data(seed)) + optim_step(lr 0.01) per seed."""
    with http_client(server, key) as http:
        save = http.post("/api/v1/save_weights", json={"model_id": model_id, "seq_id": save_seq_id, "path": "after"})
        saved_path = wait_result(http, save.json()["request_id"]).json()["path"]
    client = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    restarted = client.create_training_client_from_state(saved_path).result()
    reference = client.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    for seed in seeds:
        reference.forward_backward(sft_data(seed), "cross_entropy").result()
        reference.optim_step(types.AdamParams(learning_rate=0.01)).result()
    want = reference.forward(sft_data(9), "cross_entropy").result().metrics["loss:sum"]
    got = restarted.forward(sft_data(9), "cross_entropy").result().metrics["loss:sum"]
    assert got == pytest.approx(want, rel=1e-5)


def test_acknowledged_optim_steps_whose_state_was_not_written_are_replayed(server, tmp_path):
    """The durable state is written in the background after an optim_step; a process that dies
    before writing it loses nothing acknowledged: the restart replays those steps."""
    settings = server.settings.model_copy(update={"data_dir": tmp_path, "port": free_port(), "database_url": "",
                                                  "engine_process": False})  # its writer in reach
    first = ServerThread(settings)
    key = first.new_tenant()
    client = tinker.ServiceClient(base_url=first.base_url, api_key=key)
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    first.embedded.executor.live.writer.submit = lambda *args, **kwargs: None  # dies before any later write
    for seed in (0, 1):
        tc.forward_backward(sft_data(seed), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.01)).result()
    tc.forward_backward(sft_data(2), "cross_entropy").result()  # a gradient pending at the "crash"
    assert first.embedded.executor.durable_seq(tc.model_id) == 0  # only create_model's (seq_id 0) was written
    first.stop()

    second = ServerThread(settings.model_copy(update={"port": free_port()}))
    try:
        with http_client(second, key) as http:  # one more step: it needs the replayed pending gradient too
            opt = http.post("/api/v1/optim_step", json={"model_id": tc.model_id, "seq_id": 6,
                                                         "adam_params": {"learning_rate": 0.01}})
            assert "metrics" in wait_result(http, opt.json()["request_id"]).json()
        assert_same_as_uninterrupted(second, key, tc.model_id, 7, seeds=[0, 1, 2])
    finally:
        second.stop()


def test_a_state_written_before_its_step_was_stored_does_not_apply_the_step_twice(server, tmp_path):
    """The crash window between the state writer publishing a step's state and the scheduler storing
    that step's outcome: after a restart the step runs again, so it must run on the state before it."""
    settings = server.settings.model_copy(update={"data_dir": tmp_path, "port": free_port(), "database_url": "",
                                                  "engine_process": False, "state_write_interval_seconds": 0.0})
    first = ServerThread(settings)
    key = first.new_tenant()
    client = tinker.ServiceClient(base_url=first.base_url, api_key=key)
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    for seed in (0, 1):  # seq_ids 1-4; the state after seq_id 4 is written (interval 0)
        tc.forward_backward(sft_data(seed), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.01)).result()
    first.stop()
    with first.embedded.sessions() as s:  # as if the server died after the write, before the commit
        s.execute(sa.update(Request).where(Request.model_id == tc.model_id, Request.seq_id == 4)
                  .values(state=RequestState.PENDING, result=None, finished_at=None))
        s.execute(sa.update(TrainingModel).where(TrainingModel.id == tc.model_id).values(last_applied_seq_id=3))
        s.commit()
    assert first.embedded.executor.durable_seq(tc.model_id) == 4  # the stored state is ahead of the database

    second = ServerThread(settings.model_copy(update={"port": free_port()}))
    try:
        with http_client(second, key) as http:  # seq_id 4 ran again at the restart: once, on the right state
            pending = http.post("/api/v1/optim_step", json={"model_id": tc.model_id, "seq_id": 4,
                                                             "adam_params": {"learning_rate": 0.01}})
            assert "metrics" in wait_result(http, pending.json()["request_id"]).json()
        assert_same_as_uninterrupted(second, key, tc.model_id, 5, seeds=[0, 1])
    finally:
        second.stop()


def test_oversized_and_malformed_bodies_are_refused_with_the_field(server):
    with http_client(server, server.new_tenant()) as http:
        huge = b"\0" * (server.settings.max_request_bytes + 1)
        r = http.post("/api/v1/forward_backward", content=huge, headers=PROTOBUF)
        assert r.status_code == 413 and "body" in r.json()["detail"]
        r = http.post("/api/v1/forward_backward", content=b"\x08\x96\x01garbage", headers=PROTOBUF)
        assert r.status_code == 400 and r.json()["detail"].startswith("body")
        r = http.post("/api/v1/optim_step", json={"model_id": "nope", "seq_id": 0})
        assert r.status_code == 422 and "seq_id" in r.text
