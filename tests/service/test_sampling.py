"""Sampling through the official `tinker` SDK (and raw HTTP where the SDK hides the answer),
served by the multi-LoRA vLLM sampler of a real embedded server on the tiny model."""

from __future__ import annotations

import concurrent.futures
import threading

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from transformers import AutoTokenizer

from tests.servers import metric, running_server

pytestmark = pytest.mark.vllm  # the module's server runs the vLLM sampler


PROMPT = [5, 6, 7, 8, 9]
MAX_PENDING = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("loraplex"), sampler_max_pending=MAX_PENDING) as running:
        yield running


def sft_datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                        "weights": np.ones(len(tokens) - 1, dtype=np.float32)},
    )


def train(tc, steps: int, tokens=tuple(range(10, 40))) -> None:
    for _ in range(steps):
        tc.forward_backward([sft_datum(list(tokens))], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()


GREEDY = types.SamplingParams(max_tokens=10, temperature=0.0, stop=[])


def greedy(sampler) -> list[int]:
    return sampler.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY).result().sequences[0].tokens


def test_snapshot_isolation_and_policy_versions(service_client):
    tc = service_client.create_lora_training_client(base_model="tiny", rank=8, seed=1).result()
    train(tc, 3)
    v1 = tc.save_weights_and_get_sampling_client()
    probe = [sft_datum(PROMPT + [11, 12])]
    before = tc.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    response = v1.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY).result()
    first = response.sequences[0].tokens
    assert response.sequences[0].sequence_id.endswith("@v3")  # the policy version: 3 optimizer steps
    after = tc.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert after == before  # sampling never touches the trainer's live weights

    train(tc, 3)
    assert greedy(v1) == first  # v1 keeps sampling exactly the weights it was created from
    v2 = tc.save_weights_and_get_sampling_client()
    response = v2.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY).result()
    assert response.sequences[0].tokens != first and response.sequences[0].sequence_id.endswith("@v6")

    # the same checkpoint name saved twice: a sampler of the first save keeps the first weights
    path = tc.save_weights_for_sampler("named").result().path
    pinned = service_client.create_sampling_client(model_path=path).result()
    pinned_tokens = greedy(pinned)
    train(tc, 2)
    assert tc.save_weights_for_sampler("named").result().path == path
    assert greedy(pinned) == pinned_tokens
    assert greedy(service_client.create_sampling_client(model_path=path).result()) != pinned_tokens


def test_trainer_passes_and_sampler_steps_run_on_one_compute_thread(server, service_client, monkeypatch):
    # one thread, so libgomp keeps one OpenMP team (workers/compute_thread.py)
    seen: dict[str, set[str]] = {"trainer pass": set(), "sampler step": set()}

    def recorded(kind, method):
        def call(*args, **kwargs):
            seen[kind].add(threading.current_thread().name)
            return method(*args, **kwargs)
        return call

    trainer, sampler = server.embedded.executor.engine, server.embedded.sampling.engine
    monkeypatch.setattr(trainer, "_pass", recorded("trainer pass", trainer._pass))
    monkeypatch.setattr(sampler, "_step", recorded("sampler step", sampler._step))
    tc = service_client.create_lora_training_client(base_model="tiny", rank=8, seed=2).result()
    sampling = tc.save_weights_and_get_sampling_client()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both engines busy at once
        sampled = pool.submit(sampling.sample, types.ModelInput.from_ints(PROMPT), 4,
                              types.SamplingParams(max_tokens=30, temperature=1.0, stop=[]))
        pool.submit(train, tc, 3).result()
        assert len(sampled.result().result().sequences) == 4
    assert seen == {"trainer pass": {"torch-compute"}, "sampler step": {"torch-compute"}}


