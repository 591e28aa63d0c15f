"""Signed, expiring download URLs: the URL itself is the credential.

Tinker's SDK and CLI fetch each file of an external-weights export with a plain GET and no API key
(protocol: get_external_weights_urls), so the URL carries its own proof: an HMAC-SHA256, under a
server key, of the checkpoint's record id, the file and the expiry time. A URL whose expiry passed,
or whose path, expiry or signature was changed, is refused with 403; a URL of an export deleted (or
made again under the same name: a new record) since it was signed finds nothing.

The key is `download_url_key` when set (every API replica must share it); otherwise a random key
made once and kept in the data dir, which the replicas of a distributed deployment mount too.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from pathlib import Path
from urllib.parse import quote

from api.kept_secrets import kept_secret

KEY_FILE = "download_url.key"


def signing_key(settings) -> bytes:
    return settings.download_url_key.encode() if settings.download_url_key else kept_secret(Path(settings.data_dir), KEY_FILE)


def signature(key: bytes, checkpoint_record: str, file: str, expires: int) -> str:
    message = f"{checkpoint_record}\n{file}\n{expires}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def signed_url(base_url: str, key: bytes, tinker_path: str, checkpoint_record: str, file: str, expires: int) -> str:
    """`base_url` (the server as the caller reached it) + the download route of `file` of the export
    at `tinker_path` (tinker://<run>/external_weights/<name>)."""
    run_id, _, name = tinker_path.removeprefix("tinker://").split("/")
    query = f"expires={expires}&signature={signature(key, checkpoint_record, file, expires)}"
    return f"{base_url.rstrip('/')}/api/v1/external_weights/{quote(run_id, safe='')}/{name}/{quote(file)}?{query}"


def valid(key: bytes, checkpoint_record: str, file: str, expires: int, given: str, now: float | None = None) -> bool:
    """Whether `given` signs this file until `expires`, and that time has not passed."""
    expected = signature(key, checkpoint_record, file, expires)
    # (compare_digest refuses non-ASCII text: a hostile signature is simply not this one)
    return given.isascii() and hmac.compare_digest(expected, given) and (time.time() if now is None else now) < expires
