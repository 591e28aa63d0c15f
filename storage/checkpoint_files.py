"""Checkpoint files that can be read and checked without torch: formats, manifests, integrity.

Training-state checkpoints and sampler snapshots (written by checkpoints.py) carry a
`manifest.json` with the SHA-256 of their files. Reading a manifest and verifying the files
against it needs no tensors, so the API (a checkpoint's lora_config before loading it, a
snapshot's policy version) and the scheduler (which stored state verifies) do it here, without
loading torch.

Errors name the file inside the checkpoint (state.safetensors, adapter_model.safetensors), never
the server's path (it holds the tenant's id): callers put the checkpoint's tinker:// path in front.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from contract.errors import EngineError
from storage import store

STATE_FORMAT = "loraplex-training-state/1"
SNAPSHOT_FORMAT = "loraplex-peft-snapshot/1"  # a PEFT folder's manifest: {"files_sha256": {name: digest}}
STATE_TENSORS = "state.safetensors"
MANIFEST = "manifest.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
SNAPSHOT_METADATA = "loraplex.json"  # beside a PEFT folder's files: {"policy_version": steps, "adapter_id": ...}
TENSORS_CORRUPT = (f"{STATE_TENSORS} failed its integrity check "
                   "(its SHA-256 differs from the manifest: corrupt or truncated)")


class CheckpointError(EngineError):
    """A checkpoint that is missing, corrupt, or does not fit this base model."""

    category = "user"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_snapshot_manifest(folder: Path) -> None:
    """A sampler snapshot's manifest: the SHA-256 of every file beside it."""
    files = {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps({"format": SNAPSHOT_FORMAT, "files_sha256": files}, indent=2))


def snapshot_integrity(folder: str | Path) -> list[str] | None:
    """The files of a local sampler snapshot folder that fail its manifest (changed, truncated or
    missing; the manifest itself if unreadable), [] if all match, None if it has no manifest (a
    snapshot written before snapshots had one: nothing to check it against)."""
    folder = Path(folder)
    if not (folder / MANIFEST).exists():
        return None
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        expected = dict(manifest["files_sha256"]) if manifest.get("format") == SNAPSHOT_FORMAT else None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError):
        expected = None
    if expected is None:
        return [MANIFEST]
    return [name for name, digest in sorted(expected.items())
            if not (folder / name).is_file() or sha256_file(folder / name) != digest]


def read_snapshot_metadata(path: str | Path) -> dict | None:
    """The `loraplex.json` of a sampler snapshot folder, or None if the folder or file is missing."""
    return store.read_json(path, SNAPSHOT_METADATA)


def snapshot_policy_version(path: str) -> int | None:
    """The policy version of a sampler snapshot folder, or None while it is not written."""
    try:
        return _written_snapshot_version(path)
    except FileNotFoundError:
        return None  # not cached: the folder may be written a moment later


@functools.lru_cache(maxsize=4096)  # snapshot folders are immutable once written; bounded, unlike the runs
def _written_snapshot_version(path: str) -> int:
    metadata = read_snapshot_metadata(path)
    if metadata is None:
        raise FileNotFoundError(path)
    return int(metadata["policy_version"])


def read_manifest(path: str | Path) -> dict | None:
    """The manifest of a training-state checkpoint, or None if there is none (not verified)."""
    return store.read_json(path, MANIFEST)


def verified_manifest(location: str | Path) -> tuple[dict, Path]:
    """The manifest of a training state and its tensors file, checked as far as reading the manifest goes."""
    path = store.local_folder(location)
    if path is None:
        raise CheckpointError("no checkpoint is there (the folder is missing)")
    manifest_path, tensors_path = path / MANIFEST, path / STATE_TENSORS
    for required in (manifest_path, tensors_path):
        if not required.is_file():
            raise CheckpointError(f"not a training-state checkpoint: {required.name} is missing")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{MANIFEST} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != STATE_FORMAT:
        raise CheckpointError(f"{MANIFEST}: unsupported checkpoint format "
                              f"{manifest.get('format') if isinstance(manifest, dict) else manifest!r}")
    return manifest, tensors_path


def verify_training_state(location: str | Path) -> dict:
    """The manifest of a training state whose tensors match their SHA-256 (CheckpointError if not)."""
    manifest, tensors_path = verified_manifest(location)
    if sha256_file(tensors_path) != manifest.get("tensors_sha256"):
        raise CheckpointError(TENSORS_CORRUPT)
    return manifest
