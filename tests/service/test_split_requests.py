"""Large requests run in parts through the real embedded server: the bits of the whole request, other
tenants' requests between the parts, and a restart halfway through one."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import sqlalchemy as sa
import tinker
import torch
from loraplex.types import AdamParams
from loraplex.wire.client import decode_forward_backward_output
from tinker import types

from contract.configs import LoraConfig
from contract.inputs import EngineDatum, ForwardBackwardInput
from db.models import Request, RequestState, TrainingModel
from service.embedded import ServerThread, free_port
from service.settings import Settings
from tests.service.test_scheduling import PROTOBUF, http_client, proto_body, wait_result
from workers.trainer.engine import TrainerEngine

pytestmark = pytest.mark.slow  # servers restarted halfway through requests in parts
LR = 1e-2


def settings(data_dir, **more) -> Settings:
    return Settings(data_dir=data_dir, port=free_port(), base_model="tiny", cycle_token_budget=1024,
                    sampler_enabled=False, long_poll_seconds=5, max_lora_rank=16, **more)


@contextmanager
def server_at(data_dir, **more):
    server = ServerThread(settings(data_dir, **more))
    try:
        yield server
    finally:
        server.stop()


def rows(seed: int, groups: int = 6, group_size: int = 8) -> list[np.ndarray]:
    """RL-like groups: completions of one prompt each (they share rows in the engine), ~2,500 tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(groups):
        prompt = rng.integers(0, 512, 24)
        out += [np.concatenate([prompt, rng.integers(0, 512, rng.integers(10, 50))]) for _ in range(group_size)]
    return out


def sdk_data(token_rows) -> list[types.Datum]:
    return [types.Datum(model_input=types.ModelInput.from_ints(r[:-1].tolist()),
                        loss_fn_inputs={"target_tokens": r[1:], "weights": weights(r)})
            for r in token_rows]


def engine_data(token_rows) -> list[EngineDatum]:
    return [EngineDatum(r[:-1], {"target_tokens": r[1:], "weights": weights(r)}) for r in token_rows]


def weights(row: np.ndarray) -> np.ndarray:
    return np.linspace(0, 1, len(row) - 1, dtype=np.float32)


def reference(model_path, server: ServerThread, model_id: str) -> TrainerEngine:
    """An engine with the model's adapter as created: the history replayed here, each request whole and alone."""
    with server.embedded.sessions() as s:
        config = s.scalar(sa.select(TrainingModel.lora_config).where(TrainingModel.id == model_id))
    engine = TrainerEngine(model_path, max_rank=16)
    engine.create_adapter(model_id, LoraConfig(**config))
    return engine


def request_id(server: ServerThread, model_id: str, seq_id: int) -> str:
    with server.embedded.sessions() as s:
        return s.scalar(sa.select(Request.id).where(Request.model_id == model_id, Request.seq_id == seq_id))


def cycles_of(server: ServerThread, rid: str) -> list[int]:
    return [i for i, cycle in enumerate(server.embedded.scheduler.cycle_log.cycles) if rid in cycle]


def assert_same_adapter(server: ServerThread, engine: TrainerEngine, model_id: str) -> None:
    served, expected = server.embedded.executor.engine.adapter(model_id), engine.adapter(model_id)
    assert torch.equal(served.flat_weights, expected.flat_weights)
    for name, moment in expected.optimizer_state.items():
        assert torch.equal(served.optimizer_state[name], moment), name


def queue_a_request_in_parts(server: ServerThread, warm, more, big) -> tuple[str, str, str, str]:
    """A model trained a step on `warm`, with `more`'s gradient only in memory (seq 3); then `big`
    (seq 4) and an optim_step (seq 5) queued with the scheduler stopped, which runs two cycles here:
    two parts of `big` ran, more remain. Returns the tenant's key, the model and the two requests."""
    key = server.new_tenant()
    tc = tinker.ServiceClient(base_url=server.base_url, api_key=key) \
        .create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    tc.forward_backward(sdk_data(warm), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=LR)).result()
    tc.forward_backward(sdk_data(more), "cross_entropy").result()
    server.embedded.scheduler.stop()
    with http_client(server, key) as http:
        big_id = http.post("/api/v1/forward_backward", content=proto_body(tc.model_id, 4, sdk_data(big)),
                           headers=PROTOBUF).json()["request_id"]
        step_id = http.post("/api/v1/optim_step", json={"model_id": tc.model_id, "seq_id": 5,
                                                        "adam_params": {"learning_rate": LR}}).json()["request_id"]
    for _ in range(2):
        assert server.embedded.scheduler.step()
    assert len(cycles_of(server, big_id)) == 2
    return key, tc.model_id, big_id, step_id


