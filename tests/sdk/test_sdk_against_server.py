"""The Loraplex SDK against a real embedded server (tiny model, vLLM sampler), and side by side
with the official tinker SDK on the same server."""

from __future__ import annotations

import asyncio
import threading

import httpx
import numpy as np
import pytest
import tinker
import torch
import uvicorn
from fastapi import FastAPI, Request, Response
from peft import PeftModel
from transformers import AutoModelForCausalLM

import loraplex
from loraplex import types
from service.embedded import free_port
from tests.servers import running_server

pytestmark = pytest.mark.vllm  # the module's server runs the vLLM sampler


TOKENS = list(range(10, 30))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("loraplex")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server, api_key):
    with loraplex.ServiceClient(base_url=server.base_url, api_key=api_key) as service:
        yield service


def datum(tokens=TOKENS, module=types):
    return module.Datum(
        model_input=module.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                        "weights": np.ones(len(tokens) - 1, dtype=np.float32)},
    )


def test_training_and_sampling_flow(client):
    training = client.create_lora_training_client("tiny", rank=8, seed=1)
    assert training.model_id.endswith(":train:0")
    first = training.forward_backward([datum()], "cross_entropy").result()
    assert first.metrics["loss:sum"] > 0 and first.loss_fn_outputs[0]["logprobs"].shape == (len(TOKENS) - 1,)
    training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    state = training.save_state("after-one").result().path
    assert state == f"tinker://{training.model_id}/weights/after-one"

    sampler = training.save_weights_and_get_sampling_client()
    response = sampler.sample(types.ModelInput.from_ints(TOKENS[:5]), 3,
                              types.SamplingParams(max_tokens=6, temperature=1.0, seed=1, stop=[])).result()
    assert len(response.sequences) == 3
    assert all(s.policy_version == 1 and len(s.logprobs) == len(s.tokens) == 6 for s in response.sequences)
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    assert logprobs[0] is None and len(logprobs) == len(TOKENS)

    # a new run from the saved state continues where it was: same forward numbers
    resumed = client.create_training_client_from_state(state)
    expected = training.forward([datum()]).result().loss_fn_outputs[0]["logprobs"]
    np.testing.assert_allclose(resumed.forward([datum()]).result().loss_fn_outputs[0]["logprobs"], expected, rtol=1e-6)

    runs = client.create_rest_client().list_training_runs().result().training_runs
    assert training.model_id in {r.training_run_id for r in runs}


def test_same_numbers_as_the_official_sdk(server, client, api_key):
    official = tinker.ServiceClient(base_url=server.base_url, api_key=api_key)
    ours = client.create_lora_training_client("tiny", rank=4, seed=7)
    theirs = official.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
    results = []
    for training, module in ((ours, types), (theirs, tinker.types)):
        out = training.forward_backward([datum(module=module)], "cross_entropy").result()
        training.optim_step(module.AdamParams(learning_rate=1e-2)).result()
        after = training.forward([datum(module=module)], "cross_entropy").result()
        logprobs = after.loss_fn_outputs[0]["logprobs"]
        results.append((out.metrics["loss:sum"], np.asarray(logprobs.to_numpy() if hasattr(logprobs, "to_numpy") else logprobs)))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-6)

    params = dict(max_tokens=8, temperature=0.0, stop=[])
    our_tokens = ours.save_weights_and_get_sampling_client().sample(
        types.ModelInput.from_ints(TOKENS[:6]), 1, types.SamplingParams(**params)).result().sequences[0].tokens
    their_tokens = theirs.save_weights_and_get_sampling_client().sample(
        tinker.types.ModelInput.from_ints(TOKENS[:6]), 1, tinker.types.SamplingParams(**params)).result().sequences[0].tokens
    assert our_tokens == their_tokens


def test_async_twins(client):
    async def main():
        training = await client.create_lora_training_client_async("tiny", rank=4, seed=3)
        futures = [await training.forward_backward_async([datum()], "cross_entropy") for _ in range(2)]
        losses = [(await f).metrics["loss:sum"] for f in futures]
        await (await training.optim_step_async(types.AdamParams(learning_rate=1e-3)))
        sampler = await training.save_weights_and_get_sampling_client_async()
        sampled = await (await sampler.sample_async(types.ModelInput.from_ints(TOKENS[:4]), 2,
                                                    types.SamplingParams(max_tokens=3, seed=2)))
        runs = (await client.create_rest_client().list_training_runs_async()).training_runs
        assert training.model_id in {r.training_run_id for r in runs}
        return losses, sampled

    losses, sampled = asyncio.run(main())
    assert losses[0] == pytest.approx(losses[1])  # gradients accumulate; the weights did not move yet
    assert len(sampled.sequences) == 2


