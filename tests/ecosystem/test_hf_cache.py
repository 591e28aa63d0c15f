"""loraplex.hf_cache writes the Hugging Face cache layout that huggingface_hub itself reads."""

from __future__ import annotations

import hashlib
import os

import pytest
from huggingface_hub import scan_cache_dir, try_to_load_from_cache

from loraplex.hf_cache import CacheRepo, write_snapshot

FIRST, SECOND = "1" * 40, "2" * 40


def test_huggingface_hub_finds_what_was_written(tmp_path):
    files = {"tokenizer.json": b'{"version": "1.0"}', "nested/extra.txt": b"extra"}
    snapshot = write_snapshot("org/model", FIRST, files, tmp_path)
    repo = tmp_path / "models--org--model"
    assert snapshot == repo / "snapshots" / FIRST and (repo / "refs" / "main").read_text() == FIRST
    for path, data in files.items():
        pointer = snapshot / path
        assert pointer.is_symlink() and os.readlink(pointer).startswith("../")  # relative, as huggingface_hub links
        assert pointer.resolve() == repo / "blobs" / hashlib.sha256(data).hexdigest()
        assert try_to_load_from_cache("org/model", path, cache_dir=tmp_path) == str(pointer)
    info = scan_cache_dir(tmp_path)
    assert info.warnings == [] and [r.repo_id for r in info.repos] == ["org/model"]


def test_a_new_revision_becomes_main_and_the_old_snapshot_stays(tmp_path):
    write_snapshot("org/model", FIRST, {"tokenizer.json": b"old"}, tmp_path)
    write_snapshot("org/model", SECOND, {"tokenizer.json": b"new"}, tmp_path)
    assert (tmp_path / "models--org--model" / "refs" / "main").read_text() == SECOND
    assert open(try_to_load_from_cache("org/model", "tokenizer.json", cache_dir=tmp_path), "rb").read() == b"new"
    assert try_to_load_from_cache("org/model", "tokenizer.json", cache_dir=tmp_path, revision=FIRST) is not None


def test_names_and_paths_from_a_server_cannot_leave_the_repo_folder(tmp_path):
    for bad in ("../escape", "a/b/c", ""):
        with pytest.raises(ValueError, match="model: .* is not a hub id"):
            CacheRepo(bad, tmp_path)
    repo = CacheRepo("org/model", tmp_path)
    for bad in ("../../../escape", "/etc/passwd", "a/../../b", "a\\b", ""):
        with pytest.raises(ValueError, match="path: .* is not a relative path inside a snapshot"):
            repo.add(FIRST, bad, b"x")
    with pytest.raises(ValueError, match="revision: expected 40 hex digits"):
        repo.add("main/../..", "tokenizer.json", b"x")
    assert not any(tmp_path.rglob("*"))
