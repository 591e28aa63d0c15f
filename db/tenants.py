"""Tenants and their API keys. A key is `tml-` + a random secret; only its SHA-256 is stored."""

from __future__ import annotations

import hashlib
import secrets

import sqlalchemy as sa
from sqlalchemy.orm import Session

from db.models import ApiKey, Tenant

KEY_PREFIX = "tml-"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def issue_key(s: Session, tenant: Tenant) -> str:
    """Create a key for `tenant` and return it; it is shown once and cannot be recovered."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    s.add(ApiKey(tenant_id=tenant.id, key_hash=hash_key(key), key_prefix=key[:12]))
    s.commit()
    return key


def create_tenant(s: Session, name: str) -> tuple[Tenant, str]:
    if s.scalar(sa.select(Tenant).where(Tenant.name == name)) is not None:
        raise ValueError(f"tenant {name!r} already exists")
    tenant = Tenant(name=name)
    s.add(tenant)
    s.flush()
    return tenant, issue_key(s, tenant)
