"""Quotas per tenant, and the tokens each sample request generated (usage).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "quotas",
        sa.Column("tenant_id", sa.String(), sa.ForeignKey("tenants.id", name=op.f("fk_quotas_tenant_id_tenants")),
                  nullable=False),
        sa.Column("max_live_models", sa.Integer(), nullable=True),
        sa.Column("max_lora_rank", sa.Integer(), nullable=True),
        sa.Column("train_tokens_per_day", sa.BigInteger(), nullable=True),
        sa.Column("sample_tokens_per_day", sa.BigInteger(), nullable=True),
        sa.Column("max_concurrent_requests", sa.Integer(), nullable=True),
        sa.Column("max_checkpoint_bytes", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_quotas")),
    )
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("output_tokens", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("output_tokens")
    op.drop_table("quotas")