def test_errors_are_typed_and_carry_the_servers_message(client):
    with pytest.raises(loraplex.BadRequestError, match="rank"):
        client.create_lora_training_client("tiny", rank=1000)
    with pytest.raises(loraplex.BadRequestError, match="base_model"):
        client.create_lora_training_client("no-such-model", rank=4)
    training = client.create_lora_training_client("tiny", rank=4)
    with pytest.raises(loraplex.BadRequestError, match="target_tokens"):
        training.forward_backward([datum(tokens=[1, 2, 600])]).result()
    with pytest.raises(loraplex.NotFoundError, match="model_id"):
        loraplex.TrainingClient(client, "nobody:train:0", "tiny").optim_step().result()
    with pytest.raises(ValueError, match="api_key"):
        loraplex.ServiceClient(base_url="http://127.0.0.1:1", api_key="")


def test_custom_loss_matches_the_builtin_one(client):
    """forward_backward_custom with the cross-entropy written in torch gives cross_entropy's gradient."""
    builtin = client.create_lora_training_client("tiny", rank=4, seed=5)
    custom = client.create_lora_training_client("tiny", rank=4, seed=5)
    builtin.forward_backward([datum()], "cross_entropy").result()
    out = custom.forward_backward_custom([datum()], lambda data, logprobs: (-sum(lp.sum() for lp in logprobs), {})).result()
    assert out.metrics["loss:sum"] > 0
    for training in (builtin, custom):
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = [t.forward([datum()]).result().loss_fn_outputs[0]["logprobs"] for t in (builtin, custom)]
    np.testing.assert_allclose(after[0], after[1], rtol=1e-5)


def test_download_checkpoint_writes_a_peft_folder(client, tmp_path, tiny_model_path):
    training = client.create_lora_training_client("tiny", rank=4, seed=11)
    training.forward_backward([datum()]).result()
    training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    sampler_path = training.save_weights_for_sampler("export").result().path
    state_path = training.save_state("export").result().path
    expected = training.forward([datum()]).result().loss_fn_outputs[0]["logprobs"]
    rest = client.create_rest_client()
    for path, dest in ((sampler_path, tmp_path / "from-sampler"), (state_path, tmp_path / "from-state")):
        folder = rest.download_checkpoint(path, dest)
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), folder).eval()
        with torch.no_grad():
            logits = model(torch.tensor([TOKENS[:-1]])).logits[0]
        got = torch.log_softmax(logits, -1)[torch.arange(len(TOKENS) - 1), torch.tensor(TOKENS[1:])]
        np.testing.assert_allclose(got.numpy(), expected, atol=1e-5)


class FlakyProxy:
    """A real HTTP proxy in front of the server that answers 503 (then 429) to the first calls of
    each route: the SDK must retry through them."""

    def __init__(self, target: str, failures: int = 2) -> None:
        self.calls: dict[str, int] = {}
        app = FastAPI()
        upstream = httpx.AsyncClient(base_url=target, timeout=60)

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
        async def forward(path: str, request: Request) -> Response:
            n = self.calls[path] = self.calls.get(path, 0) + 1
            if n <= failures:
                return Response("busy", status_code=503 if n == 1 else 429, headers={"Retry-After": "0.1"})
            headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
            reply = await upstream.request(request.method, f"/{path}", content=await request.body(), headers=headers)
            return Response(reply.content, reply.status_code, media_type=reply.headers.get("content-type"))

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            threading.Event().wait(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def test_transient_errors_are_retried(server, api_key):
    proxy = FlakyProxy(server.base_url)
    try:
        with loraplex.ServiceClient(base_url=f"http://127.0.0.1:{proxy.port}", api_key=api_key) as service:
            training = service.create_lora_training_client("tiny", rank=4)
            assert training.forward_backward([datum()]).result().metrics["loss:sum"] > 0
    finally:
        proxy.stop()
    assert proxy.calls["api/v1/forward_backward"] == 3  # 503, 429, then through