def test_a_deleted_checkpoint_stops_serving(service_client):
    tc = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
    train(tc, 1)
    path = tc.save_weights_for_sampler("doomed").result().path
    sampler = service_client.create_sampling_client(model_path=path).result()
    snapshot = tc.save_weights_and_get_sampling_client()
    greedy(sampler), greedy(snapshot)  # both loaded in the engine now
    rest = service_client.create_rest_client()
    rest.delete_checkpoint_from_tinker_path(path).result()
    with pytest.raises(Exception, match="deleted"):
        greedy(sampler)
    assert len(greedy(snapshot)) == 10  # another checkpoint of the same model still serves
    [left] = rest.list_checkpoints(tc.model_id).result().checkpoints  # the snapshot's own checkpoint
    rest.delete_checkpoint_from_tinker_path(left.tinker_path).result()
    with pytest.raises(Exception, match="deleted"):
        greedy(snapshot)


def test_sampler_and_trainer_logprobs_agree(service_client):
    tc = service_client.create_lora_training_client(base_model="tiny", rank=8, seed=2).result()
    train(tc, 2)
    sampler = tc.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=24, temperature=1.0, seed=11, stop=[])
    sequences = sampler.sample(types.ModelInput.from_ints(PROMPT), 4, params).result().sequences
    data = [sft_datum(PROMPT + s.tokens) for s in sequences]
    outputs = tc.forward(data, "cross_entropy").result().loss_fn_outputs
    gaps = np.concatenate([
        np.abs(out["logprobs"].to_numpy()[len(PROMPT) - 1:] - np.array(s.logprobs))
        for s, out in zip(sequences, outputs)
    ])
    print(f"sampler vs trainer logprobs: mean |diff| {gaps.mean():.2e}, max {gaps.max():.2e} over {gaps.size} tokens")
    # Both run fp32 on the same weights, so only summation order differs (vLLM's CPU kernels vs
    # torch's): measured 2.5e-7 mean and 9.5e-7 max here. The bounds leave 40x / 100x of room
    # and still catch any real mismatch (a wrong adapter, scale or position moves them by >1e-2).
    assert gaps.mean() < 1e-5 and gaps.max() < 1e-4


