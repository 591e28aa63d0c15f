"""Where checkpoints, sampler snapshots and adapter state live: a local path (the default: the
data dir) or an fsspec URL that every process reaches (`s3://bucket/prefix`, `webdav://path`, ...).
A remote filesystem's options come from fsspec's own configuration, e.g. the environment
variables FSSPEC_S3_ENDPOINT_URL or FSSPEC_WEBDAV_BASE_URL, and its package must be installed
(s3fs, gcsfs, webdav4, ...).

Engines and vLLM read and write local folders, so the store moves whole folders:
- `writing(location)` yields an empty local folder to fill and publishes it when the block ends.
  On a local store it is renamed into place (atomic). On a remote store it is uploaded as a new
  version, `<location>/<version>/...`, then `<location>/CURRENT` is switched to it (one small
  write: atomic on object stores and WebDAV) and the old version is removed, so a reader never
  sees half a folder, and a crash mid-upload leaves the previous version current.
- `local_folder(location)` gives a local folder to read: the folder itself on a local store; on a
  remote one, a download of the current version into this process's cache (`use_cache_dir`),
  reused while that version is current (a version never changes once written).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import fsspec

CURRENT = "CURRENT"
DEFAULT_CACHE_DIR = Path(tempfile.gettempdir()) / "loraplex-store-cache"
# Where local_folder downloads remote folders. One per process, set by its entry point from
# Settings.store_cache (use_cache_dir), rather than a parameter: every reader of the store shares it
# (API routes, the scheduler's state checks, the trainer and sampler engines, the admin CLI), as
# they share fsspec's own configuration, and passing it down would add it to each function that
# reads a checkpoint by its location.
_cache_dir = DEFAULT_CACHE_DIR


def use_cache_dir(path: str | Path) -> None:
    """Download remote folders under `path` from now on (empty: DEFAULT_CACHE_DIR)."""
    global _cache_dir
    _cache_dir = Path(path).expanduser() if str(path) else DEFAULT_CACHE_DIR


def cache_dir() -> Path:
    return _cache_dir


def is_remote(location: str | Path) -> bool:
    return "://" in str(location) and not str(location).startswith("file://")


def join(location: str | Path, *parts: str) -> str:
    if is_remote(location):
        return "/".join([str(location).rstrip("/"), *parts])
    return str(Path(location, *parts))


def parent(location: str | Path) -> str:
    return str(location).rstrip("/").rsplit("/", 1)[0] if is_remote(location) else str(Path(location).parent)


@contextmanager
def atomic_folder(dest: str | Path) -> Iterator[Path]:
    """Yield a temporary folder; on success it replaces `dest` in one rename."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield staging
        if dest.exists():  # overwrite: move the old folder aside first (a dir rename cannot replace a non-empty dir)
            trash = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.replace(dest, trash / "old")
            os.replace(staging, dest)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _fs(location: str):
    return fsspec.core.url_to_fs(location)


def _current_version(fs, path: str) -> str | None:
    try:
        return fs.cat_file(f"{path}/{CURRENT}").decode().strip() or None
    except FileNotFoundError:
        return None


@contextmanager
def writing(location: str | Path) -> Iterator[Path]:
    """An empty local folder; when the block ends without error, it becomes `location`."""
    if not is_remote(location):
        with atomic_folder(location) as folder:
            yield folder
        return
    staging = Path(tempfile.mkdtemp(prefix="loraplex-upload-"))
    try:
        yield staging
        fs, path = _fs(str(location))
        old, version = _current_version(fs, path), uuid.uuid4().hex
        fs.makedirs(f"{path}/{version}", exist_ok=True)
        fs.put(f"{staging}/", f"{path}/{version}/", recursive=True)
        fs.pipe_file(f"{path}/{CURRENT}", version.encode())
        if old is not None:
            fs.rm(f"{path}/{old}", recursive=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def local_folder(location: str | Path) -> Path | None:
    """A local folder holding what is at `location` (None if nothing is)."""
    if not is_remote(location):
        return Path(location) if Path(location).is_dir() else None
    fs, path = _fs(str(location))
    version = _current_version(fs, path)
    if version is None:
        return None
    cached = _cache_dir / hashlib.sha256(str(location).encode()).hexdigest()[:24] / version
    if not cached.is_dir():
        cached.parent.mkdir(parents=True, exist_ok=True)
        download = Path(tempfile.mkdtemp(prefix=".download-", dir=cached.parent))
        try:
            fs.get(f"{path}/{version}/", f"{download}/", recursive=True)
            os.replace(download, cached)  # another process may have won the race: either copy is right
        except OSError:
            if not cached.is_dir():
                raise
        finally:
            shutil.rmtree(download, ignore_errors=True)
    return cached


def exists(location: str | Path) -> bool:
    """Whether a folder is at `location` (on a remote store: a published version of one)."""
    if not is_remote(location):
        return Path(location).exists()
    fs, path = _fs(str(location))
    return _current_version(fs, path) is not None


def read_json(location: str | Path, name: str) -> dict | None:
    """The JSON file `name` of the folder at `location`, or None (missing or not JSON)."""
    try:
        if not is_remote(location):
            return json.loads(Path(location, name).read_text())
        fs, path = _fs(str(location))
        version = _current_version(fs, path)
        return None if version is None else json.loads(fs.cat_file(f"{path}/{version}/{name}"))
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def size(location: str | Path) -> int:
    if not is_remote(location):
        return sum(f.stat().st_size for f in Path(location).rglob("*") if f.is_file())
    fs, path = _fs(str(location))
    return int(fs.du(path))


def delete(location: str | Path) -> None:
    """Remove the folder at `location` and everything under it (nothing if it is gone)."""
    if not is_remote(location):
        shutil.rmtree(location, ignore_errors=True)
        return
    fs, path = _fs(str(location))
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass
