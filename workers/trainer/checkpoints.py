"""Adapter checkpoints: PEFT folders for samplers, full training state for resuming.

Both are folders written atomically: everything goes into a temporary folder that becomes the
checkpoint only when complete (storage/store.py: a rename on local disk, a new version on a remote
store). Locations are local paths or fsspec URLs. Both carry a `manifest.json` with the SHA-256 of
their files, verified on load, so a truncated or altered checkpoint is refused instead of trained
on or sampled from (a training state: its tensors file; a sampler snapshot: each of its files).
The file formats, and reading and verifying them without torch, are storage/checkpoint_files.py's;
turning any checkpoint into a PEFT folder (a download, an export) is storage/peft_export.py's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from contract.configs import LoraConfig
from contract.errors import InvalidInputError
from storage import store
from storage.checkpoint_files import (
    MANIFEST,
    SNAPSHOT_METADATA,
    STATE_FORMAT,
    STATE_TENSORS,
    CheckpointError,
    sha256_file,
    write_snapshot_manifest,
)
from storage.peft_export import read_verified_state, write_peft_files
from workers.trainer.adapters import OPTIMIZER_STATE, Adapter, LoraWeights, lora_shapes

# --- PEFT folder (sampler weights) -------------------------------------------------------------


def save_peft_adapter(
    adapter: Adapter, path: str | Path, base_model_path: str | Path, metadata: dict | None = None
) -> str | Path:
    """Write `adapter_config.json` + `adapter_model.safetensors` that peft and vLLM load as-is;
    `metadata` goes to `loraplex.json` beside them (e.g. the policy version the snapshot is)."""
    # copies: the matrices are views of one flat tensor, and safetensors refuses shared storage
    pairs = {p: (w.lora_a.detach().to("cpu", copy=True), w.lora_b.detach().to("cpu", copy=True))
             for p, w in adapter.weights.items()}
    with store.writing(path) as tmp:
        write_peft_files(tmp, adapter.config, base_model_path, pairs)
        if metadata is not None:
            (tmp / SNAPSHOT_METADATA).write_text(json.dumps(metadata))
        write_snapshot_manifest(tmp)
    return path


# --- training state ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingState:
    """An adapter's training state, detached from the adapter: safe to write while it trains on."""

    adapter_id: str
    lora_config: dict
    step: int
    # weight/<name>, grad/<name>, and the optimizer's state: exp_avg/<name> and exp_avg_sq/<name> (AdamW),
    # momentum/<name> (Dimuon)
    tensors: dict[str, torch.Tensor]
    optimizer: str = "adamw"  # the adapter's, whether or not it has stepped yet
    # `capture(handed_over=True)`: the adapter and its flat tensors, taken as they are, copied into
    # `tensors`' form only when written (on the writer's thread)
    handed: tuple[Adapter, dict[str, torch.Tensor]] | None = None

    @classmethod
    def capture(cls, adapter: Adapter, *, with_gradients: bool = False, handed_over: bool = False) -> "TrainingState":
        """Weights, optimizer state and step; `with_gradients` adds the gradients accumulated since the
        last optim_step (the adapter's full state, for moving it). The tensors are copies: the state
        stays as it is now while the adapter trains on. `handed_over`: the caller drops the adapter at once
        and never changes it again (paging it out): nothing is copied now, so the copy (~0.1 s for a rank-8
        SmolLM2 run on 2 cores) is the writer's, off the cycle's path."""
        flats = {"weight": adapter.flat_weights}
        if with_gradients and adapter.has_gradients():
            flats["grad"] = adapter.flat_grads
        if adapter.optimizer_state:
            flats.update({kind: adapter.optimizer_state[kind] for kind in OPTIMIZER_STATE[adapter.optimizer]})
        if handed_over:
            return cls(adapter.id, adapter.config.to_dict(), adapter.step, {}, adapter.optimizer, (adapter, flats))
        return cls(adapter.id, adapter.config.to_dict(), adapter.step, copies(adapter, flats), adapter.optimizer)

    @property
    def nbytes(self) -> int:
        tensors = self.tensors.values() if self.handed is None else self.handed[1].values()
        return sum(t.numel() * t.element_size() for t in tensors)

    def write(self, path: str | Path, extra: dict | None = None) -> str | Path:
        """Write atomically to `path`; `extra` is kept in the manifest (e.g. the seq_id it reflects).
        The manifest, with the SHA-256 of the tensors file as written, is published only with the
        complete file. (Serializing to memory to hash the bytes before writing, then reading the
        file back to compare, cost 2.2-2.6x this write for a 68 MB state and only rechecked the
        page cache: not done.)"""
        tensors = self.tensors if self.handed is None else copies(*self.handed)
        with store.writing(path) as tmp:
            save_file(tensors, tmp / STATE_TENSORS)
            manifest = {
                "format": STATE_FORMAT,
                "adapter_id": self.adapter_id,
                "lora_config": self.lora_config,
                "step": self.step,
                "optimizer": self.optimizer,
                "has_optimizer_state": any(k.startswith(f"{OPTIMIZER_STATE[self.optimizer][0]}/") for k in tensors),
                "has_gradients": any(k.startswith("grad/") for k in tensors),
                "tensors_sha256": sha256_file(tmp / STATE_TENSORS),
                "extra": extra or {},
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        return path


def copies(adapter: Adapter, flats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`kind/<parameter name>` -> a copy of its part of the adapter's flat tensor of that kind (copies:
    safetensors refuses views of one storage)."""
    tensors = {}
    for kind, flat in flats.items():
        tensors.update({f"{kind}/{name}": view.detach().to("cpu", copy=True) for name, view in adapter.named_views(flat)})
    return tensors


def save_training_state(adapter: Adapter, path: str | Path, extra: dict | None = None, *,
                        with_gradients: bool = False) -> str | Path:
    """Save weights, optimizer state and step (and with_gradients, the pending gradients) now."""
    return TrainingState.capture(adapter, with_gradients=with_gradients).write(path, extra)


def load_training_state(
    adapter_id: str,
    path: str | Path,
    base_layers: dict[str, nn.Linear],
    dtype: torch.dtype,
    max_rank: int,
    *,
    with_optimizer: bool = True,
    optimizer: str | None = None,
    read: tuple[dict, dict] | None = None,
) -> Adapter:
    """The adapter a training state holds. with_optimizer: with its optimizer, that optimizer's state and
    step, and any pending gradients (resuming, or paging in); `optimizer`, when given, must be the
    checkpoint's. Without: its weights only, with a fresh `optimizer` (AdamW when None). `read`: its
    manifest and tensors, read and verified already (a page-in read ahead: workers/trainer/prefetch.py)."""
    manifest, tensors = read if read is not None else read_verified_state(path)
    saved_optimizer = manifest.get("optimizer", "adamw")  # states written before Dimuon were AdamW's
    if with_optimizer and optimizer not in (None, saved_optimizer):
        raise CheckpointError(f"its optimizer state is {saved_optimizer}'s, not {optimizer}'s")
    run_optimizer = saved_optimizer if with_optimizer else optimizer or "adamw"
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
        if b is None or (tuple(a.shape), tuple(b.shape)) != lora_shapes(layer, config.rank):
            raise CheckpointError(f"the weights of {module_path} do not fit this base model")
        device = layer.weight.device
        weights[module_path] = LoraWeights(a.to(device, dtype), b.to(device, dtype))
    expected = {n for n in base_layers if n.rsplit(".", 1)[-1] in config.target_modules()}
    if set(weights) != expected:
        raise CheckpointError("its modules do not match this base model's layers")
    adapter = Adapter(adapter_id, config, weights, run_optimizer)

    def load_flat(kind: str, flat: torch.Tensor) -> torch.Tensor:
        for name, view in adapter.named_views(flat):
            view.copy_(tensors[f"{kind}/{name}"])
        return flat

    if with_optimizer and manifest.get("has_optimizer_state"):
        adapter.step = int(manifest["step"])
        adapter.optimizer_state = {kind: load_flat(kind, torch.empty_like(adapter.flat_weights))
                                   for kind in OPTIMIZER_STATE[run_optimizer]}
        if run_optimizer == "adamw":  # torch's fused AdamW reads its step count from a tensor
            adapter.optimizer_state["step"] = torch.tensor(float(adapter.step), dtype=torch.float32,
                                                           device=adapter.flat_weights.device)
    if with_optimizer and manifest.get("has_gradients"):  # a moved adapter's accumulated gradients
        load_flat("grad", adapter.flat_grads)
        adapter.gradients_pending = True
    return adapter