def assert_same_output(body: bytes, expected) -> None:
    """A forward_backward answer (protobuf) has the bits of the engine's output `expected`."""
    outputs, metrics, _ = decode_forward_backward_output(body)
    assert metrics == expected.metrics
    for got, want in zip(outputs, expected.loss_fn_outputs, strict=True):
        assert np.array_equal(got["logprobs"], want["logprobs"].numpy())


def test_a_large_request_runs_in_parts_with_the_bits_of_the_whole(tmp_path, tiny_model_path):
    warm, big = rows(0, groups=1, group_size=2), rows(1)
    with server_at(tmp_path) as server:
        tc = tinker.ServiceClient(base_url=server.base_url, api_key=server.new_tenant()) \
            .create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
        tc.forward_backward(sdk_data(warm), "cross_entropy").result()  # B leaves zero: the parts see a real adapter
        tc.optim_step(types.AdamParams(learning_rate=LR)).result()
        forward = tc.forward(sdk_data(big), "cross_entropy").result()  # seq 3
        backward = tc.forward_backward(sdk_data(big), "cross_entropy").result()  # seq 4
        tc.optim_step(types.AdamParams(learning_rate=LR)).result()
        assert len(cycles_of(server, request_id(server, tc.model_id, 4))) >= 3

        engine = reference(tiny_model_path, server, tc.model_id)
        engine.forward_backward([ForwardBackwardInput(tc.model_id, engine_data(warm))])
        engine.optim_step([(tc.model_id, AdamParams(learning_rate=LR))])
        expected_forward = engine.forward([ForwardBackwardInput(tc.model_id, engine_data(big))])[0]
        expected = engine.forward_backward([ForwardBackwardInput(tc.model_id, engine_data(big))])[0]
        engine.optim_step([(tc.model_id, AdamParams(learning_rate=LR))])
        for got, want in ((forward, expected_forward), (backward, expected)):
            assert got.metrics == want.metrics
            assert len(got.loss_fn_outputs) == len(big)
            for g, w in zip(got.loss_fn_outputs, want.loss_fn_outputs):
                assert np.array_equal(g["logprobs"].to_numpy(), w["logprobs"].numpy())
        assert_same_adapter(server, engine, tc.model_id)


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-in-process", "engine-in-child"])
def test_another_tenants_small_request_runs_between_the_parts_of_a_large_one(tmp_path, engine_process):
    with server_at(tmp_path, engine_process=engine_process) as server:
        keys = [server.new_tenant() for _ in range(2)]
        big_tc, small_tc = [tinker.ServiceClient(base_url=server.base_url, api_key=key)
                            .create_lora_training_client(base_model="tiny", rank=4, seed=i).result()
                            for i, key in enumerate(keys)]
        scheduler = server.embedded.scheduler
        scheduler.stop()  # from here on, the test runs the scheduler's cycles itself, one at a time
        with http_client(server, keys[0]) as big_http, http_client(server, keys[1]) as small_http:
            big = big_http.post("/api/v1/forward_backward", content=proto_body(big_tc.model_id, 1, sdk_data(rows(2))),
                                headers=PROTOBUF).json()["request_id"]
            assert scheduler.step()  # its first part
            small = small_http.post("/api/v1/forward_backward",
                                    content=proto_body(small_tc.model_id, 1, sdk_data(rows(3, 1, 1))),
                                    headers=PROTOBUF).json()["request_id"]
            while scheduler.step():
                pass
            assert wait_result(big_http, big).status_code == 200 and wait_result(small_http, small).status_code == 200
        big_cycles, small_cycles = cycles_of(server, big), cycles_of(server, small)
        assert small_cycles == [1] and big_cycles[0] == 0 and big_cycles[-1] > 1
        with server.embedded.sessions() as s:
            finished = dict(s.execute(sa.select(Request.id, Request.finished_at)
                                      .where(Request.id.in_([big, small]))).all())
        assert finished[small] < finished[big]


