"""Any checkpoint as a PEFT folder (adapter_config.json + adapter_model.safetensors), as peft and vLLM
load it: a download of a checkpoint's archive, `loraplex-admin checkpoints export`, and the trainer's
sampler snapshots share this one definition of the PEFT config.

Reading tensors needs torch (safetensors' torch loader) and the config needs peft: both are imported
by the functions that use them, so a process that only lists checkpoints (an API replica) never loads
them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from contract.configs import LoraConfig
from storage import store
from storage.checkpoint_files import (
    PEFT_WEIGHTS,
    SNAPSHOT_METADATA,
    STATE_TENSORS,
    TENSORS_CORRUPT,
    CheckpointError,
    snapshot_integrity,
    verified_manifest,
    write_snapshot_manifest,
)
from storage.external_weights import copy_adapter, is_external


def peft_config(config: LoraConfig, base_model_path: str | Path):
    """peft's LoraConfig for an adapter of `config` on the base model at `base_model_path`."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=config.rank, lora_alpha=config.alpha, lora_dropout=0.0, target_modules=list(config.target_modules()),
        bias="none", task_type="CAUSAL_LM", base_model_name_or_path=str(base_model_path), inference_mode=True,
    )


def read_verified_state(location: str | Path) -> tuple[dict, dict]:
    """A training state's manifest and tensors (torch), its tensors file checked against the manifest."""
    from safetensors.torch import load as load_bytes

    manifest, tensors_path = verified_manifest(location)
    data = tensors_path.read_bytes()  # read once: hashed and parsed from the same bytes
    if hashlib.sha256(data).hexdigest() != manifest.get("tensors_sha256"):
        raise CheckpointError(TENSORS_CORRUPT)
    return manifest, load_bytes(data)


def export_peft_from_state(state: str | Path, dest: str | Path, base_model_path: str | Path) -> Path:
    """Write a training-state checkpoint's weights as a PEFT folder (what save_peft_adapter writes)."""
    from safetensors.torch import save_file

    manifest, tensors = read_verified_state(state)
    weights = {}
    for name, tensor in tensors.items():
        if name.startswith("weight/"):  # weight/<module path>.lora_A -> base_model.model.<module path>.lora_A.weight
            weights[f"base_model.model.{name.removeprefix('weight/')}.weight"] = tensor
    with store.writing(dest) as tmp:
        peft_config(LoraConfig(**manifest["lora_config"]), base_model_path).save_pretrained(tmp)
        save_file(weights, tmp / PEFT_WEIGHTS, metadata={"format": "pt"})
        (tmp / SNAPSHOT_METADATA).write_text(json.dumps({"policy_version": manifest["step"],
                                                          "adapter_id": manifest["adapter_id"]}))
        write_snapshot_manifest(tmp)
    return Path(dest)


def export_peft(checkpoint: str | Path, dest: str | Path, base_model_path: str | Path) -> Path:
    """Any checkpoint as a PEFT folder at the local path `dest`: a training state is converted, a
    sampler snapshot (already PEFT) copied, an external export's adapter copied."""
    folder = store.local_folder(checkpoint)
    if folder is not None and (folder / STATE_TENSORS).is_file():
        return export_peft_from_state(folder, dest, base_model_path)
    if folder is not None and is_external(folder):
        return copy_adapter(folder, dest)
    if folder is None or not (folder / PEFT_WEIGHTS).is_file():
        raise CheckpointError("the checkpoint is neither a training state nor a PEFT folder")
    failed = snapshot_integrity(folder)
    if failed:
        raise CheckpointError(f"{failed[0]} failed its SHA-256 check (the file is corrupt)")
    shutil.copytree(folder, dest)
    return Path(dest)
