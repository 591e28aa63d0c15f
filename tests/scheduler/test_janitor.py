"""Ephemeral sampler snapshots go away once superseded and unused; expired checkpoints go away.
A real embedded server on `tiny` makes the snapshots through the official SDK; the sweep runs here."""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa
import tinker

from db import usage
from db.models import Checkpoint, Request, Sampler, TrainingModel, utcnow
from scheduler.janitor import sweep
from storage import store
from tests.servers import running_server

GRACE = 60.0


def test_superseded_unused_snapshots_and_expired_checkpoints_are_deleted(tmp_path):
    with running_server(tmp_path, sampler_enabled=False) as server:
        client = tinker.ServiceClient(base_url=server.base_url, api_key=server.new_tenant())
        tc = client.create_lora_training_client(base_model="tiny", rank=4).result()
        for _ in range(3):
            tc.save_weights_and_get_sampling_client().result()
        named = tc.save_weights_for_sampler("keep").result().path
        expiring = tc.save_state("old", ttl_seconds=3600).result().path
        sessions = server.embedded.sessions
        with sessions() as s:
            snapshots = s.scalars(sa.select(Checkpoint).where(Checkpoint.ephemeral.is_(True))
                                  .order_by(Checkpoint.created_at)).all()
            assert len(snapshots) == 3 and not s.scalar(sa.select(Checkpoint.ephemeral)
                                                       .where(Checkpoint.tinker_path == named))
            tenant = s.scalar(sa.select(TrainingModel.tenant_id).where(TrainingModel.id == tc.model_id))
            for row in snapshots[:2]:  # older than the grace period
                row.created_at = utcnow() - timedelta(seconds=2 * GRACE)
            # the second one was sampled just now (a sample request of its sampler)
            sampler = s.scalar(sa.select(Sampler.id).where(Sampler.adapter_path == snapshots[1].storage_path))
            s.add(Request(tenant_id=tenant, model_id=sampler, seq_id=0, kind="sample",
                          payload=b"{}", payload_content_type="application/json"))
            s.execute(sa.update(Checkpoint).where(Checkpoint.tinker_path == expiring)
                      .values(expires_at=utcnow() - timedelta(seconds=1)))
            s.commit()
            paths = [row.storage_path for row in snapshots]
            before = usage.storage_bytes(s, tenant)

        assert sweep(sessions, GRACE) == (1, 1, 0)
        with sessions() as s:
            left = set(s.scalars(sa.select(Checkpoint.storage_path).where(Checkpoint.ephemeral.is_(True))))
            assert left == set(paths[1:])  # the first went; the sampled one and the newest stay
            assert s.scalar(sa.select(Checkpoint).where(Checkpoint.tinker_path == expiring)) is None
            assert s.scalar(sa.select(Checkpoint).where(Checkpoint.tinker_path == named)) is not None
            assert usage.storage_bytes(s, tenant) < before
        assert not store.exists(paths[0]) and store.exists(paths[2])
        assert sweep(sessions, GRACE) == (0, 0, 0)
