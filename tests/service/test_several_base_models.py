"""One embedded server serving two base models side by side (`--base-model tiny --base-model tiny-qwen3`):
each run trains on the model it was created with, each model's scheduler recovers only its own runs, and
a run whose model is no longer served is refused by name, never run on another model."""

from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import pytest
import sqlalchemy as sa
import tinker
import torch
from tinker import types
from transformers import AutoModelForCausalLM

from db.models import Request, TrainingModel
from models.registry import ModelUnavailable, resolve_model
from scheduler.service import SchedulerService
from service.embedded import ServerThread, free_port
from service.settings import Settings
from tests.distributed.processes import ROOT
from tests.service.test_scheduling import http_client, sft_data, wait_result
from workers.trainer.residency import memory_budget

pytestmark = pytest.mark.slow  # two models' engines, one server restarted twice
MODELS = ("loraplex/tiny", "loraplex/tiny-qwen3")
TOKENS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11]


def base_logprobs(name: str, tokens: list[int]) -> np.ndarray:
    """The base model's own logprobs of tokens[1:], from transformers (a fresh LoRA adds nothing: B is 0)."""
    model = AutoModelForCausalLM.from_pretrained(resolve_model(name), attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]])).logits[0]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy()


def scored(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:]),
                                       "weights": np.ones(len(tokens) - 1, np.float32)})


def settings(tmp_path, base_model: str) -> Settings:
    return Settings(data_dir=tmp_path, port=free_port(), base_model=base_model, long_poll_seconds=5,
                    sampler_enabled=False, engine_process=False, cycle_gather_seconds=0, max_lora_rank=16)


def test_the_flag_repeats_and_names_line_up(tmp_path):
    from service.__main__ import settings as from_flags

    both = from_flags(base_model=["tiny", str(tmp_path)], model_name=["", "acme/q3"])
    assert both.base_model == f"tiny,{tmp_path}" and both.base_models == [("tiny", None), (str(tmp_path), "acme/q3")]
    assert both.model_source("acme/q3") == str(tmp_path) and both.model_source("loraplex/tiny") == "loraplex/tiny"
    with pytest.raises(ModelUnavailable, match="names a model twice"):
        Settings(base_model="tiny,loraplex/tiny").served_models()
    with pytest.raises(ModelUnavailable, match="model_name: 2 names for 1 base models"):
        Settings(base_model="tiny", model_name="a/b,c/d").base_models
    with pytest.raises(ModelUnavailable, match="a scheduler or worker serves one base model"):
        Settings(base_model="tiny,tiny-qwen3").served_model()


def test_an_unservable_second_model_stops_the_start_with_its_name(tmp_path):
    started = subprocess.run([sys.executable, "-m", "service", "serve", "--base-model", "tiny", "--base-model",
                              "acme/not-here", "--data-dir", str(tmp_path), "--port", str(free_port())],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert started.returncode == 2 and "'acme/not-here' is not in the local Hugging Face cache" in started.stderr
    assert "Traceback" not in started.stderr


def test_each_run_trains_on_its_own_base_model_and_restarts_recover_only_their_own(tmp_path, monkeypatch):
    both = settings(tmp_path, "tiny,tiny-qwen3")
    first = ServerThread(both)
    key = first.new_tenant()
    service = tinker.ServiceClient(base_url=first.base_url, api_key=key)
    # each trainer keeps half the training-state budget one model alone would get
    budgets = [stack.executor.residency_stats().budget_bytes for stack in first.embedded.stacks]
    assert budgets == [memory_budget(None, both.trainer_memory_fraction / 2, torch.device("cpu"))] * 2
    capabilities = httpx.get(f"{first.base_url}/api/v1/get_server_capabilities").json()["supported_models"]
    assert [m["model_name"] for m in capabilities] == list(MODELS)
    runs = {name: service.create_lora_training_client(base_model=alias, rank=4, seed=3).result()
            for name, alias in zip(MODELS, ("tiny", "loraplex/tiny-qwen3"))}
    for name, run in runs.items():
        assert run.get_info().model_data.model_name == name
        logprobs = run.forward([scored(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_allclose(logprobs, base_logprobs(name, TOKENS), atol=1e-5)
    assert not np.allclose(base_logprobs(MODELS[0], TOKENS), base_logprobs(MODELS[1], TOKENS), atol=1e-3)

    http = http_client(first, key)
    session = http.post("/api/v1/create_session", json={}).json()["session_id"]
    refused = http.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 9,
                                                      "base_model": "acme/other", "lora_config": {"rank": 4}})
    assert refused.status_code == 400 and all(repr(name) in refused.text for name in MODELS), refused.text
    for name in MODELS:  # each model's tokenizer, by its own name
        assert http.get(f"/api/v1/tokenizers/{name}/files").json()["model"] == name
    # a state trained on one model does not load into a run of the other
    state = runs[MODELS[0]].save_state("s0").result().path
    load = http.post("/api/v1/load_weights", json={"model_id": runs[MODELS[1]].model_id, "seq_id": 3, "path": state})
    assert load.status_code == 400 and "was trained on loraplex/tiny" in load.text, load.text

    # gradients only the engines hold: the restart replays them, each on its own model's scheduler
    for stack in first.embedded.stacks:
        stack.executor.live.writer.submit = lambda *args, **kwargs: None
    for run in runs.values():
        run.forward_backward(sft_data(1), "cross_entropy").result()
    first.stop()

    replayed = []  # (the replaying scheduler's model, the replayed run's model)
    replay = SchedulerService._replay

    def recording(scheduler, s, request_id):
        run_model = s.scalar(sa.select(TrainingModel.base_model).join(Request, Request.model_id == TrainingModel.id)
                             .where(Request.id == request_id))
        replayed.append((scheduler.base_model, run_model))
        return replay(scheduler, s, request_id)

    monkeypatch.setattr(SchedulerService, "_replay", recording)
    second = ServerThread(both.model_copy(update={"port": free_port()}))
    try:
        http = http_client(second, key)
        for run in runs.values():  # the next step of each waits for its replay
            step = http.post("/api/v1/optim_step", json={"model_id": run.model_id, "seq_id": next_seq(second, run),
                                                         "adam_params": {"learning_rate": 0.01}})
            assert wait_result(http, step.json()["request_id"]).status_code == 200
        assert sorted(replayed) == [(name, name) for name in MODELS]
    finally:
        second.stop()

    # served alone, tiny keeps its runs; the other model's run is refused by name and never replayed here
    replayed.clear()
    alone = ServerThread(settings(tmp_path, "tiny").model_copy(update={"port": free_port()}))
    try:
        http = http_client(alone, key)
        info = http.post("/api/v1/get_info", json={"model_id": runs[MODELS[1]].model_id})
        assert info.status_code == 400 and "its base model 'loraplex/tiny-qwen3' is not served here" in info.text
        step = http.post("/api/v1/optim_step", json={"model_id": runs[MODELS[1]].model_id, "seq_id": 9,
                                                     "adam_params": {"learning_rate": 0.01}})
        assert step.status_code == 400 and "loraplex/tiny-qwen3" in step.text, step.text
        assert http.post("/api/v1/get_info", json={"model_id": runs[MODELS[0]].model_id}).status_code == 200
        assert all(scheduler == MODELS[0] for scheduler, _ in replayed)
    finally:
        alone.stop()


def next_seq(server: ServerThread, run) -> int:
    with server.embedded.sessions() as s:
        return s.scalar(sa.select(TrainingModel.last_applied_seq_id).where(TrainingModel.id == run.model_id)) + 1
