"""The auth exchange's tokens: signed by the server's secret, expiring, and the secret kept once."""

from __future__ import annotations

import pytest

from api.auth_tokens import TokenIssuer, looks_like_jwt, signing_secret

SECRET = b"s" * 32


def test_a_token_carries_what_whoami_reads_and_verifies_only_with_its_secret():
    token = TokenIssuer(lambda: SECRET, 900).issue(key_id="k1", tenant_id="t1", tenant_name="alice")
    assert looks_like_jwt(token) and not looks_like_jwt("tml-abc")
    claims = TokenIssuer(lambda: SECRET, 900).verify(token)
    assert (claims["sub"], claims["org_id"], claims["key_id"], claims["exp"] - claims["iat"]) == \
        ("loraplex:api_key:k1", "alice", "k1", 900)
    assert TokenIssuer(lambda: b"o" * 32, 900).verify(token) is None  # another server's secret
    expired = TokenIssuer(lambda: SECRET, -60).issue(key_id="k1", tenant_id="t1", tenant_name="alice")
    assert TokenIssuer(lambda: SECRET, 900).verify(expired) is None


def test_the_secret_is_made_once_in_the_data_dir_unless_configured(tmp_path):
    first = signing_secret("", tmp_path)
    assert len(first) >= 32 and signing_secret("", tmp_path) == first
    assert (tmp_path / "jwt_signing_key").stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["jwt_signing_key"]  # no draft left behind
    assert signing_secret("configured-" + "x" * 30, tmp_path) == b"configured-" + b"x" * 30
    with pytest.raises(ValueError, match="jwt_signing_key: at least 32 bytes"):
        TokenIssuer(lambda: b"short", 900).issue(key_id="k", tenant_id="t", tenant_name="n")
