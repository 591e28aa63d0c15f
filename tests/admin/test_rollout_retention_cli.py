"""`loraplex-admin` sets the rollout store's retention per tenant (`quotas set --rollout-ttl-seconds
--max-rollout-bytes`), and `checkpoints prune-expired` applies the TTL, on a fresh SQLite database
(turns recorded with db/rollouts.py, as the inference API records them)."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
import sqlalchemy as sa

from db import rollouts
from db.models import Quota, RolloutTrajectory, Tenant, new_id, utcnow
from db.session import make_engine, make_session_factory
from tests.admin.cli import admin_cli


@pytest.fixture
def admin(tmp_path):
    return admin_cli(tmp_path)


@pytest.fixture
def sessions(tmp_path, admin):
    admin("tenants", "list")  # creates and migrates the database
    engine = make_engine(f"sqlite:///{tmp_path / 'loraplex.db'}")
    yield make_session_factory(engine)
    engine.dispose()


def record(sessions, tenant_name: str, session_id: str) -> None:
    with sessions() as s:
        tenant_id = s.scalar(sa.select(Tenant.id).where(Tenant.name == tenant_name))
    turn = rollouts.NewTurn(
        id=new_id(), api="completions", model="tiny", sampler_path=None, adapter_path=None, policy_version=None,
        request_id=new_id(), prompt=[1, 2, 3], request_body={"prompt": [1, 2, 3]}, response_body={"id": "x"},
        choices=[rollouts.SampledChoice([4, 5], [-0.1, -0.2], "stop")])
    rollouts.record_turn(sessions, tenant_id, session_id, turn)


def value(output: str, field: str) -> str:
    return re.search(rf"{field} +│ ([^│]+?) +│", output)[1]


def test_quotas_set_and_show_the_rollout_limits(admin, sessions):
    admin("tenants", "create", "erin")
    shown = admin("quotas", "set", "erin", "--rollout-ttl-seconds", "86400", "--max-rollout-bytes", "5000")
    assert (value(shown, "rollout_ttl_seconds"), value(shown, "max_rollout_bytes")) == ("86400", "5000")
    shown = admin("quotas", "set", "erin", "--max-rollout-bytes", "none")  # the TTL stays as it was
    assert (value(shown, "rollout_ttl_seconds"), value(shown, "max_rollout_bytes")) == ("86400", "no limit")
    refused = admin("quotas", "set", "erin", "--rollout-ttl-seconds", "a week", ok=False)
    assert "--rollout-ttl-seconds" in refused and "a whole number or 'none'" in refused


def test_prune_expired_applies_each_tenants_own_ttl(admin, sessions):
    for name in ("frank", "grace"):
        admin("tenants", "create", name)
        record(sessions, name, "old")
    record(sessions, "frank", "new")
    admin("quotas", "set", "frank", "--rollout-ttl-seconds", "60")
    with sessions() as s:
        s.execute(sa.update(RolloutTrajectory).where(RolloutTrajectory.session_id == "old")
                  .values(updated_at=utcnow() - timedelta(seconds=120)))
        s.commit()
    assert "1 expired rollout trajectories deleted" in admin("checkpoints", "prune-expired")
    with sessions() as s:
        left = s.execute(sa.select(Tenant.name, RolloutTrajectory.session_id)
                         .join(Tenant, Tenant.id == RolloutTrajectory.tenant_id)).all()
        assert sorted(map(tuple, left)) == [("frank", "new"), ("grace", "old")]  # grace has no TTL


def test_the_size_quota_refuses_a_recording_once_reached(admin, sessions):
    admin("tenants", "create", "heidi")
    record(sessions, "heidi", "first")
    with sessions() as s:
        tenant_id = s.scalar(sa.select(Tenant.id).where(Tenant.name == "heidi"))
        used = rollouts.stored_bytes(s, tenant_id)
    assert used > 4 * (3 + 2 + 2)  # tokens, sampled tokens and logprobs, and the bodies as JSON
    admin("quotas", "set", "heidi", "--max-rollout-bytes", str(used + 1))
    record(sessions, "heidi", "first")  # under the limit: recorded (and now past it)
    with pytest.raises(rollouts.RolloutQuotaExceeded) as refused:
        record(sessions, "heidi", "second")
    assert refused.value.status_code == 403 and f"quota max_rollout_bytes={used + 1} would be exceeded" in \
        refused.value.detail
    with sessions() as s:
        assert s.get(Quota, tenant_id).max_rollout_bytes == used + 1
        assert s.scalar(sa.select(sa.func.count()).select_from(RolloutTrajectory)
                        .where(RolloutTrajectory.tenant_id == tenant_id)) == 1
