"""Deleting a checkpoint: its files in the store and its record, in that order (the API's DELETE,
the janitor's sweeps and `loraplex-admin checkpoints delete` share it)."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Session

from db.models import Checkpoint
from storage import store


def checkpoint_root(storage_path: str, kind: str) -> str:
    """The folder holding every file of a checkpoint (all versions, for sampler weights)."""
    return store.parent(storage_path) if kind == "sampler" else storage_path


def delete_checkpoint(s: Session, row: Checkpoint) -> None:
    """Its files, then its record (the caller commits): a crash in between leaves a record whose
    files are gone, which answers 404 on use, never files without a record. Files another checkpoint
    still uses (a copy, copy_weights, shares its source's) stay: the last one to go deletes them."""
    root = checkpoint_root(row.storage_path, row.kind)
    if not _shared(s, row, root):
        store.delete(root)
    s.delete(row)


def _shared(s: Session, row: Checkpoint, root: str) -> bool:
    """Whether a checkpoint other than `row` has its files under `root`."""
    under = sa.or_(Checkpoint.storage_path == root, Checkpoint.storage_path.startswith(root + "/", autoescape=True))
    # copies are of their own tenant only (api/routes/copies.py): its checkpoints are all to look at
    return s.scalar(sa.select(sa.exists().where(Checkpoint.tenant_id == row.tenant_id, Checkpoint.id != row.id, under)))
