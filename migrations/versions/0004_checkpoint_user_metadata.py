"""Checkpoints keep the user_metadata their save request carried (Tinker's Checkpoint.user_metadata),
and unnamed sampler snapshots are marked ephemeral (deleted once superseded and unused).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("user_metadata", sa.JSON(none_as_null=True), nullable=True))
        batch.add_column(sa.Column("ephemeral", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("ephemeral")
        batch.drop_column("user_metadata")
