"""Adapter checkpoints: PEFT folders for samplers, full training state for resuming.

Both are folders written atomically: everything goes into a temporary folder that becomes the
checkpoint only when complete (workers/store.py: a rename on local disk, a new version on a remote
store). Locations are local paths or fsspec URLs. Both carry a `manifest.json` with the SHA-256 of
their files, verified on load, so a truncated or altered checkpoint is refused instead of trained
on or sampled from (a training state: its tensors file; a sampler snapshot: each of its files).
The file formats, and reading and verifying them without torch, are checkpoint_files.py's.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_bytes, save_file
from torch import nn

from contract.configs import LoraConfig
from contract.errors import InvalidInputError
from workers import store
from workers.trainer.adapters import Adapter, LoraWeights
from workers.trainer.checkpoint_files import (
    MANIFEST, PEFT_WEIGHTS, SNAPSHOT_METADATA, STATE_FORMAT, STATE_TENSORS, TENSORS_CORRUPT, CheckpointError,
    sha256_file, snapshot_integrity, verified_manifest, write_snapshot_manifest,
)


# --- PEFT folder (sampler weights) -------------------------------------------------------------


def save_peft_adapter(
    adapter: Adapter, path: str | Path, base_model_path: str | Path, metadata: dict | None = None
) -> str | Path:
    """Write `adapter_config.json` + `adapter_model.safetensors` that peft and vLLM load as-is;
    `metadata` goes to `loraplex.json` beside them (e.g. the policy version the snapshot is)."""
    from peft import LoraConfig as PeftLoraConfig

    cfg = adapter.config
    peft_config = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=0.0,
        target_modules=list(cfg.target_modules()),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=str(base_model_path),
        inference_mode=True,
    )
    tensors = {}
    for path_in_model, w in adapter.weights.items():
        prefix = f"base_model.model.{path_in_model}"
        # copies: the matrices are views of one flat tensor, and safetensors refuses shared storage
        tensors[f"{prefix}.lora_A.weight"] = w.lora_a.detach().to("cpu", copy=True)
        tensors[f"{prefix}.lora_B.weight"] = w.lora_b.detach().to("cpu", copy=True)
    with store.writing(path) as tmp:
        peft_config.save_pretrained(tmp)
        save_file(tensors, tmp / PEFT_WEIGHTS, metadata={"format": "pt"})
        if metadata is not None:
            (tmp / SNAPSHOT_METADATA).write_text(json.dumps(metadata))
        write_snapshot_manifest(tmp)
    return path


def export_peft_from_state(state: str | Path, dest: str | Path, base_model_path: str | Path) -> Path:
    """Write a training-state checkpoint's weights as a PEFT folder (what save_peft_adapter writes)."""
    from peft import LoraConfig as PeftLoraConfig

    manifest, tensors = _read_verified(state)
    config = LoraConfig(**manifest["lora_config"])
    peft_config = PeftLoraConfig(
        r=config.rank, lora_alpha=config.alpha, lora_dropout=0.0, target_modules=list(config.target_modules()),
        bias="none", task_type="CAUSAL_LM", base_model_name_or_path=str(base_model_path), inference_mode=True,
    )
    weights = {}
    for name, tensor in tensors.items():
        if name.startswith("weight/"):  # weight/<module path>.lora_A -> base_model.model.<module path>.lora_A.weight
            weights[f"base_model.model.{name.removeprefix('weight/')}.weight"] = tensor
    with store.writing(dest) as tmp:
        peft_config.save_pretrained(tmp)
        save_file(weights, tmp / PEFT_WEIGHTS, metadata={"format": "pt"})
        (tmp / SNAPSHOT_METADATA).write_text(json.dumps({"policy_version": manifest["step"],
                                                          "adapter_id": manifest["adapter_id"]}))
        write_snapshot_manifest(tmp)
    return Path(dest)


def export_peft(checkpoint: str | Path, dest: str | Path, base_model_path: str | Path) -> Path:
    """Any checkpoint as a PEFT folder at the local path `dest`: a training state is converted, a
    sampler snapshot (already PEFT) copied."""
    folder = store.local_folder(checkpoint)
    if folder is not None and (folder / STATE_TENSORS).is_file():
        return export_peft_from_state(folder, dest, base_model_path)
    if folder is None or not (folder / PEFT_WEIGHTS).is_file():
        raise CheckpointError("the checkpoint is neither a training state nor a PEFT folder")
    failed = snapshot_integrity(folder)
    if failed:
        raise CheckpointError(f"{failed[0]} failed its SHA-256 check (the file is corrupt)")
    shutil.copytree(folder, dest)
    return Path(dest)


