"""Each scheduler's row carries the memory of the trainers it feeds (resident and paged runs, bytes,
page-ins), refreshed with its beat, for `loraplex-admin trainers` and the operator dashboard.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06

Written out in full, not imported from db.models (as 0001 explains).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("scheduler_beats") as batch:
        batch.add_column(sa.Column("trainers", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("scheduler_beats") as batch:
        batch.drop_column("trainers")
