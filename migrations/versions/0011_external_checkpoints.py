"""Checkpoints may be external exports (save_weights_external: the adapter merged into the base
model, as a Hugging Face folder): the kind constraint admits "external".

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06

Written out in full, not imported from db.models (as 0001 explains).
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _kind_check(kinds: tuple[str, ...]) -> None:
    # SQLite alters a table by copying it (batch mode); the old check goes by its name
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_constraint(op.f("ck_checkpoints_kind"), type_="check")
        batch.create_check_constraint(op.f("ck_checkpoints_kind"), f"kind IN ({', '.join(map(repr, kinds))})")


def upgrade() -> None:
    _kind_check(("training_state", "sampler", "external"))


def downgrade() -> None:
    op.execute("DELETE FROM checkpoints WHERE kind = 'external'")
    _kind_check(("training_state", "sampler"))
