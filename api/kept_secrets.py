"""Server secrets kept in the data dir when no setting gives them (the JWT signing secret, the key of
signed download URLs): made once, on first use, readable by the service's user only. Replicas that
share the data dir share them; others need the setting."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def kept_secret(data_dir: Path, name: str) -> bytes:
    path = data_dir / name
    try:
        return path.read_bytes().strip()
    except FileNotFoundError:
        pass
    data_dir.mkdir(parents=True, exist_ok=True)
    draft = data_dir / f".{name}.{os.getpid()}.{secrets.token_hex(4)}"
    draft.write_bytes(secrets.token_urlsafe(48).encode())
    draft.chmod(0o600)
    try:  # link, not rename: of two processes starting at once, the first one's secret is the one kept
        os.link(draft, path)
    except FileExistsError:
        pass
    finally:
        draft.unlink()
    return path.read_bytes().strip()
