"""An export of save_weights_external, downloaded from its signed URLs, serves in vLLM as a plain
model (no LoRA): its prompt logprobs are the service's forward logprobs of the same tokens, and the
tokenizer in it is the base model's. (Loading it in transformers: test_external_weights.py.)"""

from __future__ import annotations

import os
import urllib.request

import numpy as np
import pytest
import tinker
from tinker import types

from tests.servers import running_server

pytestmark = pytest.mark.vllm  # starts a vLLM engine on the export
TOKENS = list(range(10, 42))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # no sampler: vLLM allows one engine per process, and this module's is the export's
    with running_server(tmp_path_factory.mktemp("loraplex"), sampler_enabled=False) as running:
        yield running


def test_export_serves_in_vllm_with_the_services_logprobs(server, service_client, api_key, tmp_path):
    tc = service_client.create_lora_training_client(base_model="tiny", rank=8, seed=5).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(TOKENS[1:], dtype=np.int64),
                                        "weights": np.ones(len(TOKENS) - 1, dtype=np.float32)})
    for _ in range(4):
        tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2))
    service = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    path = tc.save_weights_external("served").result().path

    rest = tinker.RestClient(base_url=server.base_url, api_key=api_key)
    for name, url in rest.get_external_weights_urls(path).result().urls.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(url, timeout=60) as response:  # no API key: the URL is signed
            (tmp_path / name).write_bytes(response.read())

    from vllm import LLM, SamplingParams

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: a few seconds to start
    llm = LLM(model=str(tmp_path / "merged"), dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 * 2**20,
              distributed_executor_backend="uni", enable_prefix_caching=False, block_size=32)
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        output = llm.generate({"prompt_token_ids": TOKENS}, params, use_tqdm=False)[0]
        vllm_logprobs = [entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], TOKENS[1:])]
        assert vllm_logprobs == pytest.approx(service, abs=1e-3)
        tokenizer = llm.get_tokenizer()
        assert tokenizer.encode("What is 1 + 2?") == tc.get_tokenizer().encode("What is 1 + 2?")
    finally:
        llm.llm_engine.engine_core.shutdown()
