"""The sampler's snapshot count comes from a byte budget over the largest snapshot the service accepts."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file

from contract.configs import LoraConfig
from models.registry import model_info
from service.settings import Settings
from workers.sampler.engine import SamplerConfig
from workers.sampler.snapshot_budget import largest_snapshot_bytes
from workers.trainer.engine import TrainerEngine


def test_the_largest_snapshot_is_the_size_of_a_lora_on_every_layer(tiny_model_path, tmp_path):
    trainer = TrainerEngine(tiny_model_path, max_rank=16)
    trainer.create_adapter("all", LoraConfig(rank=16, seed=1, train_unembed=True))  # every target there is
    folder = Path(trainer.save_sampler_weights("all", tmp_path / "all"))
    tensors = load_file(folder / "adapter_model.safetensors")
    written = sum(t.numel() * t.element_size() for t in tensors.values())
    assert tensors and all(t.dtype.itemsize == 4 for t in tensors.values())  # fp32, as the sampler's default
    assert largest_snapshot_bytes(tiny_model_path, 16, "float32") == written
    assert largest_snapshot_bytes(tiny_model_path, 16, "bfloat16") == written // 2


def test_the_budget_sets_how_many_snapshots_stay_loaded(tiny_model_path):
    info = model_info("tiny")
    one = largest_snapshot_bytes(tiny_model_path, 64, "float32")
    held = SamplerConfig.from_settings(Settings(sampler_memory_budget=10 * one + 1), info)
    assert held.max_cpu_loras == 10
    assert SamplerConfig.from_settings(Settings(sampler_memory_budget=one), info).max_cpu_loras == 8  # one batch's slots
    assert SamplerConfig.from_settings(Settings(sampler_max_cpu_loras=12, sampler_memory_budget=one), info).max_cpu_loras == 12