def test_compute_logprobs_equals_the_trainers_forward(service_client):
    tc = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    train(tc, 2)
    sampler = tc.save_weights_and_get_sampling_client()
    tokens = PROMPT + [40, 41, 42]
    got = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    expected = tc.forward([sft_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert got[0] is None and len(got) == len(tokens)
    assert got[1:] == pytest.approx(expected, abs=1e-4)


def test_num_samples_seed_and_stop_strings(server, service_client, tiny_model_path):
    base = service_client.create_sampling_client(base_model="tiny").result()
    prompt = types.ModelInput.from_ints(PROMPT)
    hot = types.SamplingParams(max_tokens=12, temperature=1.0, seed=5, stop=[])
    generated_before = metric(server.base_url, "loraplex_sampler_generated_tokens_total")
    first, second = (base.sample(prompt, 3, hot).result().sequences for _ in range(2))
    assert metric(server.base_url, "loraplex_sampler_generated_tokens_total") - generated_before == 2 * 3 * 12
    assert [s.tokens for s in first] == [s.tokens for s in second]  # seeded: reproducible
    assert len(first) == 3 and len({tuple(s.tokens) for s in first}) > 1  # yet 3 different samples
    assert all(len(s.logprobs) == len(s.tokens) for s in first)

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    free = first[0].tokens
    # a stop string that first appears in the text with the token at index `end`
    end, stop_text = next((i, t) for i in range(1, len(free)) if (t := tokenizer.decode([free[i]]).strip()).isascii()
                          and t.isalnum() and t not in tokenizer.decode(free[:i]))
    stopped = base.sample(prompt, 1, types.SamplingParams(max_tokens=12, temperature=1.0, seed=5, stop=[stop_text]))
    seq = stopped.result().sequences[0]
    assert seq.stop_reason == "stop" and seq.tokens == free[: end + 1]  # up to and including the match


# --- raw HTTP: what the SDK hides (its retries, the exact status codes) --------------------------


def post(server, key: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/api/v1/{route}", json=body, headers={"X-API-Key": key}, timeout=60)


def new_sampler(server, key: str) -> str:
    session = post(server, key, "create_session", {"tags": []}).json()["session_id"]
    body = {"session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny"}
    return post(server, key, "create_sampling_session", body).json()["sampling_session_id"]


def sample_body(sampler: str, seq_id: int, **overrides) -> dict:
    body = {"sampling_session_id": sampler, "seq_id": seq_id, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "sampling_params": {"max_tokens": 4, "temperature": 1.0}}
    return body | overrides


def test_bad_sample_requests_name_the_field(server, api_key):
    sampler = new_sampler(server, api_key)
    cases = {
        "prompt": sample_body(sampler, 1, prompt={"chunks": [{"type": "encoded_text", "tokens": [1, 512]}]}),
        "max_tokens": sample_body(sampler, 2, sampling_params={"max_tokens": 10_000}),
        "top_k": sample_body(sampler, 3, sampling_params={"max_tokens": 4, "top_k": 0}),
        "prompt_alt_tokens_k": sample_body(sampler, 4, prompt_alt_tokens_k=-1),
        "num_samples": sample_body(sampler, 5, num_samples=0),
        "topk_sample_logprobs": sample_body(sampler, 6, topk_sample_logprobs=1000),
    }
    for field, body in cases.items():
        response = post(server, api_key, "asample", body)
        assert response.status_code in (400, 422) and field in response.text, (field, response.text)
    other_tenant = server.new_tenant()
    response = post(server, other_tenant, "asample", sample_body(sampler, 7))
    assert response.status_code == 404 and "sampling_session_id" in response.text


def test_a_retried_sample_returns_the_original_future(server, api_key):
    sampler = new_sampler(server, api_key)
    first = post(server, api_key, "asample", sample_body(sampler, 0, num_samples=2)).json()
    again = post(server, api_key, "asample", sample_body(sampler, 0, num_samples=2)).json()
    assert again["request_id"] == first["request_id"]
    assert first["sample_sequence_ids"] == [f"{sampler}:0:0@base", f"{sampler}:0:1@base"]


def test_overload_answers_429_and_the_accepted_requests_complete(server, api_key):
    sampler = new_sampler(server, api_key)
    long = {"max_tokens": 300, "temperature": 1.0, "stop": []}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(
            lambda i: post(server, api_key, "asample", sample_body(sampler, i, sampling_params=long)), range(16)))
    codes = [r.status_code for r in responses]
    # at least the first MAX_PENDING are taken; beyond that only what finished early frees a slot
    assert codes.count(200) >= MAX_PENDING and codes.count(429) >= 1 and set(codes) == {200, 429}, codes
    assert "in flight" in next(r for r in responses if r.status_code == 429).text
    for r in responses:
        if r.status_code == 200:
            result = post(server, api_key, "retrieve_future", {"request_id": r.json()["request_id"]})
            while result.headers["content-type"].startswith("application/json") and result.json().get("type") == "try_again":
                result = post(server, api_key, "retrieve_future", {"request_id": r.json()["request_id"]})
            assert result.status_code == 200 and result.headers["content-type"] == "application/x-protobuf"


def test_unpublishing_cuts_off_other_tenants_samplers(server, service_client, api_key):
    """Access is checked on every sample: B's sampler made from A's published snapshot stops when A unpublishes."""
    tc = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    path = tc.save_weights_for_sampler("shared").result().path
    owner = tinker.RestClient(base_url=server.base_url, api_key=api_key)
    owner.publish_checkpoint_from_tinker_path(path).result()
    other = tinker.ServiceClient(base_url=server.base_url, api_key=server.new_tenant())
    borrowed = other.create_sampling_client(model_path=path).result()
    assert len(greedy(borrowed)) == GREEDY.max_tokens
    owner.unpublish_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.NotFoundError, match="no longer published"):
        greedy(borrowed)
    assert len(greedy(service_client.create_sampling_client(model_path=path).result())) == GREEDY.max_tokens


def test_capabilities_say_the_model_samples(server, api_key):
    (model,) = tinker.RestClient(base_url=server.base_url, api_key=api_key).get_server_capabilities().result().supported_models
    assert model.model_name == "loraplex/tiny" and model.sampleable and model.trainable