# --- training state ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingState:
    """An adapter's training state, detached from the adapter: safe to write while it trains on."""

    adapter_id: str
    lora_config: dict
    step: int
    tensors: dict[str, torch.Tensor]  # weight/<name>, exp_avg/<name>, exp_avg_sq/<name>, grad/<name>

    @classmethod
    def capture(cls, adapter: Adapter, *, with_gradients: bool = False) -> "TrainingState":
        """Weights, Adam moments and step; `with_gradients` adds the gradients accumulated since the
        last optim_step (the adapter's full state, for moving it). The tensors are copies: the state
        stays as it is now while the adapter trains on."""
        flats = {"weight": adapter.flat_weights}
        if with_gradients and adapter.has_gradients():
            flats["grad"] = adapter.flat_grads
        if adapter.adam_state:
            flats.update(exp_avg=adapter.adam_state["exp_avg"], exp_avg_sq=adapter.adam_state["exp_avg_sq"])
        tensors = {}
        for kind, flat in flats.items():  # copies: safetensors refuses views of one storage
            tensors.update({f"{kind}/{name}": view.detach().to("cpu", copy=True)
                            for name, view in adapter.named_views(flat)})
        return cls(adapter.id, adapter.config.to_dict(), adapter.step, tensors)

    def write(self, path: str | Path, extra: dict | None = None) -> str | Path:
        """Write atomically to `path`; `extra` is kept in the manifest (e.g. the seq_id it reflects).
        The manifest, with the SHA-256 of the tensors file as written, is published only with the
        complete file. (Serializing to memory to hash the bytes before writing, then reading the
        file back to compare, cost 2.2-2.6x this write for a 68 MB state and only rechecked the
        page cache: not done.)"""
        with store.writing(path) as tmp:
            save_file(self.tensors, tmp / STATE_TENSORS)
            manifest = {
                "format": STATE_FORMAT,
                "adapter_id": self.adapter_id,
                "lora_config": self.lora_config,
                "step": self.step,
                "has_optimizer_state": any(k.startswith("exp_avg/") for k in self.tensors),
                "has_gradients": any(k.startswith("grad/") for k in self.tensors),
                "tensors_sha256": sha256_file(tmp / STATE_TENSORS),
                "extra": extra or {},
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        return path


def save_training_state(adapter: Adapter, path: str | Path, extra: dict | None = None, *,
                        with_gradients: bool = False) -> str | Path:
    """Save weights, Adam moments and step (and with_gradients, the pending gradients) now."""
    return TrainingState.capture(adapter, with_gradients=with_gradients).write(path, extra)


def _read_verified(location: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    manifest, tensors_path = verified_manifest(location)
    data = tensors_path.read_bytes()  # read once: hashed and parsed from the same bytes
    if hashlib.sha256(data).hexdigest() != manifest.get("tensors_sha256"):
        raise CheckpointError(TENSORS_CORRUPT)
    return manifest, load_bytes(data)


def load_training_state(
    adapter_id: str,
    path: str | Path,
    base_layers: dict[str, nn.Linear],
    dtype: torch.dtype,
    max_rank: int,
    *,
    with_optimizer: bool = True,
) -> Adapter:
    manifest, tensors = _read_verified(path)
    config = LoraConfig(**manifest["lora_config"])
    try:
        config.validate(max_rank)
    except InvalidInputError as e:
        raise CheckpointError(str(e)) from None
    weights = {}
    for module_path in base_layers:
        a, b = tensors.get(f"weight/{module_path}.lora_A"), tensors.get(f"weight/{module_path}.lora_B")
        if a is None:
            continue
        layer = base_layers[module_path]
        if b is None or a.shape != (config.rank, layer.in_features) or b.shape != (layer.out_features, config.rank):
            raise CheckpointError(f"the weights of {module_path} do not fit this base model")
        device = layer.weight.device
        weights[module_path] = LoraWeights(a.to(device, dtype), b.to(device, dtype))
    expected = {n for n in base_layers if n.rsplit(".", 1)[-1] in config.target_modules()}
    if set(weights) != expected:
        raise CheckpointError("its modules do not match this base model's layers")
    adapter = Adapter(adapter_id, config, weights)
    def load_flat(kind: str, flat: torch.Tensor) -> torch.Tensor:
        for name, view in adapter.named_views(flat):
            view.copy_(tensors[f"{kind}/{name}"])
        return flat

    if with_optimizer and manifest.get("has_optimizer_state"):
        adapter.step = int(manifest["step"])
        adapter.adam_state = {
            "step": torch.tensor(float(adapter.step), dtype=torch.float32, device=adapter.flat_weights.device),
            "exp_avg": load_flat("exp_avg", torch.empty_like(adapter.flat_weights)),
            "exp_avg_sq": load_flat("exp_avg_sq", torch.empty_like(adapter.flat_weights)),
        }
    if with_optimizer and manifest.get("has_gradients"):  # a moved adapter's accumulated gradients
        load_flat("grad", adapter.flat_grads)
        adapter.gradients_pending = True
    return adapter
