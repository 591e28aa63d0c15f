"""Where the SDK finds the server and the key: arguments, then environment, then a config file.

    LORAPLEX_BASE_URL, LORAPLEX_API_KEY          (TINKER_BASE_URL / TINKER_API_KEY also work)
    ~/.config/loraplex/config.toml (or $LORAPLEX_CONFIG):  base_url = "..."  api_key = "tml-..."
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

DEFAULT_BASE_URL = "http://127.0.0.1:8000"


def _config_file() -> dict:
    path = Path(os.environ.get("LORAPLEX_CONFIG", Path.home() / ".config" / "loraplex" / "config.toml"))
    return tomllib.loads(path.read_text()) if path.is_file() else {}


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    api_key: str

    @classmethod
    def resolve(cls, base_url: str | None = None, api_key: str | None = None) -> "ClientConfig":
        file = _config_file()
        base_url = (base_url or os.environ.get("LORAPLEX_BASE_URL") or os.environ.get("TINKER_BASE_URL")
                    or file.get("base_url") or DEFAULT_BASE_URL)
        api_key = api_key or os.environ.get("LORAPLEX_API_KEY") or os.environ.get("TINKER_API_KEY") or file.get("api_key")
        if not api_key:
            raise ValueError("api_key: pass api_key=, or set LORAPLEX_API_KEY, or api_key in ~/.config/loraplex/config.toml")
        return cls(base_url.rstrip("/"), api_key)
