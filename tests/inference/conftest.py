"""One embedded server (the tiny model, its multi-LoRA vLLM sampler) for the whole package: each module
still gets a tenant of its own (`api_key`, module-scoped in tests/conftest.py), and the tool-call tests
share one LoRA that learnt to call the `add` tool (`tool_lora`), trained once for a tenant of its own."""

from __future__ import annotations

import loraplex
import pytest

from api.inference import rendering
from tests.inference.tool_calls import CALL, HERMES_TEMPLATE, QUESTION, TOOLS, ToolLora, sft_steps
from tests.servers import running_server


@pytest.fixture(scope="package")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("loraplex")) as running:
        yield running


@pytest.fixture(scope="module")
def lp(server, api_key) -> loraplex.ServiceClient:
    return loraplex.ServiceClient(base_url=server.base_url, api_key=api_key)


@pytest.fixture(scope="module")
def store(lp) -> loraplex.RolloutsClient:
    return loraplex.RolloutsClient(lp)


@pytest.fixture(scope="package")
def model_path(server) -> str:
    return str(server.embedded.app.state.models.default.info.path)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return rendering.tokenizer_of(model_path)  # the server's own (it runs in this process)


@pytest.fixture(scope="package")
def tool_lora(server, model_path) -> ToolLora:
    tokenizer = rendering.tokenizer_of(model_path)
    with pytest.MonkeyPatch.context() as patch:  # only while rendering: the server keeps the model's own template
        patch.setattr(tokenizer, "chat_template", HERMES_TEMPLATE)
        prompt = rendering.render_chat(tokenizer, [{"role": "user", "content": QUESTION}], TOOLS, "tiny")
    call = tokenizer.encode(CALL)
    api_key = server.new_tenant()
    training = loraplex.ServiceClient(base_url=server.base_url, api_key=api_key).create_lora_training_client(
        "tiny", rank=16, seed=4)
    sft_steps(training, prompt + call + [tokenizer.eos_token_id], len(prompt), 100, 3e-3)
    training.save_weights_for_sampler("tools").result()
    return ToolLora(api_key, f"tinker://{training.model_id}/sampler_weights/@latest", prompt, call)
