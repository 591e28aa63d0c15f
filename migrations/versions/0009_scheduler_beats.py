"""Scheduler beats: each running scheduler's row, refreshed every few seconds, so that
`loraplex-admin models reset` can tell that a service holds the models' weights in memory.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05

Written out in full, not imported from db.models (as 0001 explains).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "scheduler_beats",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("host", sa.String(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("beat_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_scheduler_beats")),
    )


def downgrade() -> None:
    op.drop_table("scheduler_beats")
