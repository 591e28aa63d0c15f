"""Operator keys: what logs into the dashboard's admin view (`loraplex-admin operator-keys issue`).
A key is `tmo-` + a random secret; only its SHA-256 is stored, as for tenant keys."""

from __future__ import annotations

import secrets

import sqlalchemy as sa
from sqlalchemy.orm import Session

from db.models import OperatorKey, utcnow
from db.tenants import hash_key

OPERATOR_KEY_PREFIX = "tmo-"


def issue_operator_key(s: Session) -> str:
    """Create a key and return it; it is shown once and cannot be recovered."""
    key = OPERATOR_KEY_PREFIX + secrets.token_urlsafe(32)
    s.add(OperatorKey(key_hash=hash_key(key), key_prefix=key[:12]))
    s.commit()
    return key


def revoke_operator_key(s: Session, key_prefix: str) -> int:
    """Revoke the live keys whose listed prefix (their first 12 characters) starts with `key_prefix`; how many."""
    rows = s.scalars(sa.select(OperatorKey).where(OperatorKey.key_prefix.startswith(key_prefix, autoescape=True),
                                                  OperatorKey.revoked_at.is_(None))).all()
    for row in rows:
        row.revoked_at = utcnow()
    s.commit()
    return len(rows)


def matching_operator_keys(s: Session, key_prefix: str) -> list[OperatorKey]:
    """The live keys that `key_prefix` names: their listed prefix starts with it, or it starts with
    their listed prefix (the whole key given)."""
    rows = s.scalars(sa.select(OperatorKey).where(OperatorKey.revoked_at.is_(None))).all()
    return [k for k in rows if k.key_prefix.startswith(key_prefix) or key_prefix.startswith(k.key_prefix)]
