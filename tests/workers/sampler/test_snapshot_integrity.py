"""Sampler snapshots carry a SHA-256 manifest; the sampler's check before vLLM loads one refuses
a corrupt file (naming it) and tells diverged weights (the manifest verifies) from a corrupt file
holding NaN (it does not). vLLM itself: tests/workers/sampler/test_sampler_snapshot_integrity.py."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from loraplex.types import AdamParams
from safetensors.torch import load_file

from contract.configs import LoraConfig
from contract.errors import InvalidInputError
from contract.inputs import EngineDatum, ForwardBackwardInput
from storage.checkpoint_files import CheckpointError, snapshot_integrity
from storage.peft_export import export_peft
from workers.sampler.snapshot_check import SnapshotCorruptError, check_snapshot
from workers.trainer.engine import TrainerEngine

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def engine(tiny_model_path) -> TrainerEngine:
    """An adapter after two real steps (its B matrices are not zero)."""
    engine = TrainerEngine(tiny_model_path, max_rank=16)
    engine.create_adapter("t", LoraConfig(rank=4, seed=1))
    tokens = list(range(10, 40))
    datum = EngineDatum(tokens[:-1], {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    for _ in range(2):
        engine.forward_backward([ForwardBackwardInput("t", [datum])])
        engine.optim_step([("t", AdamParams(learning_rate=2e-2))])
    return engine


@pytest.fixture
def snapshot(engine, tmp_path) -> Path:
    return Path(engine.save_sampler_weights("t", tmp_path / "snapshot"))


def tensor_bytes(weights: Path, name: str) -> tuple[int, int]:
    """Where a tensor's data lies in a safetensors file: (start, end) byte offsets."""
    raw = weights.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8:8 + header_len])[name]["data_offsets"]
    return 8 + header_len + begin, 8 + header_len + end


def rewrite_tensor(weights: Path, name: str, change) -> None:
    """Change one float32 tensor's bytes in place, as a storage fault would (no re-serialization)."""
    start, end = tensor_bytes(weights, name)
    raw = bytearray(weights.read_bytes())
    values = torch.frombuffer(bytearray(raw[start:end]), dtype=torch.float32)
    raw[start:end] = change(values).numpy().tobytes()
    weights.write_bytes(bytes(raw))


def a_lora_b(weights: Path) -> str:
    return next(name for name in load_file(weights) if "lora_B" in name)


def test_the_manifest_covers_every_file_and_an_intact_snapshot_passes(snapshot):
    manifest = json.loads((snapshot / "manifest.json").read_text())
    assert sorted(manifest["files_sha256"]) == ["adapter_config.json", WEIGHTS, "loraplex.json"]
    assert snapshot_integrity(snapshot) == []
    check_snapshot(snapshot)


def test_a_finite_change_to_lora_b_fails_its_checksum_naming_the_file(snapshot):
    name = a_lora_b(snapshot / WEIGHTS)
    before = load_file(snapshot / WEIGHTS)[name].clone()  # (load_file maps the file: copy before changing it)
    rewrite_tensor(snapshot / WEIGHTS, name, lambda v: v * 3 + 0.25)
    after = load_file(snapshot / WEIGHTS)[name]
    assert after.isfinite().all() and not torch.equal(after, before)  # finite: no NaN check would notice
    with pytest.raises(SnapshotCorruptError) as refused:
        check_snapshot(snapshot)
    message = str(refused.value)
    assert refused.value.category == "server"
    assert f"file {WEIGHTS} failed its SHA-256 check" in message and "corrupt" in message
    assert str(snapshot.parent) not in message  # the file's name within the snapshot, never the server's path


def test_a_truncated_or_missing_file_is_named(snapshot):
    weights = snapshot / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(SnapshotCorruptError, match=f"file {WEIGHTS} failed its SHA-256 check"):
        check_snapshot(snapshot)
    (snapshot / "adapter_config.json").unlink()
    with pytest.raises(SnapshotCorruptError, match=f"file adapter_config.json, {WEIGHTS} failed"):
        check_snapshot(snapshot)


def test_diverged_weights_that_match_their_manifest_blame_the_training_run(engine, tmp_path):
    adapter = engine.adapter("t")
    saved = adapter.flat_weights.clone()
    try:
        adapter.flat_weights[-1] = float("nan")  # as a diverged run leaves them
        folder = Path(engine.save_sampler_weights("t", tmp_path / "diverged"))
    finally:
        adapter.flat_weights.copy_(saved)
    nan_tensor = next(name for name, t in load_file(folder / WEIGHTS).items() if not t.isfinite().all())
    with pytest.raises(InvalidInputError) as refused:
        check_snapshot(folder)
    message = str(refused.value)
    assert refused.value.category == "user"
    assert f"tensor {nan_tensor} of the snapshot's file {WEIGHTS} holds NaN or inf" in message
    assert "matches the SHA-256" in message and "training run diverged" in message


def test_nan_written_into_the_file_afterwards_is_reported_as_corruption(snapshot):
    name = a_lora_b(snapshot / WEIGHTS)
    rewrite_tensor(snapshot / WEIGHTS, name, lambda v: v.index_fill(0, torch.tensor([0]), float("nan")))
    with pytest.raises(SnapshotCorruptError) as refused:
        check_snapshot(snapshot)
    message = str(refused.value)
    assert "the file is corrupt" in message and f"holds NaN or inf in tensor {name}" in message
    assert "diverged" not in message


def test_a_snapshot_without_manifest_is_sampled_but_nan_says_the_cause_is_unknown(snapshot):
    (snapshot / "manifest.json").unlink()  # as saved before snapshots had one
    check_snapshot(snapshot)
    rewrite_tensor(snapshot / WEIGHTS, a_lora_b(snapshot / WEIGHTS), lambda v: v.fill_(float("inf")))
    with pytest.raises(InvalidInputError, match="no manifest .* cannot be told"):
        check_snapshot(snapshot)


def test_export_refuses_a_corrupt_snapshot(snapshot, tiny_model_path, tmp_path):
    export_peft(snapshot, tmp_path / "intact", tiny_model_path)
    assert snapshot_integrity(tmp_path / "intact") == []  # the manifest travels with the export
    rewrite_tensor(snapshot / WEIGHTS, a_lora_b(snapshot / WEIGHTS), lambda v: v + 1)
    with pytest.raises(CheckpointError, match=f"{WEIGHTS} failed its SHA-256 check"):
        export_peft(snapshot, tmp_path / "corrupt", tiny_model_path)
    assert not (tmp_path / "corrupt").exists()
    shutil.rmtree(tmp_path / "intact")
