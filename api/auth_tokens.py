"""Short-lived signed tokens for the Tinker SDK's auth exchange (docs/operations.md, "Tokens").

With `jwt_auth` on, the client config tells the SDK `pjwt_auth_enabled`; the SDK then posts its API key
to /api/v1/auth/token, gets a JWT (HS256, signed with the server's secret) and sends that as X-API-Key
until it nears expiry. The token names the key it was exchanged for: each use still checks that key
and its tenant are live, so revoking the key or disabling the tenant ends its tokens at once. Keys stay
hashed at rest; tokens are never stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import cached_property
from pathlib import Path

import jwt

from api.kept_secrets import kept_secret

ALGORITHM = "HS256"
ISSUER = "loraplex"
SECRET_FILE = "jwt_signing_key"
MIN_SECRET_BYTES = 32  # RFC 7518 3.2: an HS256 key at least as long as the hash
# What a JWT starts with (the base64 of '{"'); a Tinker SDK refuses any other credential that is not tml-.
JWT_PREFIX = "eyJ"
VERIFIED_CACHE_SIZE = 4096  # tokens whose signature was checked (one per live client, refreshed each half-life)
# The 401 header that makes the SDK exchange its key again and replay the request once (RFC 6750).
INVALID_TOKEN = {"WWW-Authenticate": 'Bearer error="invalid_token"'}


def looks_like_jwt(credential: str) -> bool:
    return credential.startswith(JWT_PREFIX) and credential.count(".") == 2


class TokenIssuer:
    """Signs and verifies the exchange's tokens. The claims are what the SDK's whoami reads (sub,
    org_id, email) plus the ids this server checks on each use (tenant_id, key_id)."""

    def __init__(self, secret: Callable[[], bytes], lifetime_seconds: int) -> None:
        """`secret` is read on first use: an app that never sees a token makes no secret file."""
        self._read_secret, self.lifetime_seconds = secret, lifetime_seconds
        self._verified: dict[str, dict] = {}  # token -> its claims, checked once

    @cached_property
    def _secret(self) -> bytes:
        secret = self._read_secret()
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"jwt_signing_key: at least {MIN_SECRET_BYTES} bytes are needed, got {len(secret)}")
        return secret

    def issue(self, *, key_id: str, tenant_id: str, tenant_name: str) -> str:
        now = int(time.time())
        claims = {"iss": ISSUER, "sub": f"loraplex:api_key:{key_id}", "org_id": tenant_name, "email": "",
                  "tenant_id": tenant_id, "key_id": key_id, "iat": now, "exp": now + self.lifetime_seconds}
        return jwt.encode(claims, self._secret, algorithm=ALGORITHM)

    def verify(self, token: str) -> dict | None:
        """The claims of a token this server signed and that has not expired; None otherwise. A token
        comes with every request of its client: its signature is checked once, then remembered until
        it expires (the caller still checks its key on each use)."""
        known = self._verified.get(token)
        if known is not None and known["exp"] > time.time():
            return known
        try:
            claims = jwt.decode(token, self._secret, algorithms=[ALGORITHM], issuer=ISSUER,
                                options={"require": ["exp", "iat", "sub", "tenant_id", "key_id"]})
        except jwt.InvalidTokenError:
            return None
        if len(self._verified) >= VERIFIED_CACHE_SIZE:
            self._verified.clear()
        self._verified[token] = claims
        return claims


def signing_secret(configured: str, data_dir: Path) -> bytes:
    """The configured secret, else the one kept in the data dir (api/kept_secrets.py)."""
    return configured.encode() if configured else kept_secret(data_dir, SECRET_FILE)


def issuer_from(settings) -> TokenIssuer | None:
    """The issuer these settings call for; None when jwt_auth is off."""
    if not settings.jwt_auth:
        return None
    configured, data_dir = settings.jwt_signing_key.get_secret_value(), settings.data_dir
    return TokenIssuer(lambda: signing_secret(configured, data_dir), settings.jwt_lifetime_seconds)
