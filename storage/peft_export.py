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

from contract.configs import EXPERT_PARAMETERS, MLP_MODULES, LoraConfig
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


def peft_config(config: LoraConfig, base_model_path: str | Path, target_parameters: list[str] | None = None):
    """peft's LoraConfig for an adapter of `config` on the base model at `base_model_path`;
    `target_parameters`: its fused expert parameters, as `expert_target_parameters` names them."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=config.rank, lora_alpha=config.alpha, lora_dropout=0.0,
        target_modules=peft_target_modules(config, bool(target_parameters)),
        bias="none", task_type="CAUSAL_LM", base_model_name_or_path=str(base_model_path), inference_mode=True,
        **({"target_parameters": target_parameters} if target_parameters else {}),
    )


def peft_target_modules(config: LoraConfig, experts: bool) -> list[str]:
    """peft's `target_modules`. Beside fused experts, without the MLP names: peft reads `gate_proj` and
    `up_proj` on a Qwen3-MoE or OLMoE model (transformers' qwen2_moe conversion) as transformers 4's separate
    expert projections and fuses them into one LoRA of twice the rank on gate_up_proj, where the trainer
    trains one rank-r LoRA per expert on the fused gate_up_proj (the registry refuses MoE models with dense
    MLP layers, so nothing else has them). On Mixtral they name nothing (its transformers 4 names were w1,
    w3, w2)."""
    return [m for m in config.target_modules() if not (experts and m in MLP_MODULES)]


def expert_target_parameters(paths) -> list[str]:
    """peft's `target_parameters` for these LoRA'd fused expert parameter paths: "experts.gate_up_proj", ..."""
    return sorted({".".join(path.split(".")[-2:]) for path in paths})


def peft_weights(weights: dict) -> dict:
    """{module or parameter path: (A, B)} in the trainer's layout -> peft's safetensors keys and layouts.

    A Linear's A [r, in] and B [out, r] are stored as they are. A fused expert parameter's per-expert
    A [E, r, in] and B [E, out, r] become peft's ParamWrapper's (target_parameters): lora_A [E * r, in]
    (row e * r + i is expert e's row i) and lora_B [out, r * E] (column i * E + e is expert e's
    column i). peft wraps the targeted parameters of one module in their definition order, each
    wrapper around the last, so the first one's keys sit under one `.base_layer` per later one."""
    targeted: dict[str, list[str]] = {}
    for path, (a, _) in weights.items():
        if a.dim() == 3:
            module, _, name = path.rpartition(".")
            targeted.setdefault(module, []).append(name)
    tensors = {}
    for path, (a, b) in weights.items():
        if a.dim() == 2:
            prefix = f"base_model.model.{path}"
        else:
            module, _, name = path.rpartition(".")
            names = sorted(targeted[module], key=EXPERT_PARAMETERS.index)
            prefix = f"base_model.model.{module}" + ".base_layer" * (len(names) - 1 - names.index(name))
            experts, rank, in_features = a.shape
            a = a.reshape(experts * rank, in_features)
            b = b.permute(1, 2, 0).reshape(b.shape[1], rank * experts)
        tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
        tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    return tensors


def write_peft_files(folder: Path, config: LoraConfig, base_model_path: str | Path, pairs: dict) -> None:
    """`adapter_config.json` and `adapter_model.safetensors` of an adapter's {module or parameter path: (A, B)}
    (the trainer's layout; tensors that share no storage: safetensors refuses views of one) into `folder`."""
    from safetensors.torch import save_file

    experts = expert_target_parameters(path for path, (a, _) in pairs.items() if a.dim() == 3)
    peft_config(config, base_model_path, experts).save_pretrained(folder)
    save_file(peft_weights(pairs), folder / PEFT_WEIGHTS, metadata={"format": "pt"})


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
    manifest, tensors = read_verified_state(state)
    pairs = {}  # weight/<module path>.lora_A and .lora_B -> <module path>: (A, B)
    for name, tensor in tensors.items():
        if name.startswith("weight/") and name.endswith(".lora_A"):
            path = name.removeprefix("weight/").removesuffix(".lora_A")
            pairs[path] = (tensor, tensors[f"weight/{path}.lora_B"])
    with store.writing(dest) as tmp:
        write_peft_files(tmp, LoraConfig(**manifest["lora_config"]), base_model_path, pairs)
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
