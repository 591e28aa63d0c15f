"""Deleting a checkpoint: its files in the store and its record, in that order (the API's DELETE,
the janitor's sweeps and `loraplex-admin checkpoints delete` share it)."""

from __future__ import annotations

from sqlalchemy.orm import Session

from db.models import Checkpoint
from storage import store


def checkpoint_root(storage_path: str, kind: str) -> str:
    """The folder holding every file of a checkpoint (all versions, for sampler weights)."""
    return store.parent(storage_path) if kind == "sampler" else storage_path


def delete_checkpoint(s: Session, row: Checkpoint) -> None:
    """Its files, then its record (the caller commits): a crash in between leaves a record whose
    files are gone, which answers 404 on use, never files without a record."""
    store.delete(checkpoint_root(row.storage_path, row.kind))
    s.delete(row)
