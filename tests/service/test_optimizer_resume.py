"""Through the official `tinker` SDK: Dimuon as Tinker documents it, and a resume that is exact.

After save_state, create_training_client_from_state_with_optimizer continues with the bits of the
run that never stopped, for either optimizer, across a server restart too; a weights-only load
starts a fresh optimizer and so differs. A model's optimizer is fixed at its creation
(docs/optimizers.md): a step of the other family is a 400 naming the field.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.types.optimizer import OptimizerConfigBase, OptimParamsBase  # the SDK's open forms

from service.embedded import ServerThread, free_port
from service.settings import Settings

pytestmark = pytest.mark.slow  # embedded servers, one restarted
VOCAB = 512
ADAMW, DIMUON = types.AdamOptimizerConfig(), types.DimuonOptimizerConfig()
STEP = {"adamw": types.AdamParams(learning_rate=1e-2), "dimuon": types.DimuonParams(learning_rate=0.02)}


def sft_data(seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for n in (9, 5, 12):
        seq = rng.integers(0, VOCAB, n + 1)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                                loss_fn_inputs={"target_tokens": seq[1:].astype(np.int64),
                                                "weights": np.ones(n, dtype=np.float32)}))
    return data


def train(tc, params, seeds) -> None:
    for seed in seeds:
        tc.forward_backward(sft_data(seed), "cross_entropy")
        tc.optim_step(params).result()


def logprobs(tc) -> list[np.ndarray]:
    """The model's logprobs on probe data: equal arrays mean equal weights, bit for bit."""
    return [o["logprobs"].to_numpy() for o in tc.forward(sft_data(99), "cross_entropy").result().loss_fn_outputs]


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    return Settings(data_dir=tmp_path_factory.mktemp("loraplex"), port=free_port(), base_model="tiny",
                    cycle_gather_seconds=0.05, long_poll_seconds=5, sampler_enabled=False)


@pytest.fixture(scope="module")
def server(settings):
    running = ServerThread(settings)
    yield running
    running.stop()


@pytest.mark.parametrize("optimizer", ["adamw", "dimuon"])
def test_resume_with_optimizer_is_exact_across_a_restart(settings, optimizer):
    config = ADAMW if optimizer == "adamw" else DIMUON
    first = ServerThread(settings.model_copy(update={"port": free_port()}))
    try:
        key = first.new_tenant()
        client = tinker.ServiceClient(base_url=first.base_url, api_key=key)
        tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=3, optimizer=config).result()
        train(tc, STEP[optimizer], [1, 2])
        path = tc.save_state("mid").result().path
        train(tc, STEP[optimizer], [3])
        uninterrupted = logprobs(tc)

        resumed = client.create_training_client_from_state_with_optimizer(path).result()
        assert resumed.get_info().optimizer_config.type == optimizer  # the checkpoint's optimizer comes back
        train(resumed, STEP[optimizer], [3])
        assert same(logprobs(resumed), uninterrupted)

        fresh = client.create_training_client_from_state(path, optimizer=config).result()
        train(fresh, STEP[optimizer], [3])
        assert not same(logprobs(fresh), uninterrupted)  # its moments started again from zero
    finally:
        first.stop()

    second = ServerThread(settings.model_copy(update={"port": free_port()}))  # the same data directory
    try:
        client = tinker.ServiceClient(base_url=second.base_url, api_key=key)
        resumed = client.create_training_client_from_state_with_optimizer(path).result()
        train(resumed, STEP[optimizer], [3])
        assert same(logprobs(resumed), uninterrupted)
    finally:
        second.stop()


