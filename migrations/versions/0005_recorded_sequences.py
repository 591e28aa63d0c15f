"""Recorded sequences: what samplers with record_stability_info sampled, for stable_reinforce.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04

Written out in full, not imported from db.models (as 0001 explains).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "recorded_sequences",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("tenant_id", sa.String(),
                  sa.ForeignKey("tenants.id", name=op.f("fk_recorded_sequences_tenant_id_tenants")), nullable=False),
        sa.Column("sampler_id", sa.String(), nullable=True),
        sa.Column("policy_version", sa.Integer(), nullable=True),
        sa.Column("prompt_tokens", sa.LargeBinary(), nullable=False),
        sa.Column("tokens", sa.LargeBinary(), nullable=False),
        sa.Column("logprobs", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_recorded_sequences")),
    )
    op.create_index(op.f("ix_recorded_sequences_expires_at"), "recorded_sequences", ["expires_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_recorded_sequences_expires_at"), table_name="recorded_sequences")
    op.drop_table("recorded_sequences")
