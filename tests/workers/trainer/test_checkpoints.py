"""Sampler weights load in peft with identical logits; training state round-trips exactly."""

from __future__ import annotations

import json

import pytest
import torch
from loraplex.types import AdamParams
from peft import PeftModel
from transformers import AutoModelForCausalLM

from contract.configs import LoraConfig
from contract.inputs import EngineDatum, ForwardBackwardInput
from storage.checkpoint_files import CheckpointError, read_snapshot_metadata
from tests.workers.trainer.peft_reference import random_datum
from workers.trainer.engine import TrainerEngine


@pytest.fixture
def trained(tiny_model_path):
    """An engine with one adapter after a few real optimizer steps."""
    engine = TrainerEngine(tiny_model_path)
    engine.create_adapter("t", LoraConfig(rank=4, alpha=8, seed=1, train_mlp=False))
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        data = [random_datum("cross_entropy", 12, gen, engine.vocab_size) for _ in range(2)]
        engine.forward_backward([ForwardBackwardInput("t", data)])
        engine.optim_step([("t", AdamParams(learning_rate=1e-2, weight_decay=0.01))])
    return engine


def full_logprobs(engine: TrainerEngine, adapter_id: str, tokens: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the whole vocabulary at every position, via (N, V) targets."""
    every_token = torch.arange(engine.vocab_size).expand(len(tokens), -1)
    datum = EngineDatum(tokens, {"target_tokens": every_token, "weights": torch.zeros(every_token.shape)})
    return engine.forward([ForwardBackwardInput(adapter_id, [datum])])[0].loss_fn_outputs[0]["logprobs"]


def test_sampler_weights_load_in_peft_with_identical_logits(trained, tmp_path):
    folder = trained.save_sampler_weights("t", tmp_path / "sampler" / "v1")
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                        "loraplex.json", "manifest.json"]
    assert read_snapshot_metadata(folder) == {"policy_version": trained.adapter("t").step, "adapter_id": "t"}
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and set(config["target_modules"]) >= {"q_proj", "lm_head"}

    base = AutoModelForCausalLM.from_pretrained(trained.model_path, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, folder).eval()
    tokens = torch.tensor([5, 17, 300, 42, 7, 99, 2])
    with torch.no_grad():
        expected = torch.log_softmax(peft_model(input_ids=tokens[None]).logits[0].float(), -1)
    torch.testing.assert_close(full_logprobs(trained, "t", tokens), expected, rtol=1e-5, atol=1e-5)


def test_training_state_round_trip_continues_identically(trained, tmp_path):
    path = trained.save_state("t", tmp_path / "state")
    restored = trained.load_state("copy", path)
    assert restored.step == trained.adapter("t").step == 3

    gen = torch.Generator().manual_seed(1)
    data = [random_datum("cross_entropy", 10, gen, trained.vocab_size)]
    for adapter_id in ("t", "copy"):
        trained.forward_backward([ForwardBackwardInput(adapter_id, data)])
        trained.optim_step([(adapter_id, AdamParams(learning_rate=1e-2, weight_decay=0.01))])
    for (name, p), (_, q) in zip(trained.adapter("t").named_parameters(), restored.named_parameters()):
        assert torch.equal(p, q), name


def test_load_without_optimizer_starts_fresh_moments(trained, tmp_path):
    path = trained.save_state("t", tmp_path / "state")
    restored = trained.load_state("fresh", path, with_optimizer=False)
    assert restored.step == 0 and not restored.optimizer_state
    for (_, p), (_, q) in zip(trained.adapter("t").named_parameters(), restored.named_parameters()):
        assert torch.equal(p, q)


def test_corrupt_checkpoint_is_refused(trained, tmp_path):
    path = trained.save_state("t", tmp_path / "state")
    tensors = path / "state.safetensors"
    raw = bytearray(tensors.read_bytes())
    raw[-1] ^= 0xFF
    tensors.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="integrity"):
        trained.load_state("bad", path)
    assert "bad" not in trained.adapters


def test_save_overwrites_atomically_and_leaves_no_temp_folders(trained, tmp_path):
    trained.save_state("t", tmp_path / "state")
    trained.optim_step([("t", AdamParams(1e-2))])
    trained.save_state("t", tmp_path / "state")
    assert [p.name for p in tmp_path.iterdir()] == ["state"]
    assert json.loads((tmp_path / "state" / "manifest.json").read_text())["step"] == 4