def test_dimuon_trains_and_is_the_models_for_life(server, service_client, api_key):
    tc = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=1, optimizer=DIMUON).result()
    assert tc.get_info().optimizer_config.type == "dimuon"
    before = tc.forward(sft_data(5), "cross_entropy").result().metrics["loss:sum"]
    step = None
    for _ in range(4):
        tc.forward_backward(sft_data(5), "cross_entropy")
        step = tc.optim_step(types.DimuonParams(learning_rate=0.02)).result()
    assert step.metrics["grad_norm:mean"] > 0
    assert tc.forward(sft_data(5), "cross_entropy").result().metrics["loss:sum"] < before
    with pytest.raises(tinker.BadRequestError, match=r"adam_params\.type: this model was created with dimuon"):
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()

    adam = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    with pytest.raises(tinker.BadRequestError, match=r"optimizer_params\.type: this model was created with adamw"):
        adam.optim_step(types.DimuonParams(learning_rate=0.02)).result()

    # switching: a weights-only model from the Dimuon state, with the optimizer asked for
    path = tc.save_state("dimuon-state").result().path
    switched = service_client.create_training_client_from_state(path, optimizer=ADAMW).result()
    assert switched.get_info().optimizer_config.type == "adamw"
    switched.forward_backward(sft_data(6), "cross_entropy")
    switched.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    with pytest.warns(FutureWarning), pytest.raises(tinker.BadRequestError, match="holds dimuon's optimizer state"):
        adam.load_state_with_optimizer(path).result()  # into an AdamW model: its optimizer stays
    # a restored optimizer state cannot be overridden (the SDK never sends both; a raw client might)
    post = lambda route, body: httpx.post(f"{server.base_url}/api/v1/{route}", json=body, timeout=30,
                                          headers={"X-API-Key": api_key})
    session = post("create_session", {"tags": []}).json()["session_id"]
    refused = post("load_weights", {"session_id": session, "model_seq_id": 0, "path": path, "optimizer": True,
                                    "optimizer_config": {"type": "adamw"}})
    assert refused.status_code == 400 and "optimizer_config: the optimizer state restored" in refused.text


def test_each_dimuon_step_takes_the_defaults_of_the_fields_it_leaves_out(service_client):
    """A damping given at one step is not the next step's: the next step without it gets 1e-4."""
    def dimuon(**fields):  # the SDK's open form of a step's params: every Tinker field, damping included
        return OptimParamsBase(type="dimuon", learning_rate=0.02, **fields)

    runs = {}
    for name, second in (("left out", dimuon()), ("default given", dimuon(damping=1e-4)),
                         ("carried", dimuon(damping=0.5))):
        tc = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=7, optimizer=DIMUON).result()
        train(tc, dimuon(damping=0.5), [11])
        train(tc, second, [12])
        runs[name] = logprobs(tc)
    assert same(runs["left out"], runs["default given"])
    assert not same(runs["left out"], runs["carried"])


@pytest.mark.parametrize("params, field", [
    (OptimParamsBase(type="dimuon", learning_rate=0.02, damping=0.0), r"optimizer_params\.damping"),
    (OptimParamsBase(type="dimuon", learning_rate=0.02, beta1=1.0), r"optimizer_params\.beta1"),
    (OptimParamsBase(type="dimuon", learning_rate=0.02, nesterov=1), r"optimizer_params\.nesterov"),
    (OptimParamsBase(type="dimuon", damping=0.1), r"optimizer_params\.learning_rate: is required"),
    (OptimParamsBase(type="sgd", learning_rate=0.1), r"optimizer_params\.type: unknown optimizer 'sgd'"),
])
def test_a_bad_dimuon_step_is_a_400_naming_the_field(service_client, params, field):
    tc = service_client.create_lora_training_client(base_model="tiny", rank=4, optimizer=DIMUON).result()
    with pytest.raises(tinker.BadRequestError, match=field):
        tc.optim_step(params).result()


@pytest.mark.parametrize("config, field", [
    (OptimizerConfigBase(type="sgd"), r"optimizer_config\.type: optimizer 'sgd' is not supported"),
    (OptimizerConfigBase(type="dimuon", version=2), r"optimizer_config\.version: Dimuon version 2"),
])
def test_an_optimizer_this_server_lacks_is_refused_at_create(service_client, config, field):
    """Never a silent substitute: refused with a 400 naming the field, before a model exists."""
    with pytest.raises(tinker.BadRequestError, match=field):
        service_client.create_lora_training_client(base_model="tiny", rank=4, optimizer=config).result()
