"""Rollout retention: a per-tenant TTL and size quota for the rollout store, each trajectory's stored
size, and the indexes the janitor's sweeps use.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04

Written out in full, not imported from db.models (as 0001 explains).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("quotas") as batch:
        batch.add_column(sa.Column("rollout_ttl_seconds", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("max_rollout_bytes", sa.BigInteger(), nullable=True))
    # Trajectories recorded before this revision count 0 bytes until they expire or are deleted.
    with op.batch_alter_table("rollout_trajectories") as batch:
        batch.add_column(sa.Column("size_bytes", sa.BigInteger(), nullable=False, server_default="0"))
    op.create_index(op.f("ix_rollout_trajectories_tenant_id_updated_at"), "rollout_trajectories",
                    ["tenant_id", "updated_at"])
    op.create_index(op.f("ix_rollout_turns_adapter_path_created_at"), "rollout_turns", ["adapter_path", "created_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_rollout_turns_adapter_path_created_at"), table_name="rollout_turns")
    op.drop_index(op.f("ix_rollout_trajectories_tenant_id_updated_at"), table_name="rollout_trajectories")
    with op.batch_alter_table("rollout_trajectories") as batch:
        batch.drop_column("size_bytes")
    with op.batch_alter_table("quotas") as batch:
        batch.drop_column("max_rollout_bytes")
        batch.drop_column("rollout_ttl_seconds")
