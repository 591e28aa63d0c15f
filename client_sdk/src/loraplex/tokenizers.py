"""Base-model tokenizers from the Loraplex server into the local Hugging Face cache.

A notebook on another machine has no hub access and cannot read the server's folders, yet
`AutoTokenizer.from_pretrained(hub_id)`, the official tinker SDK's `get_tokenizer()` and
tinker-cookbook's `get_tokenizer(name)` all load by hub id. `pull_tokenizer` (and the console
script `loraplex tokenizer pull MODEL`) fetches the files the server lists for MODEL, checks each
one's size and SHA-256, and writes them as a snapshot of that hub id (loraplex.hf_cache); after
it, those loaders work with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx

from loraplex.config import ClientConfig
from loraplex.errors import APIConnectionError, LoraplexError, status_error
from loraplex.hf_cache import CacheRepo


@dataclass(frozen=True)
class PulledTokenizer:
    model: str  # the hub id (the server's name for MODEL, which may have been an alias)
    revision: str
    path: Path  # the snapshot folder
    downloaded: tuple[str, ...]  # files fetched this time
    reused: tuple[str, ...]  # files the cache held already


def pull_tokenizer(base_url: str | None, api_key: str | None, model: str, *,
                   hub_cache: str | Path | None = None, timeout: float = 60.0) -> PulledTokenizer:
    """Fetch `model`'s tokenizer (hub id or alias) into the Hugging Face cache (`hub_cache`, default
    huggingface_hub's HF_HUB_CACHE). `base_url` and `api_key` as for ServiceClient (None: the
    environment or ~/.config/loraplex/config.toml). Only files the cache lacks are downloaded."""
    config = ClientConfig.resolve(base_url, api_key)
    # retries: connection failures only; an HTTP error is the server's answer
    with httpx.Client(base_url=config.base_url + "/api/v1", timeout=timeout, transport=httpx.HTTPTransport(retries=3),
                      headers={"X-API-Key": config.api_key, "User-Agent": "loraplex-sdk"}) as http:
        listing = _get(http, f"/tokenizers/{quote(model, safe='/')}/files").json()
        repo = CacheRepo(str(listing["model"]), hub_cache)
        revision = str(listing["revision"])
        downloaded, reused = [], []
        for entry in listing["files"]:
            path, size, sha256 = str(entry["path"]), int(entry["size"]), str(entry["sha256"])
            if repo.has(revision, path, sha256):
                reused.append(path)
                continue
            data = _get(http, f"/tokenizers/{quote(repo.repo_id, safe='/')}/files/{quote(path, safe='')}").content
            got = hashlib.sha256(data).hexdigest()
            if len(data) != size or got != sha256:
                raise LoraplexError(f"files.{path}: received {len(data)} bytes with sha256 {got}; the server "
                                    f"listed {size} bytes with sha256 {sha256} (nothing of it was cached)")
            repo.add(revision, path, data)
            downloaded.append(path)
    repo.set_ref(revision)  # last: refs/main never names a snapshot that is still missing files
    return PulledTokenizer(repo.repo_id, revision, repo.snapshot(revision), tuple(downloaded), tuple(reused))


def _get(http: httpx.Client, path: str) -> httpx.Response:
    try:
        response = http.get(path)
    except httpx.TransportError as e:
        raise APIConnectionError(f"{http.base_url}: {e}") from None
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        raise status_error(response.status_code, str(detail))
    return response


_tokenizer_lock = threading.Lock()


def load_tokenizer(config: ClientConfig, name: str):
    """The tokenizer the server names `name` (a hub id, or a local folder when the server serves
    one by path): pulled into the local cache if need be, then loaded from its snapshot."""
    path = name if Path(name).is_dir() else str(pull_tokenizer(config.base_url, config.api_key, name).path)
    # One at a time: importing transformers from several threads at once fails in its lazy
    # module loader ("cannot import name 'AutoTokenizer'"), as concurrent notebook runs do.
    # Each caller gets its own tokenizer: a fast tokenizer shared between threads can fail.
    with _tokenizer_lock:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
