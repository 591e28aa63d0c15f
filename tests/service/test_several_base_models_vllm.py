"""Two base models sampled by one embedded server, each by its own vLLM engine: a run's sampler weights
are sampled on the run's model (its logprobs are the trainer's), through the Tinker API and the
OpenAI-compatible one alike."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
from openai import OpenAI
from tinker import types

from tests.servers import running_server
from tests.service.test_scheduling import sft_data

pytestmark = pytest.mark.vllm
MODELS = ("loraplex/tiny", "loraplex/tiny-qwen3")
PROMPT = [5, 17, 42, 99, 3, 250, 7]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("several"), base_model=",".join(MODELS), cycle_gather_seconds=0) as s:
        yield s


def test_each_model_samples_its_own_runs_weights(server):
    key = server.new_tenant()
    service = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    capabilities = httpx.get(f"{server.base_url}/api/v1/get_server_capabilities").json()["supported_models"]
    assert [(m["model_name"], m["sampleable"]) for m in capabilities] == [(name, True) for name in MODELS]
    openai = OpenAI(base_url=f"{server.base_url}/oai/api/v1", api_key=key)
    for name in MODELS:
        run = service.create_lora_training_client(base_model=name, rank=4, seed=2).result()
        for seed in range(2):
            run.forward_backward(sft_data(seed), "cross_entropy").result()
            run.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        sampler = run.save_weights_and_get_sampling_client().result()
        sampled = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(
            max_tokens=6, temperature=0.0)).result().sequences[0]
        full = PROMPT + list(sampled.tokens)
        datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                            loss_fn_inputs={"target_tokens": np.array(full[1:]),
                                            "weights": np.ones(len(full) - 1, np.float32)})
        trainer = run.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_allclose(sampled.logprobs, trainer[len(PROMPT) - 1:], atol=1e-4)

        completion = openai.completions.create(model=f"tinker://{run.model_id}/sampler_weights/@latest",
                                               prompt=PROMPT, max_tokens=6, temperature=0.0)
        assert completion.choices[0].text and completion.system_fingerprint == "loraplex-v2"
        base = openai.completions.create(model=name, prompt=PROMPT, max_tokens=2, temperature=0.0)
        assert base.system_fingerprint == "loraplex-base"
    listed = [model.id for model in openai.models.list()]
    assert listed[:2] == list(MODELS)
