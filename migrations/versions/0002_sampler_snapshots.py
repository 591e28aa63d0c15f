"""Samplers pin the snapshot folder they sample (adapter_path).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

A sampler created from saved weights keeps sampling exactly those weights, even when the same
checkpoint name is saved again later: every save writes a new folder, and the sampler records
the one that was current when it was created. NULL samples the base model.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("samplers") as batch:  # batch: SQLite cannot ALTER most things in place
        batch.add_column(sa.Column("adapter_path", sa.String(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("samplers") as batch:
        batch.drop_column("adapter_path")
