"""Files into the local Hugging Face cache, in the layout huggingface_hub itself reads
(https://huggingface.co/docs/huggingface_hub/guides/manage-cache):

    <HF_HUB_CACHE>/models--<org>--<name>/blobs/<sha256>
                                        /snapshots/<revision>/<file> -> ../../blobs/<sha256>
                                        /refs/main                      (holds <revision>)

With HF_HUB_OFFLINE=1, `AutoTokenizer.from_pretrained("<org>/<name>")` reads refs/main, then the
snapshot. The folder name is huggingface_hub's own `repo_folder_name`, the root its HF_HUB_CACHE
(HF_HOME/hub unless set). Every write lands whole (a temporary name, then os.replace), and
refs/main moves only after all of a snapshot's files are there, so a reader, a concurrent writer
or a crash never sees a half-written snapshot.
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

REVISION = re.compile(r"[0-9a-f]{40}")  # huggingface_hub's commit-hash form


class CacheRepo:
    """One model repo in a Hugging Face hub cache (`hub_cache`, default HF_HUB_CACHE)."""

    def __init__(self, repo_id: str, hub_cache: str | Path | None = None) -> None:
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(repo_id)
        except HFValidationError as e:
            raise ValueError(f"model: {repo_id!r} is not a hub id: {e}") from None
        self.repo_id = repo_id
        self.folder = Path(hub_cache or constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")

    def snapshot(self, revision: str) -> Path:
        if not REVISION.fullmatch(revision):
            raise ValueError(f"revision: expected 40 hex digits, got {revision[:64]!r}")
        return self.folder / "snapshots" / revision

    def pointer(self, revision: str, path: str) -> Path:
        parts = PurePosixPath(path).parts
        if not parts or PurePosixPath(path).is_absolute() or any(p in ("..", ".") for p in parts) or "\\" in path:
            raise ValueError(f"path: {path[:200]!r} is not a relative path inside a snapshot")
        return self.snapshot(revision).joinpath(*parts)

    def has(self, revision: str, path: str, sha256: str) -> bool:
        """Whether the snapshot holds `path` with exactly this content."""
        pointer = self.pointer(revision, path)
        return pointer.is_file() and hashlib.sha256(pointer.read_bytes()).hexdigest() == sha256

    def add(self, revision: str, path: str, data: bytes) -> None:
        """Store `data` as a blob named by its SHA-256 and point the snapshot's `path` at it."""
        pointer = self.pointer(revision, path)
        blob = self.folder / "blobs" / hashlib.sha256(data).hexdigest()
        if not (blob.is_file() and blob.stat().st_size == len(data)):
            _write_atomically(blob, data)
        pointer.parent.mkdir(parents=True, exist_ok=True)
        staged = pointer.with_name(f".{pointer.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            # relative, as huggingface_hub links them: the cache may move as a whole
            staged.symlink_to(os.path.relpath(blob, pointer.parent))
        except OSError:  # no symlinks here (some Windows setups): a copy, as huggingface_hub falls back to
            staged.write_bytes(data)
        os.replace(staged, pointer)

    def set_ref(self, revision: str, ref: str = "main") -> None:
        self.snapshot(revision)  # validates it
        _write_atomically(self.folder / "refs" / ref, revision.encode())


def write_snapshot(repo_id: str, revision: str, files: Mapping[str, bytes],
                   hub_cache: str | Path | None = None) -> Path:
    """Put `files` (path -> bytes) into the snapshot `revision` of `repo_id` and make it refs/main.
    Files already there with the same content are left alone. Returns the snapshot folder."""
    repo = CacheRepo(repo_id, hub_cache)
    for path, data in files.items():
        if not repo.has(revision, path, hashlib.sha256(data).hexdigest()):
            repo.add(revision, path, data)
    repo.set_ref(revision)
    return repo.snapshot(revision)


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    staged.write_bytes(data)
    os.replace(staged, path)