def test_a_restart_halfway_through_a_request_in_parts_applies_every_part_once(tmp_path, tiny_model_path):
    """Embedded mode: the engine restarts with the server, so the parts that ran are gone with their
    gradients; the request runs again from its first datum, after the replay of what came before."""
    warm, more, big = rows(4, groups=1, group_size=2), rows(5, groups=1, group_size=3), rows(6)
    first = ServerThread(settings(tmp_path))
    try:
        key, model_id, big_id, step_id = queue_a_request_in_parts(first, warm, more, big)
    finally:
        first.stop()
    with first.embedded.sessions() as s:
        assert s.scalar(sa.select(Request.state).where(Request.id == big_id)) == RequestState.PENDING

    second = ServerThread(settings(tmp_path))
    try:
        with http_client(second, key) as http:
            result = wait_result(http, big_id)
            assert "metrics" in wait_result(http, step_id).json()
        engine = reference(tiny_model_path, second, model_id)
        for data in (warm, more, big):
            expected = engine.forward_backward([ForwardBackwardInput(model_id, engine_data(data))])[0]
            if data is not more:
                engine.optim_step([(model_id, AdamParams(learning_rate=LR))])
        assert_same_adapter(second, engine, model_id)  # each part's gradient applied exactly once
        assert_same_output(result.content, expected)
        assert len(cycles_of(second, big_id)) >= 3  # in parts again, from the first
    finally:
        second.stop()


def test_parts_that_died_with_the_engine_process_run_again_from_the_first_datum(tmp_path, tiny_model_path):
    """The engine's child process dies between two parts. The cycle's first engine call finds it dead
    (another tenant's request fails, as any request of a cycle that finds its engine dead); the large
    request's model is then placed on the new child, and the request runs there from its first datum:
    every part's gradient once, none lost with the dead child."""
    big, probe = rows(11), rows(12, 1, 2)
    with server_at(tmp_path, engine_process=True) as server:
        keys = [server.new_tenant() for _ in range(2)]
        big_tc, small_tc = [tinker.ServiceClient(base_url=server.base_url, api_key=key)
                            .create_lora_training_client(base_model="tiny", rank=4, seed=3 + i).result()
                            for i, key in enumerate(keys)]
        scheduler, executor = server.embedded.scheduler, server.embedded.executor
        scheduler.stop()  # the test runs the cycles itself
        with http_client(server, keys[0]) as big_http, http_client(server, keys[1]) as small_http:
            big_id = big_http.post("/api/v1/forward_backward", content=proto_body(big_tc.model_id, 1, sdk_data(big)),
                                   headers=PROTOBUF).json()["request_id"]
            assert scheduler.step()  # its first part, in the child
            executor._proc.kill()
            executor._proc.join()
            small_id = small_http.post("/api/v1/forward_backward",
                                       content=proto_body(small_tc.model_id, 1, sdk_data(rows(13, 1, 1))),
                                       headers=PROTOBUF).json()["request_id"]
            step = {"model_id": big_tc.model_id, "seq_id": 2, "adam_params": {"learning_rate": LR}}
            step_id = big_http.post("/api/v1/optim_step", json=step).json()["request_id"]
            probe_id = big_http.post("/api/v1/forward_backward",
                                     content=proto_body(big_tc.model_id, 3, sdk_data(probe)),
                                     headers=PROTOBUF).json()["request_id"]
            while scheduler.step():
                pass
            assert "engine process died" in wait_result(small_http, small_id).text
            result = wait_result(big_http, big_id)
            assert "metrics" in wait_result(big_http, step_id).json()
            probed = wait_result(big_http, probe_id).content
        assert len(cycles_of(server, big_id)) >= 3  # one part before the death, then all of them again
        engine = reference(tiny_model_path, server, big_tc.model_id)
    expected = engine.forward_backward([ForwardBackwardInput(big_tc.model_id, engine_data(big))])[0]
    engine.optim_step([(big_tc.model_id, AdamParams(learning_rate=LR))])
    expected_probe = engine.forward_backward([ForwardBackwardInput(big_tc.model_id, engine_data(probe))])[0]
    assert_same_output(result.content, expected)
    assert_same_output(probed, expected_probe)
