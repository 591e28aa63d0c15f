"""Ids and `tinker://` paths in the exact formats the Tinker SDK parses (protocol section 3)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from fastapi import HTTPException

from storage import store

# a tinker path's kind -> its checkpoint's (db CheckpointKind)
CHECKPOINT_KINDS = {"weights": "training_state", "sampler_weights": "sampler", "external_weights": "external"}
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def model_id(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def sampler_id(session_id: str, sampling_session_seq_id: int) -> str:
    return f"{session_id}:sample:{sampling_session_seq_id}"


def checkpoint_name(name: str, field: str) -> str:
    if not _NAME.match(name) or name in (".", ".."):
        raise HTTPException(400, f"{field}: checkpoint names use letters, digits, '.', '_' and '-' (1-128 chars), got {name!r}")
    return name


@dataclass(frozen=True)
class TinkerPath:
    run_id: str
    kind: str  # "weights" | "sampler_weights" | "external_weights"
    name: str

    def __str__(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"

    @classmethod
    def parse(cls, path: str, field: str = "path") -> "TinkerPath":
        parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] not in CHECKPOINT_KINDS or not parts[0]:
            raise HTTPException(400, f"{field}: expected tinker://<run_id>/weights|sampler_weights|external_weights/<name>, got {path!r}")
        return cls(parts[0], parts[1], checkpoint_name(parts[2], field))


def storage_path(checkpoint_dir: str, tenant_id: str, path: TinkerPath) -> str:
    """Where a checkpoint's files go: a location in the checkpoint store (storage/store.py)."""
    return store.join(checkpoint_dir, tenant_id, path.run_id, path.kind, path.name)


def snapshot_folder(checkpoint_folder: str, seq_id: int) -> str:
    """One version of a sampler checkpoint: <checkpoint folder>/seq-<the save's seq_id>."""
    return store.join(checkpoint_folder, f"seq-{seq_id}")
