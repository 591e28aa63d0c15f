"""The official, unmodified `tinker` SDK trains against a real embedded server on loopback."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from contract.loss_specs import LOSS_SPECS
from tests.waiting import wait_until

pytestmark = pytest.mark.slow  # two servers (SQLite; Postgres with the engine in a child process)
VOCAB = 512


def datum(loss_fn: str, n: int, rng: np.random.Generator) -> types.Datum:
    seq = rng.integers(0, VOCAB, n + 1)
    inputs = {"target_tokens": seq[1:].astype(np.int64)}
    if loss_fn == "cross_entropy":
        inputs["weights"] = np.ones(n, dtype=np.float32)
    else:
        inputs["logprobs"] = np.full(n, -6.2, dtype=np.float32)
        inputs["advantages"] = rng.standard_normal(n).astype(np.float32)
        if loss_fn == "gspo":
            inputs["sequence_ratio_mask"] = np.ones(n, dtype=np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1].tolist()), loss_fn_inputs=inputs)


def test_training_flow_of_the_official_sdk(server, service_client, api_key):
    rng = np.random.default_rng(0)
    tc = service_client.create_lora_training_client(base_model="tiny", rank=8, seed=1).result()
    assert tc.get_info().model_data.model_name == "loraplex/tiny"  # the hub id; "tiny" is an alias
    assert tc.get_tokenizer().encode("What is 1 + 2?")  # from the local HF cache the server filled, offline

    data = [datum("cross_entropy", 12, rng) for _ in range(3)]
    before = tc.forward(data, "cross_entropy").result()
    for loss_fn in sorted(LOSS_SPECS):
        if loss_fn == "stable_reinforce":  # trains recorded samples only (tests/service/test_stable_reinforce.py)
            with pytest.raises(tinker.BadRequestError, match=r"data\[0\]\.loss_fn_input_spans: stable_reinforce needs"):
                tc.forward_backward([datum(loss_fn, 9, rng)], loss_fn).result()
            continue
        out = tc.forward_backward([datum(loss_fn, 9, rng) for _ in range(2)], loss_fn).result()
        assert np.isfinite(out.metrics["loss:sum"]) and len(out.loss_fn_outputs) == 2
        assert out.loss_fn_outputs[0]["logprobs"].shape == [9]
    step = tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert step.metrics["grad_norm:mean"] > 0
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2))
    after = tc.forward(data, "cross_entropy").result()
    assert after.metrics["loss:sum"] < before.metrics["loss:sum"]  # it learns

    state_path = tc.save_state("ckpt1").result().path
    assert state_path == f"tinker://{tc.model_id}/weights/ckpt1"
    sampler_path = tc.save_weights_for_sampler("s1").result().path
    assert sampler_path == f"tinker://{tc.model_id}/sampler_weights/s1"

    resumed = service_client.create_training_client_from_state_with_optimizer(state_path).result()
    fresh = service_client.create_training_client_from_state(state_path).result()
    expected = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    for clone in (resumed, fresh):
        assert clone.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)

    rest = tinker.RestClient(base_url=server.base_url, api_key=api_key)
    runs = rest.list_training_runs().result()
    assert tc.model_id in [r.training_run_id for r in runs.training_runs]
    checkpoints = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert {c.tinker_path for c in checkpoints} == {state_path, sampler_path}
    info = rest.get_weights_info_by_tinker_path(state_path).result()
    assert info.base_model == "loraplex/tiny" and info.lora_rank == 8


def test_bad_request_is_a_clear_4xx(service_client):
    tc = service_client.create_lora_training_client(base_model="tiny", rank=4).result()
    bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2, VOCAB + 5]),
                      loss_fn_inputs={"target_tokens": np.array([2, 3, 4]), "weights": np.ones(3, dtype=np.float32)})
    with pytest.raises(tinker.BadRequestError, match=r"data\[0\].model_input"):
        tc.forward_backward([bad], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="learning_rate"):
        tc.optim_step(types.AdamParams(learning_rate=-1.0)).result()
    # the refused requests used their seq_ids: the model's next requests do not wait for them
    good = datum("cross_entropy", 4, np.random.default_rng(1))
    assert tc.forward_backward([good], "cross_entropy").result().metrics["loss:sum"] > 0
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    with pytest.raises(tinker.BadRequestError, match="base_model"):
        service_client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="rank"):
        service_client.create_lora_training_client(base_model="tiny", rank=1000).result()


def test_a_server_without_sampler_says_so(server, service_client, api_key):
    (model,) = tinker.RestClient(base_url=server.base_url, api_key=api_key).get_server_capabilities().result().supported_models
    assert model.trainable and not model.sampleable
    tc = service_client.create_lora_training_client(base_model="tiny", rank=4).result()
    sampler = tc.save_weights_and_get_sampling_client()
    with pytest.raises(tinker.BadRequestError, match="sampler is disabled"):
        sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2)).result()


def test_rest_checkpoint_lifecycle_and_sessions(server, service_client, api_key):
    tc = service_client.create_lora_training_client(base_model="tiny", rank=4).result()
    path = tc.save_state("keep").result().path
    rest = tinker.RestClient(base_url=server.base_url, api_key=api_key)
    rest.publish_checkpoint_from_tinker_path(path).result()
    assert [c.public for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [True]
    rest.unpublish_checkpoint_from_tinker_path(path).result()
    rest.set_checkpoint_ttl_from_tinker_path(path, 7200).result()
    (checkpoint,) = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert not checkpoint.public and checkpoint.expires_at is not None
    assert rest.get_training_run(tc.model_id).result().lora_rank == 4
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints == []
    sessions = rest.list_sessions().result().sessions
    assert sessions and tc.model_id in rest.get_session(sessions[0]).result().training_run_ids


def test_many_waiting_long_polls_do_not_starve_other_requests(server, api_key):
    """Each long-poll holds no database connection while it waits: more of them than the
    connection pool holds (15) still leave the server answering everyone else at once."""
    post = lambda route, **kw: httpx.post(f"{server.base_url}/api/v1/{route}", headers={"X-API-Key": api_key},
                                          timeout=30, **kw)
    session = post("create_session", json={"tags": []}).json()["session_id"]
    model = post("create_model", json={"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                        "lora_config": {"rank": 4}}).json()["model_id"]
    # seq 2 waits for a seq 1 that never comes: its long-polls wait the full long_poll_seconds
    waiting = post("optim_step", json={"model_id": model, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}})
    request_id = waiting.json()["request_id"]
    with ThreadPoolExecutor(24) as pool:
        polls = [pool.submit(post, "retrieve_future", json={"request_id": request_id}) for _ in range(24)]
        waiters = server.embedded.app.state.notifier._waiters  # a long-poll registers there before it waits
        wait_until(lambda: len(waiters.get(request_id, ())) > 15, "more long-polls waiting than the pool holds",
                   timeout=30)
        start = time.monotonic()
        assert post("create_session", json={"tags": []}).status_code == 200
        assert time.monotonic() - start < 3
        assert all(p.result().json()["type"] == "try_again" for p in polls)


def test_checkpoints_keep_their_user_metadata(server, service_client, api_key):
    tc = service_client.create_lora_training_client(base_model="tiny", rank=4).result()
    tc.save_state("tagged", user_metadata={"renderer_name": "role_colon", "step": "7"}).result()
    rest = tinker.RestClient(base_url=server.base_url, api_key=api_key)
    (checkpoint,) = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert checkpoint.user_metadata == {"renderer_name": "role_colon", "step": "7"}


def test_publish_and_unpublish_are_idempotent(server, service_client, api_key):
    """A repeated call succeeds at once: the SDK retries a 409 for five minutes before raising it."""
    tc = service_client.create_lora_training_client(base_model="tiny", rank=4).result()
    path = tc.save_state("twice").result().path
    rest = tinker.RestClient(base_url=server.base_url, api_key=api_key)
    start = time.monotonic()
    for _ in range(2):
        rest.publish_checkpoint_from_tinker_path(path).result()
    assert [c.public for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [True]
    for _ in range(2):
        rest.unpublish_checkpoint_from_tinker_path(path).result()
    assert [c.public for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [False]
    assert time.monotonic() - start < 5


def test_a_refused_request_is_named_and_the_model_goes_on(service_client):
    tc = service_client.create_lora_training_client(base_model="tiny", rank=4).result()
    with pytest.raises(tinker.BadRequestError, match=r"age_encryption_recipients\[0\]: not an age recipient"):
        tc.save_weights_external("export", age_encryption_recipients=["age1recipient"]).result()
    start = time.monotonic()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()  # its seq_id comes after the refused one
    assert time.monotonic() - start < 5
