"""External weights (save_weights_external): a run's adapter as files to serve elsewhere.

One folder, written atomically like every checkpoint (storage/store.py):

    adapter_config.json, adapter_model.safetensors   the PEFT adapter (what `tinker checkpoint push-hf`
                                                     uploads; its base model named by hub id)
    merged/                                          a Hugging Face model folder: the adapter merged into
        config.json, model.safetensors, ...          the base weights, with the base's tokenizer;
                                                     transformers and vLLM load it as a plain model
    manifest.json                                    every other file's size and SHA-256

Merging is peft's own `merge_and_unload` on the base model as the registry built it, in float32, then
saved in the base checkpoint's dtype. Reading the manifest needs no torch (the API lists the files
from it); writing imports torch, peft and transformers inside the function that does it.

With age recipients (native "age1..." keys or SSH public keys), every file but the manifest is
encrypted to them with pyrage (rage's bindings) and stored as `<file>.age`; the plain files never
reach the store. The manifest then lists the encrypted files: it is the server's, and names no content.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from storage import store
from storage.checkpoint_files import MANIFEST, PEFT_WEIGHTS, CheckpointError, sha256_file

EXTERNAL_FORMAT = "loraplex-external-weights/1"
MERGED = "merged"  # the merged Hugging Face folder, beside the PEFT adapter's files
ADAPTER_FILES = ("adapter_config.json", PEFT_WEIGHTS)
AGE_SUFFIX = ".age"
MAX_AGE_RECIPIENTS = 10  # as Tinker's SDK documents


def age_recipient(text: str):
    """The pyrage recipient `text` names: a native age key ("age1...") or an SSH public key; ValueError if neither."""
    import pyrage

    kind = pyrage.ssh.Recipient if text.startswith(("ssh-", "ecdsa-")) else pyrage.x25519.Recipient
    try:
        return kind.from_str(text)
    except pyrage.RecipientError as e:
        raise ValueError(f"not an age recipient (an age1... key or an SSH public key): {text[:80]!r} ({e})") from None


def write_external_weights(adapter: Path, dest: str | Path, base_model_path: str | Path, base_model: str,
                           age_recipients: list[str] | None = None) -> str | Path:
    """Write the export of the PEFT folder `adapter` (trained on the base model at `base_model_path`,
    which clients know as `base_model`) to the store location `dest`, encrypted to `age_recipients` if any."""
    with store.writing(dest) as tmp:
        for name in ADAPTER_FILES:
            shutil.copyfile(adapter / name, tmp / name)
        config = json.loads((tmp / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = base_model  # not this server's folder: a name users can resolve
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
        _write_merged(adapter, tmp / MERGED, base_model_path)
        if age_recipients:
            _encrypt_files(tmp, [age_recipient(r) for r in age_recipients])
        files = {str(p.relative_to(tmp)): {"size_bytes": p.stat().st_size, "sha256": sha256_file(p)}
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = {"format": EXTERNAL_FORMAT, "base_model": base_model, "age_encrypted": bool(age_recipients),
                    "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return dest


def _write_merged(adapter: Path, dest: Path, base_model_path: str | Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    saved_dtype = AutoConfig.from_pretrained(base_model_path).dtype or torch.float32
    base = AutoModelForCausalLM.from_pretrained(base_model_path, dtype=torch.float32)
    if "lm_head" in json.loads((adapter / "adapter_config.json").read_text())["target_modules"]:
        _untie_unembedding(base)
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    merged.to(saved_dtype).save_pretrained(dest)  # safetensors
    AutoTokenizer.from_pretrained(base_model_path).save_pretrained(dest)


def _encrypt_files(folder: Path, recipients: list) -> None:
    import pyrage

    for path in [p for p in folder.rglob("*") if p.is_file()]:
        pyrage.encrypt_file(str(path), str(path.with_name(path.name + AGE_SUFFIX)), recipients)
        path.unlink()


def _untie_unembedding(model) -> None:
    """A LoRA on lm_head changes the unembedding only: where the base ties it to the embedding (one
    tensor), merging into it would change the input embeddings too. Give lm_head its own copy."""
    from torch import nn

    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight.data_ptr() != embed.weight.data_ptr():
        return
    head.weight = nn.Parameter(embed.weight.detach().clone())
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False


def read_external_manifest(location: str | Path) -> dict:
    """An export's manifest (CheckpointError if the folder or its manifest is missing or not one)."""
    manifest = store.read_json(location, MANIFEST)
    if manifest is None or manifest.get("format") != EXTERNAL_FORMAT:
        raise CheckpointError(f"no external weights there ({MANIFEST} is missing or of another format)")
    return manifest


def external_file(location: str | Path, name: str) -> Path:
    """The local path of the export's file `name` (a path relative to the export, as its manifest
    lists it); CheckpointError if the manifest lists no such file or the folder is gone."""
    if name != MANIFEST and name not in read_external_manifest(location)["files"]:
        raise CheckpointError(f"the export has no file {name!r}")
    folder = store.local_folder(location)
    if folder is None or not (folder / name).is_file():
        raise CheckpointError(f"the export's file {name!r} is missing")
    return folder / name


def is_external(folder: Path) -> bool:
    manifest = store.read_json(folder, MANIFEST)
    return manifest is not None and manifest.get("format") == EXTERNAL_FORMAT


def copy_adapter(folder: Path, dest: str | Path) -> Path:
    """The PEFT adapter of the export in the local `folder`, copied to `dest`, its files checked first."""
    manifest = read_external_manifest(folder)
    if manifest.get("age_encrypted"):
        raise CheckpointError("its files are encrypted with age: download them (get_external_weights_urls) and "
                              "decrypt them with `age -d`")
    files = manifest["files"]
    for name in ADAPTER_FILES:
        if sha256_file(folder / name) != files[name]["sha256"]:
            raise CheckpointError(f"{name} failed its SHA-256 check (the file is corrupt)")
    Path(dest).mkdir(parents=True)
    for name in ADAPTER_FILES:
        shutil.copyfile(folder / name, Path(dest) / name)
    return Path(dest)


def external_file_names(location: str | Path) -> list[str]:
    """Every file of an export, its manifest included: what a download fetches."""
    return [*read_external_manifest(location)["files"], MANIFEST]
